"""Full fine-tuning checkpoints and whole-model Hugging Face exports.

A checkpoint folder (written atomically, :func:`~ember.core.checkpoint.atomic_dir`)::

    metadata.json                       format "ember-full", the trained names, user metadata
    model.safetensors.index.json        HF index format: {"metadata": {...}, "weight_map": {...}}
    model-0000i-of-0000N.safetensors    the trained parameters (Ember names, the model's dtype)
    optimizer.safetensors.index.json    (with optimizer state) the same for the optimizer's tensors
    optimizer-0000i-of-0000N.safetensors

:func:`export_hf` writes a folder ``transformers`` loads: the base model folder's config,
tokenizer and other files, and every tensor of the base checkpoint in the base checkpoint's own
key layout, with the run's value where it trains the parameter the key fills (written back through
the inverses of :func:`~ember.core.loading.checkpoint_layout`, the same key resolution
:func:`~ember.core.loading.load_model` reads by) and the base tensor copied byte for byte everywhere
else (what the trainer never held: qwen4_exp's n-gram table and QSA indexer, MTP layers, vision
towers). A quantized base stays in its format (trained weights re-quantized) unless the export is
asked to dequantize (:func:`export_hf`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.core import quant
from ember.core.checkpoint import FULL_FORMAT as FORMAT
from ember.core.checkpoint import atomic_dir, checkpoint_format
from ember.core.loading import CheckpointReader, checkpoint_files, checkpoint_layout

VERSION = 1
SHARD_BYTES = 4 << 30


def _shards(tensors: Iterator[tuple[str, Callable[[], torch.Tensor]]], folder: Path, stem: str,
            shard_bytes: int) -> None:
    """Write ``(name, make tensor)`` pairs as ``{stem}-0000i-of-0000N.safetensors`` + index, one
    shard in host memory at a time."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size, total, written = 0, 0, []
    tmp_names = []

    def flush():
        name = f"{stem}-part{len(tmp_names):05d}.safetensors"
        save_file(groups[-1], str(folder / name), metadata={"format": "pt"})
        tmp_names.append((name, list(groups[-1])))
        groups[-1] = {}

    for key, make in tensors:
        t = make().detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        groups[-1][key] = t
        size += nbytes
        total += nbytes
    if groups[-1] or not tmp_names:
        flush()
    n = len(tmp_names)
    weight_map = {}
    for i, (name, keys) in enumerate(tmp_names):
        final = f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / name).rename(folder / final)
        written.append(final)
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _read_index(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    index = folder / f"{stem}.safetensors.index.json"
    if not index.is_file():
        raise ValueError(f"{folder} has no {index.name}")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out


def save_full(model: torch.nn.Module, path: str | Path, names: list[str], optimizer_state: dict | None,
              metadata: dict | None = None, overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the parameters ``names`` of ``model`` (and the optimizer state) to the folder ``path``."""
    params = dict(model.named_parameters())
    meta = {"format": FORMAT, "version": VERSION, "has_optimizer": optimizer_state is not None,
            "parameters": {n: str(params[n].dtype).removeprefix("torch.") for n in names}}
    meta.update(metadata or {})
    with atomic_dir(path, overwrite) as tmp:
        _shards(((n, lambda n=n: params[n]) for n in names), tmp, "model", shard_bytes)
        if optimizer_state is not None:
            _shards(((k, lambda k=k: optimizer_state[k]) for k in sorted(optimizer_state)), tmp, "optimizer",
                    shard_bytes)
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return Path(path)


@torch.no_grad()
def load_full(model: torch.nn.Module, path: str | Path, names: list[str], with_optimizer: bool) -> dict | None:
    """Fill the parameters ``names`` of ``model`` from a full checkpoint; its optimizer state if asked."""
    path = Path(path)
    if checkpoint_format(path) != FORMAT:
        raise ValueError(f"{path} is a LoRA adapter checkpoint, not a full fine-tuning checkpoint")
    meta = json.loads((path / "metadata.json").read_text())
    saved = _read_index(path, "model")
    missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or extra:
        raise ValueError(f"{path} does not hold this model's trained weights: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    params = dict(model.named_parameters())
    for n in names:
        if tuple(saved[n].shape) != tuple(params[n].shape):
            raise ValueError(f"{path}: {n} has shape {tuple(saved[n].shape)}, the model {tuple(params[n].shape)}")
        params[n].copy_(saved[n])
    if not with_optimizer:
        return None
    if not meta.get("has_optimizer"):
        raise ValueError(f"{path} was saved without optimizer state")
    return _read_index(path, "optimizer")


# -- export -----------------------------------------------------------------------------------------

QUANTIZED_MODES = ("base", "dequantize")


def _fp8_tile(shape: torch.Size, tiles: torch.Size) -> int:
    """The square power-of-two tile ``b`` of FP8 block scales ``tiles`` over a weight ``shape``
    (``ceil(n / b) == tiles`` in both dims; a dim of one tile only bounds ``b`` from below)."""
    forced, least = set(), 1
    for n, t in zip(shape[-2:], tiles[-2:]):
        if t == 1:
            least = max(least, 1 << max(0, (n - 1).bit_length()))
            continue
        b = 1
        while -(-n // b) > t:
            b *= 2
        if -(-n // b) != t:
            raise ValueError(f"FP8 block scales {tuple(tiles)} fit no power-of-two tile of a {tuple(shape)} weight")
        forced.add(b)
    if len(forced) > 1 or (forced and min(forced) < least):
        raise ValueError(f"FP8 block scales {tuple(tiles)} of a {tuple(shape)} weight are not square tiles")
    return forced.pop() if forced else least


def requantize(value: torch.Tensor, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``value`` in the quantized format of a base weight: ``stored`` is ``{"": the stored weight,
    suffix: its scale companion}`` (:mod:`ember.core.quant`), the result has the same keys, dtypes
    and shapes, with new scales computed from ``value`` by the format's recipe (FP8 tiles of the
    base's tile size). For a base quantized by the same recipe, a value equal to its dequantized
    weight gives back its bytes (:func:`export_hf` copies an unchanged weight's bytes in any case)."""
    value = value.detach().float()
    if "_scale_inv" in stored:
        q, s = quant.quantize_fp8_block(value, _fp8_tile(stored[""].shape, stored["_scale_inv"].shape))
        out = {"": q, "_scale_inv": s}
    elif "_scale_2" in stored:
        p, s, g = quant.quantize_nvfp4(value)
        out = {"": p, "_scale": s, "_scale_2": g}
    else:
        q, s = quant.quantize_mxfp8(value)
        out = {"": q, "_scale": s}
    if set(out) != set(stored):
        raise ValueError(f"unknown quantized layout with companions {sorted(stored)}")
    for sfx, t in out.items():
        base = stored[sfx]
        if t.dtype != base.dtype and t.element_size() == base.element_size():
            t = t.view(base.dtype)  # e.g. FP8 bytes stored as uint8
        if t.dtype != base.dtype or t.numel() != base.numel():
            raise ValueError(f"re-quantized {sfx or 'weight'} is {t.dtype} {tuple(t.shape)}, the base stores "
                             f"{base.dtype} {tuple(base.shape)}")
        out[sfx] = t.reshape(base.shape)
    return out


def _drop_quantization_config(path: Path) -> None:
    """Remove ``quantization_config`` (also a nested ``text_config``'s) from a ``config.json``."""
    config = json.loads(path.read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if "quantization_config" in config or "quantization_config" in text:
        config.pop("quantization_config", None)
        text.pop("quantization_config", None)
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def export_hf(model: torch.nn.Module, names: list[str], base_dir: str | Path, out_dir: str | Path,
              shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
              progress: Callable[[str], None] | None = None, quantized: str = "base") -> Path:
    """A whole Hugging Face model folder of ``model`` with its trained ``names``.

    The folder holds the base folder's files (config, tokenizer, …) and every tensor key of the
    base checkpoint, in the base's own key layout, read through
    :func:`~ember.core.loading.checkpoint_layout`: a key whose parameter is trained gets the run's
    value, mapped back by the layout's inverse (per-expert slices of fused experts, row shards,
    ``model.language_model.`` prefixes, families' ``map_checkpoint_key`` renames and conversions
    such as inkling2's interleaved ``w13``), in the base tensor's dtype (the model's if the base
    stores a non-float or 1-byte dtype); every other key (frozen parameters, MTP layers, vision
    towers, qwen4_exp's n-gram table and QSA indexer) is copied byte for byte.

    Quantized bases (MXFP8, NVFP4, FP8 tiles: :mod:`ember.core.quant`), by ``quantized``:

    * ``"base"`` (default): the base's format. A trained weight is re-quantized by its format's
      recipe (:func:`requantize`: same dtypes and shapes, new scales; the trained values are only
      kept to the format's precision), an untrained or unchanged one is copied with its scales byte
      for byte, and ``config.json`` is the base's.
    * ``"dequantize"``: every quantized weight of the base is written dequantized, in the model's
      dtype, without scale companions, and ``config.json`` loses its ``quantization_config``.
    """
    if quantized not in QUANTIZED_MODES:
        raise ValueError(f"quantized must be one of {QUANTIZED_MODES}, not {quantized!r}")
    base_dir = Path(base_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    trained = set(names)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and "model.embed_tokens.weight" in trained:
        trained.add("lm_head.weight")
    reader = CheckpointReader(base_dir)
    layout = checkpoint_layout(model, reader)
    unplaced = sorted(trained - set(layout) - ({"lm_head.weight"} if tied else set()))
    if unplaced:
        raise ValueError(f"the base checkpoint {base_dir} holds no tensor for {len(unplaced)} trained "
                         f"parameters, e.g. {unplaced[:3]}: is it the model the run trained?")
    source = {piece.key: (place.param, piece) for place in layout.values() for piece in place.pieces}
    weights = {p.name for p in checkpoint_files(base_dir)} | {"model.safetensors.index.json"}
    dtype = next(iter(params.values())).dtype
    dequantize = quantized == "dequantize"

    def trained_value(key: str, base_shape: tuple[int, ...]) -> torch.Tensor:
        name, piece = source[key]
        t = piece.from_param(params[name].detach())
        if tuple(t.shape) != tuple(base_shape) and not reader.is_quantized(key):
            raise ValueError(f"{name} gives {key} the shape {tuple(t.shape)}, the base stores {tuple(base_shape)}")
        return t

    def tensors():
        for key in reader.names():
            scales = reader.scale_keys(key)
            is_trained = key in source and source[key][0] in trained
            if not scales:
                if is_trained:
                    def make(key=key):
                        base_dtype, base_shape = reader.info(key)  # the header: the base tensor is not read
                        keep = base_dtype if base_dtype.is_floating_point and base_dtype.itemsize >= 2 else dtype
                        return trained_value(key, base_shape).to(keep)
                    yield key, make
                else:
                    yield key, (lambda key=key: reader.raw(key))
            elif dequantize:
                if is_trained:
                    yield key, (lambda key=key: trained_value(key, reader.info(key)[1]).to(dtype))
                else:
                    yield key, (lambda key=key: reader.get(key).to(dtype))
            elif is_trained:
                done: dict[str, torch.Tensor] = {}

                def make(sfx: str, key=key, scales=scales, done=done) -> torch.Tensor:
                    if not done:  # the weight and its scales, quantized together
                        stored = {"": reader.raw(key)} | {s: reader.raw(k) for s, k in scales.items()}
                        value = trained_value(key, tuple(stored[""].shape))
                        same = torch.equal(value.float(), reader.get(key))  # unchanged: the base's bytes
                        done.update(stored if same else requantize(value, stored))
                    return done.pop(sfx)
                yield key, (lambda make=make: make(""))
                for sfx, k in scales.items():
                    yield k, (lambda make=make, sfx=sfx: make(sfx))
            else:
                yield key, (lambda key=key: reader.raw(key))
                for k in scales.values():
                    yield k, (lambda k=k: reader.raw(k))

    with atomic_dir(out_dir, overwrite) as tmp:
        for f in sorted(base_dir.iterdir()):
            if f.is_file() and f.name not in weights:
                shutil.copy2(f, tmp / f.name)
        if dequantize and (tmp / "config.json").is_file():
            _drop_quantization_config(tmp / "config.json")
        if progress is not None:
            progress(f"writing {len(reader.names())} tensors to {out_dir}")
        _shards(tensors(), tmp, "model", shard_bytes)
    return Path(out_dir)
