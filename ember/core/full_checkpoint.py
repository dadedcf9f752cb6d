"""Full fine-tuning checkpoints and whole-model Hugging Face exports.

A checkpoint folder (written atomically, :func:`~ember.core.checkpoint.atomic_dir`)::

    metadata.json                       format "ember-full", the trained names, user metadata
    model.safetensors.index.json        HF index format: {"metadata": {...}, "weight_map": {...}}
    model-0000i-of-0000N.safetensors    the trained parameters (Ember names, the model's dtype)
    optimizer.safetensors.index.json    (with optimizer state) the same for the optimizer's tensors
    optimizer-0000i-of-0000N.safetensors

:func:`export_hf` writes a folder ``transformers`` loads: the base model folder's config,
tokenizer and other files, and every tensor of the base checkpoint in the base checkpoint's own
key layout, with the run's value where it trains the parameter the key fills
(:func:`checkpoint_target`: per-expert keys, ``model.language_model.`` prefixes and families'
``map_checkpoint_key`` renames, inverted) and the base tensor copied as it is everywhere else
(what the trainer never held: qwen4_exp's n-gram table, MTP layers, vision towers). A quantized
base tensor whose parameter was trained is written in the model's dtype, without its scales.
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
from ember.core.loading import _EXPERT_KEY, _TEXT_PREFIX, CheckpointReader, checkpoint_files

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

def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`~ember.core.models.inkling2.deinterleave_gate_up`."""
    inter = gate_up.shape[1] // 2
    out = torch.empty_like(gate_up)
    out[:, 0::2], out[:, 1::2] = gate_up[:, :inter], gate_up[:, inter:]
    return out


def _inverse(convert: Callable | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if convert is None:
        return lambda t: t
    if convert.__name__ == "deinterleave_gate_up":
        return interleave_gate_up
    raise NotImplementedError(f"no inverse for the checkpoint conversion {convert.__name__}")


def checkpoint_target(model: torch.nn.Module, key: str,
                      params: dict[str, torch.Tensor]) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """The parameter a base checkpoint ``key`` fills and how to get the key's tensor back from it
    (``None``: the model holds nothing of it). Mirrors :func:`~ember.core.loading.load_model`'s
    reading of keys."""
    remap = getattr(model, "map_checkpoint_key", None)
    if remap is not None:
        mapped = remap(key)
        if mapped is None or mapped[0] not in params:
            return None
        return mapped[0], _inverse(mapped[1])
    if key.startswith(_TEXT_PREFIX):
        key = "model." + key[len(_TEXT_PREFIX) :]
    m = _EXPERT_KEY.match(key)
    if m:
        name, e = f"{m['prefix']}.gate_up_proj", int(m["e"])
        if name not in params:
            return None
        if m["proj"] == "down_proj":
            return f"{m['prefix']}.down_proj", lambda t: t[e]
        inter = params[name].shape[1] // 2
        part = slice(0, inter) if m["proj"] == "gate_proj" else slice(inter, 2 * inter)
        return name, lambda t: t[e, part]
    if key in params:
        return key, lambda t: t
    return None


def export_hf(model: torch.nn.Module, names: list[str], base_dir: str | Path, out_dir: str | Path,
              shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
              progress: Callable[[str], None] | None = None) -> Path:
    """A whole Hugging Face model folder of ``model`` with its trained ``names`` (module doc)."""
    base_dir = Path(base_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    trained = set(names)
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in trained:
        trained.add("lm_head.weight")
    reader = CheckpointReader(base_dir)
    weights = {p.name for p in checkpoint_files(base_dir)} | {"model.safetensors.index.json"}
    dtype = next(iter(params.values())).dtype

    def tensors():
        for key in reader._where:
            main = next((key[: -len(s)] for s in quant.SCALE_SUFFIXES if key.endswith(s) and key[: -len(s)] in
                         reader._where), None)
            target = checkpoint_target(model, main or key, params)
            if target is not None and target[0] in trained:
                if main is not None:
                    continue  # the scale of a quantized weight written in the model's dtype
                name, get = target
                base_dtype = reader._raw(key).dtype
                keep = base_dtype if base_dtype.is_floating_point and base_dtype.itemsize >= 2 else dtype
                yield key, (lambda get=get, name=name, keep=keep: get(params[name].detach()).to(keep))
            else:
                yield key, (lambda key=key: reader._raw(key))

    with atomic_dir(out_dir, overwrite) as tmp:
        for f in sorted(base_dir.iterdir()):
            if f.is_file() and f.name not in weights:
                shutil.copy2(f, tmp / f.name)
        if progress is not None:
            progress(f"writing {len(reader._where)} tensors to {out_dir}")
        _shards(tensors(), tmp, "model", shard_bytes)
    return Path(out_dir)
