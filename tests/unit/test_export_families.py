"""Whole-model exports of full fine-tuning runs round-trip for every family: a tiny random
transformers checkpoint is loaded, its trainable weights changed, exported with
:func:`~ember.core.full_checkpoint.export_hf`; the export holds exactly the base's keys and dtypes,
Ember's loader reads back the changed weights bit for bit, transformers computes the changed
model's logits, and what the trainer never held (frozen tables, the QSA indexer, MTP layers, vision
towers) is the base's bytes. Quantized bases are written in their own format (or dequantized)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ember.core.full_checkpoint as fc
from ember.core import quant
from ember.core.batch import pack
from ember.core.full_ft import clone_for_training, frozen_parameter_names, trainable_parameters
from ember.core.layers.attention import PackedAttention
from ember.core.loading import CheckpointReader, checkpoint_layout, load_model
from ember.core.logprobs import apply_softcap
from ember.core.models.base import ForwardContext
from tests.tiny_models import build_hf_model, random_sequences

FAMILIES = ["llama", "qwen3", "qwen3_moe", "olmo3", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen4_exp",
            "inkling2"]


def build(family: str):
    from tests.parity import test_deepseek_v3, test_inkling2, test_olmo3, test_qwen3_next, test_qwen4_exp

    if family in ("llama", "qwen3", "qwen3_moe"):
        return build_hf_model(family, seed=2)
    return {
        "olmo3": test_olmo3.build_hf,
        "deepseek_v3": lambda: test_deepseek_v3.build_hf("deepseek_v3"),
        "glm4_moe_lite": lambda: test_deepseek_v3.build_hf("glm4_moe_lite"),
        "qwen3_next": test_qwen3_next.build_hf,
        "qwen4_exp": test_qwen4_exp.build_hf,
        "inkling2": test_inkling2.build_hf_inkling2,
    }[family]()


def mtp_tensors(family: str, hf) -> dict[str, torch.Tensor]:
    """MTP weights as the families' releases store them (Ember builds no MTP layer)."""
    g = torch.Generator().manual_seed(9)
    if family in ("deepseek_v3", "glm4_moe_lite"):  # an extra decoder layer, per-expert weights
        n = hf.config.num_hidden_layers
        out = {f"model.layers.{n}.eh_proj.weight": torch.randn(64, 128, generator=g),
               f"model.layers.{n}.enorm.weight": torch.randn(64, generator=g)}
        for e in range(hf.config.n_routed_experts):
            for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                out[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=g)
        return out
    if family in ("qwen3_next", "qwen4_exp"):
        return {"mtp.fc.weight": torch.randn(64, 128, generator=g),
                "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(32, 64, generator=g),
                "mtp.norm.weight": torch.randn(64, generator=g)}
    return {}


def ember_logits(model, seq: list[int]) -> torch.Tensor:
    batch = pack([seq], [0], "cpu")
    attention = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    ctx = ForwardContext(positions=batch.positions, seq_lens=batch.doc_lengths,
                         attend=lambda layer, q, k, v, spec, scale: attention(q, k, v, spec, scale))
    with torch.no_grad():
        h = model.hidden_states(batch.input_ids, ctx)
        return apply_softcap(h @ model.unembed_weight.T, model.final_logit_softcap)[0]


def perturb(model, scale: float = 0.05, seed: int = 0) -> list[str]:
    """Add noise (relative to each weight's size) to every trainable parameter; their names."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in trainable_parameters(model):
            p.add_(scale * (p.std() if p.numel() > 1 else 1.0) * torch.randn(p.shape, generator=g) + 1e-3)
    return [n for n, _ in trainable_parameters(model)]


def stored(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {k: reader.raw(k) for k in [*reader.names(), *(s for n in reader.names()
                                                          for s in reader.scale_keys(n).values())]}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.flatten().view(torch.uint8),
                                                                     b.flatten().view(torch.uint8))


def untouched_keys(model, folder, names) -> set[str]:
    """Base keys no trained parameter fills (copied as they are)."""
    layout = checkpoint_layout(model, CheckpointReader(folder))
    trained = set(names) | ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    filled = {p.key for place in layout.values() if place.param in trained for p in place.pieces}
    return set(stored(folder)) - filled


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips(family, tmp_path):
    import transformers

    hf = build(family)
    base = tmp_path / "base"
    hf.save_pretrained(str(base))
    extra = mtp_tensors(family, hf)
    if extra:  # released checkpoints carry MTP layers Ember never builds
        tensors = load_file(str(base / "model.safetensors")) | extra
        save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    model = clone_for_training(load_model(base, "cpu", torch.float32))
    names = perturb(model)
    out = fc.export_hf(model, names, base, tmp_path / "hf", shard_bytes=200_000)

    before, after = stored(base), stored(out)
    assert set(after) == set(before)
    assert all(after[k].dtype == before[k].dtype and after[k].shape == before[k].shape for k in before)
    kept = untouched_keys(model, base, names)
    assert set(extra) <= kept
    assert all(same_bytes(after[k], before[k]) for k in kept), [k for k in kept if not same_bytes(after[k], before[k])]
    changed = set(before) - kept
    assert changed and all(not torch.equal(after[k], before[k]) for k in changed)
    if family == "qwen4_exp":  # the frozen n-gram table (row shards) and QSA indexer: the base's bytes
        frozen_keys = [k for k in before if "ngram_embedding" in k or ".indexer." in k]
        assert any("ngram_embedding.shard_" in k for k in frozen_keys) and any(".indexer." in k for k in frozen_keys)
        assert set(frozen_keys) <= kept
        assert frozen_parameter_names(model)
    if family == "inkling2":  # the released layout, interleaved experts
        assert any(k.endswith("mlp.experts.w13_weight") for k in before)

    # Ember reads the changed weights back exactly
    again = dict(load_model(out, "cpu", torch.float32).named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(again[n], p), n

    # transformers computes the changed model's logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    for seq in random_sequences(model.config.vocab_size, [19, 7], seed=3):
        with torch.no_grad():
            got = loaded(torch.tensor([seq])).logits[0]
            old = reference(torch.tensor([seq])).logits[0]
        want = ember_logits(model, seq)
        assert got.shape == want.shape
        rel = float((got - want).norm() / want.norm())
        assert rel <= 1e-5, rel
        assert float((old - want).norm() / want.norm()) > 1e-3  # the change shows


def test_released_qwen4_exp_layout_round_trips(tmp_path):
    """qwen4_exp's multimodal release (``model.language_model.`` prefix, nested ``text_config``,
    vision and MTP tensors): the export keeps that layout, read back by Ember's loader."""
    from tests.parity.test_qwen4_exp import build_hf

    hf = build_hf()
    plain = tmp_path / "plain"
    hf.save_pretrained(str(plain))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): t
               for k, t in load_file(str(plain / "model.safetensors")).items()}
    tensors |= mtp_tensors("qwen4_exp", hf) | {"model.visual.patch_embed.proj.weight": torch.randn(8, 3)}
    base = tmp_path / "release"
    base.mkdir()
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((plain / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text}))
    model = clone_for_training(load_model(base, "cpu", torch.float32))
    names = perturb(model)
    out = fc.export_hf(model, names, base, tmp_path / "hf", shard_bytes=100_000)
    before, after = stored(base), stored(out)
    assert set(after) == set(before)
    kept = untouched_keys(model, base, names)
    assert {"model.visual.patch_embed.proj.weight", "mtp.fc.weight"} <= kept
    assert any("ngram_embedding.shard_" in k for k in kept)
    assert all(same_bytes(after[k], before[k]) for k in kept)
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    again = dict(load_model(out, "cpu", torch.float32).named_parameters())
    assert all(torch.equal(again[n], p) for n, p in model.named_parameters())
    seq = random_sequences(320, [21], seed=4)[0]
    torch.testing.assert_close(ember_logits(load_model(out, "cpu", torch.float32), seq), ember_logits(model, seq),
                               rtol=0, atol=0)


def quantized_base(tmp_path, fmt: str):
    """A qwen3_moe folder with its routed experts in MXFP8 / NVFP4, or every linear in FP8 tiles
    (as DeepSeek-V3's release, declared in config.json)."""
    plain = tmp_path / "plain"
    build_hf_model("qwen3_moe", seed=4).save_pretrained(str(plain))
    config = json.loads((plain / "config.json").read_text())
    if fmt == "fp8_block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                         "activation_scheme": "dynamic"}
    out = {}
    for k, v in load_file(str(plain / "model.safetensors")).items():
        out[k] = v
        if fmt == "fp8_block" and k.endswith("_proj.weight") and ".gate." not in k:
            out[k], out[k + "_scale_inv"] = quant.quantize_fp8_block(v, block=16)
        elif fmt == "mxfp8" and ".experts." in k:
            out[k], out[k + "_scale"] = quant.quantize_mxfp8(v)
        elif fmt == "nvfp4" and ".experts." in k:
            out[k], out[k + "_scale"], out[k + "_scale_2"] = quant.quantize_nvfp4(v)
    folder = tmp_path / fmt
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_quantized_base_exports_in_its_format(fmt, tmp_path):
    base = quantized_base(tmp_path, fmt)
    before = stored(base)
    reader = CheckpointReader(base)
    quantized = [k for k in reader.names() if reader.is_quantized(k)]
    assert len(quantized) >= 16

    # the base was quantized by the formats' recipes, so re-quantizing its values gives its bytes
    for k in quantized:
        scales = {s: before[c] for s, c in reader.scale_keys(k).items()}
        again = fc.requantize(reader.get(k), {"": before[k]} | scales)
        assert same_bytes(again[""], before[k]) and all(same_bytes(again[s], t) for s, t in scales.items()), k
    # unchanged weights: the export is the base, byte for byte
    model = clone_for_training(load_model(base, "cpu", torch.float32))
    names = [n for n, _ in trainable_parameters(model)]
    same = stored(fc.export_hf(model, names, base, tmp_path / "same"))
    assert set(same) == set(before) and all(same_bytes(same[k], before[k]) for k in before)
    assert (tmp_path / "same" / "config.json").read_text() == (base / "config.json").read_text()

    # changed weights: quantized ones in the base's format with new scales, the rest exact
    perturb(model)
    out = fc.export_hf(model, names, base, tmp_path / "hf", shard_bytes=60_000)
    after = stored(out)
    assert set(after) == set(before)
    assert all(after[k].dtype == before[k].dtype and after[k].shape == before[k].shape for k in before)
    layout = checkpoint_layout(model, reader)
    params = dict(model.named_parameters())
    again_reader = CheckpointReader(out)
    for place in layout.values():
        for piece in place.pieces:
            value = piece.from_param(params[place.param].detach())
            got = again_reader.get(piece.key)
            if piece.key in quantized:
                assert not same_bytes(after[piece.key], before[piece.key]), piece.key
                rel = float((got - value).norm() / value.norm())
                assert 0 < rel < (0.12 if fmt == "nvfp4" else 0.04), (piece.key, rel)
                scales = reader.scale_keys(piece.key)
                want = fc.requantize(value, {"": before[piece.key]} | {s: before[k] for s, k in scales.items()})
                assert same_bytes(after[piece.key], want[""])
                assert all(same_bytes(after[k], want[s]) for s, k in scales.items())
            else:
                assert torch.equal(got, value), piece.key
    # exporting the export's own weights again reproduces it
    reloaded = clone_for_training(load_model(out, "cpu", torch.float32))
    twice = stored(fc.export_hf(reloaded, names, out, tmp_path / "twice"))
    assert all(same_bytes(twice[k], after[k]) for k in after)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
def test_quantized_base_exports_dequantized(fmt, tmp_path):
    import transformers

    base = quantized_base(tmp_path, fmt)
    reader = CheckpointReader(base)
    model = clone_for_training(load_model(base, "cpu", torch.float32))
    names = perturb(model)
    out = fc.export_hf(model, names, base, tmp_path / "hf", quantized="dequantize")
    after = stored(out)
    assert set(after) == set(reader.names())  # no scales
    assert all(after[k].dtype == torch.float32 for k in reader.names() if reader.is_quantized(k))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    again = dict(load_model(out, "cpu", torch.float32).named_parameters())
    assert all(torch.equal(again[n], p) for n, p in model.named_parameters())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    seq = random_sequences(320, [17], seed=2)[0]
    with torch.no_grad():
        got = hf.eval()(torch.tensor([seq])).logits[0]
    want = ember_logits(model, seq)
    assert float((got - want).norm() / want.norm()) <= 1e-5
    with pytest.raises(ValueError, match="quantized must be"):
        fc.export_hf(model, names, base, tmp_path / "bad", quantized="fp4")


def test_a_conversion_without_inverse_is_refused(tmp_path, monkeypatch):
    """A family conversion the export cannot invert fails clearly and writes nothing."""
    from ember.core import loading
    from tests.parity.test_inkling2 import build_hf_inkling2

    base = tmp_path / "base"
    build_hf_inkling2().save_pretrained(str(base))
    model = clone_for_training(load_model(base, "cpu", torch.float32))
    names = [n for n, _ in trainable_parameters(model)]
    monkeypatch.setattr(loading, "_INVERSES", {})
    with pytest.raises(NotImplementedError, match="no inverse"):
        fc.export_hf(model, names, base, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_base_without_the_trained_weights_is_refused(tmp_path):
    """Exporting onto a base checkpoint that lacks a trained parameter names it."""
    full = tmp_path / "full"
    build_hf_model("qwen3", seed=1).save_pretrained(str(full))
    model = clone_for_training(load_model(full, "cpu", torch.float32))
    names = [n for n, _ in trainable_parameters(model)]
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((full / "config.json").read_text())
    tensors = load_file(str(full / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        fc.export_hf(model, names, partial, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_reader_takes_dtype_and_shape_from_the_header(tmp_path, monkeypatch):
    """``CheckpointReader.info`` (what an export of a trained weight needs of its base tensor) equals
    the stored tensor's dtype and shape for each stored dtype, without reading the tensor."""
    values = {"a": torch.ones(3, 4, dtype=torch.bfloat16), "b": torch.ones(5, dtype=torch.float8_e4m3fn),
              "c": torch.ones(2, 2, dtype=torch.uint8), "d": torch.ones(1, dtype=torch.float64)}
    save_file(values, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    monkeypatch.setattr(CheckpointReader, "raw", lambda self, key: pytest.fail(f"{key} was read"))
    for key, t in values.items():
        assert reader.info(key) == (t.dtype, tuple(t.shape)), key
