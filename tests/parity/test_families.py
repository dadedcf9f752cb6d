"""Per-token logprobs of every family equal transformers' (fp32, random tiny configs)."""

import pytest
import torch

from ember.core.batch import pack
from ember.core.loading import load_model
from ember.engine.worker import Worker
from tests.conftest import FAMILIES
from tests.tiny_models import build_hf_model, random_sequences, save_hf_model


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    """logprob of seq[t+1] given seq[:t+1], for t < len-1 (transformers, float64 log-softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def ember_logprobs(worker: Worker, seqs: list[list[int]]) -> list[torch.Tensor]:
    batch = pack([s[:-1] for s in seqs], [0] * len(seqs), "cpu")
    targets = batch.gather([torch.tensor(s[1:]) for s in seqs])[:, None]
    with torch.no_grad():
        lp = worker.logprobs(batch, targets)[:, 0]
    return batch.split(lp)


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_transformers(family, hf_models):
    hf, path = hf_models[family]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    seqs = random_sequences(hf.config.vocab_size, [17, 40, 5, 64], seed=1)
    got = ember_logprobs(worker, seqs)
    for s, g in zip(seqs, got):
        ref = hf_logprobs(hf, s)
        assert ref.std() > 0.1  # the check is meaningful: logprobs are not near-uniform
        torch.testing.assert_close(g.double(), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_sharded_checkpoint_and_tied_embeddings(family, tmp_path):
    hf = build_hf_model(family, seed=3, tie_word_embeddings=True)
    path = save_hf_model(hf, tmp_path / "m", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    model = load_model(path, "cpu", torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seqs = random_sequences(hf.config.vocab_size, [23, 9], seed=2)
    got = ember_logprobs(Worker(model), seqs)
    for s, g in zip(seqs, got):
        torch.testing.assert_close(g.double(), hf_logprobs(hf, s), atol=1e-4, rtol=0)


def test_bf16_load_is_close(hf_models):
    hf, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.bfloat16)
    assert worker.model.model.embed_tokens.weight.dtype == torch.bfloat16
    seqs = random_sequences(hf.config.vocab_size, [30], seed=4)
    got = ember_logprobs(worker, seqs)[0]
    ref = hf_logprobs(hf, seqs[0])
    assert (got.double() - ref).abs().mean() < 0.05


def test_unknown_family_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path)


def test_bad_checkpoints_name_the_problem(hf_models, tmp_path):
    """A missing tensor or a wrong shape is reported by name, not as a bare torch error."""
    from safetensors.torch import load_file, save_file

    _, path = hf_models["qwen3_moe"]
    tensors = load_file(str(path / "model.safetensors"))
    cfg = (path / "config.json").read_text()
    for case, broken in {
        "missing": {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_norm.weight"},
        "shape": {**tensors, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)},
        "expert": {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.3.up_proj.weight"},
    }.items():
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(cfg)
        save_file(broken, str(d / "model.safetensors"))
        with pytest.raises(ValueError) as err:
            load_model(d)
        message = str(err.value)
        expected = {
            "missing": "model.layers.1.self_attn.k_norm.weight",
            "shape": "model.layers.0.self_attn.q_proj.weight has shape (3, 64)",
            "expert": "model.layers.0.mlp.experts.3.up_proj.weight",
        }[case]
        assert expected in message, message


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_chained_without_gradients_equal_their_forwards(family, hf_models):
    """Without gradients Llama-style layers are chained through ``step`` (each residual add done by
    the next norm); the hidden states equal those of the layers' own ``forward`` (what runs with
    gradients) bit for bit, and no layer's ``forward`` runs."""
    from ember.core.layers.attention import PackedAttention
    from ember.core.models.base import ForwardContext

    hf, path = hf_models[family]
    model = load_model(path, "cpu", torch.float32)
    seq = torch.tensor(random_sequences(hf.config.vocab_size, [21], seed=5)[0])
    attention = PackedAttention([len(seq)], torch.device("cpu"))
    ctx = ForwardContext(positions=torch.arange(len(seq)), seq_lens=[len(seq)],
                         attend=lambda layer, q, k, v, spec, scale: attention(q, k, v, spec, scale))
    with torch.enable_grad():
        want = model.hidden_states(seq, ctx)
    calls = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        got = model.hidden_states(seq, ctx)
    assert calls == []
    assert torch.equal(got, want.detach())
