"""Adapter checkpoints: safetensors + JSON metadata, written atomically.

Layout of a checkpoint folder::

    metadata.json          format, LoRA config, base model, user metadata
    adapter.safetensors    {module}.lora_A / {module}.lora_B (fp32)
    optimizer.safetensors  {module}.lora_A.exp_avg / .exp_avg_sq / .step (only when saved with state)

Everything is written into a temporary sibling folder and renamed into place, so a crash leaves
either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.core.adapters import Adapter, AdapterBank, LoraConfig

FORMAT = "ember-lora"
FULL_FORMAT = "ember-full"  # full fine-tuning weights (ember.core.full_checkpoint)
VERSION = 1


@contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False):
    """Yield a temporary folder; on success it replaces ``path`` in one rename."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_adapter(
    adapter: Adapter,
    path: str | Path,
    with_optimizer: bool,
    metadata: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``adapter`` (and optionally its Adam state) to the folder ``path``."""
    tensors = {k: v.detach().float().cpu().clone() for k, v in adapter.tensors().items()}
    meta = {"format": FORMAT, "version": VERSION, "lora": adapter.config.to_dict(), "has_optimizer": with_optimizer}
    meta.update(metadata or {})
    with atomic_dir(path, overwrite) as tmp:
        save_file(tensors, str(tmp / "adapter.safetensors"))
        if with_optimizer:
            opt = {k: v.detach().float().cpu().clone() for k, v in adapter.optimizer_state().items()}
            save_file(opt, str(tmp / "optimizer.safetensors"))
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return Path(path)


def checkpoint_format(path: str | Path) -> str:
    """``FORMAT`` (a LoRA adapter) or ``FULL_FORMAT`` (full fine-tuning weights) of a checkpoint
    folder (``ValueError`` if it is neither)."""
    f = Path(path) / "metadata.json"
    if not f.is_file():
        raise ValueError(f"{path} is not an Ember checkpoint (no metadata.json)")
    kind = json.loads(f.read_text()).get("format")
    if kind not in (FORMAT, FULL_FORMAT):
        raise ValueError(f"{path}: unknown checkpoint format {kind!r}")
    return kind


def read_metadata(path: str | Path) -> dict:
    """The ``metadata.json`` of an adapter checkpoint folder (``ValueError`` if it is not one)."""
    if checkpoint_format(path) == FULL_FORMAT:
        raise ValueError(f"{path} is a full fine-tuning checkpoint, not a LoRA adapter; load it into a run "
                         "created with rank 0")
    return json.loads((Path(path) / "metadata.json").read_text())


def assign_weights(adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
    """Copy named factors into ``adapter``; modules absent from ``tensors`` get A = B = 0 (inert:
    their gradients stay zero, so they behave as untargeted)."""
    expected = adapter.tensors()
    unknown = set(tensors) - set(expected)
    if unknown:
        raise ValueError(f"checkpoint has tensors this model lacks, e.g. {sorted(unknown)[:3]}")
    with torch.no_grad():
        for name, t in expected.items():
            if name in tensors:
                src = tensors[name]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(t.shape)}")
                t.copy_(src)
            else:
                t.zero_()


def load_adapter(
    bank: AdapterBank,
    path: str | Path,
    with_optimizer: bool,
    slot: int | None = None,
    select: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Adapter:
    """Create an adapter in ``bank`` from a checkpoint folder, with its Adam state if asked.
    ``select`` picks what this process holds of the saved tensors (its block of experts)."""
    select = select or (lambda t: t)
    meta = read_metadata(path)
    config = LoraConfig.from_dict(meta["lora"])
    tensors = select(load_file(str(Path(path) / "adapter.safetensors")))
    adapter = bank.create(config, slot)
    try:
        assign_weights(adapter, tensors)
        if with_optimizer:
            opt_file = Path(path) / "optimizer.safetensors"
            if not opt_file.is_file():
                raise ValueError(f"{path} was saved without optimizer state")
            adapter.load_optimizer_state(select(load_file(str(opt_file))))
    except Exception:
        bank.free(adapter.slot)
        raise
    return adapter
