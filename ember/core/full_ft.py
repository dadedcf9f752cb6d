"""Full fine-tuning: what a run trains, and its own trainable copy of a shared base model.

A full fine-tuning run never changes the base model other tenants read: :func:`clone_for_training`
builds the run's copy, with every trainable parameter its own tensor (``requires_grad``) and the
frozen ones (:func:`frozen_parameter_names`) shared with the base model by reference, so a frozen
table (qwen4_exp's host-resident n-gram memory, 100 GB in the released model) is never copied.

What trains: every parameter of the model (embeddings, norms, attention, MLP, experts, routers,
the LM head; a tied head and embedding once), except

* parameters a module keeps in host memory (``host_parameters``, :mod:`ember.core.loading`);
* every parameter of a module whose class sets ``frozen_in_full_finetune = True`` (qwen4_exp's
  QSA indexer, which chooses blocks under ``no_grad``).

Layers Ember does not build (MTP heads, vision towers) are not in the model at all: they stay as
the base checkpoint holds them, and a full-model export copies them from there.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.loading import build_empty, host_parameter_names
from ember.core.models.base import CausalLM


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """Names (as ``named_parameters`` gives them) of the parameters full fine-tuning never trains."""
    frozen = set(host_parameter_names(model))
    for prefix, mod in model.named_modules():
        if getattr(mod, "frozen_in_full_finetune", False):
            frozen |= {f"{prefix}.{n}" if prefix else n for n, _ in mod.named_parameters()}
    return frozen


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of everything full fine-tuning trains, in a fixed order; a tied LM
    head appears once, under the embedding's name."""
    frozen = frozen_parameter_names(model)
    return [(n, p) for n, p in model.named_parameters() if n not in frozen]


def clone_for_training(base: CausalLM) -> CausalLM:
    """A copy of ``base`` whose trainable parameters are new tensors with the same values (on the
    same device, in the same dtype) that require grad; frozen parameters are ``base``'s own
    objects, buffers are copied. The copy shares no trainable storage with ``base``, and has none
    of the wrappers applied to ``base`` after it was built (activation checkpointing: apply it to
    the copy). A base model split across processes (``ember.dist``) cannot be cloned here."""
    if getattr(base, "vocab_split", None) is not None or getattr(base, "param_blocks", None):
        raise ValueError("full fine-tuning runs on one process: this base model is split across processes")
    copy = build_empty(base.config)
    frozen = frozen_parameter_names(copy)
    source = dict(base.named_modules())
    made: dict[int, nn.Parameter] = {}  # base parameter -> its copy (a tied weight is copied once)
    for prefix, mod in copy.named_modules():
        src = source[prefix]
        for n, _ in list(mod.named_parameters(recurse=False)):
            full = f"{prefix}.{n}" if prefix else n
            p = getattr(src, n)
            if full in frozen:
                setattr(mod, n, p)
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=True)
            setattr(mod, n, made[id(p)])
        for n, b in list(mod.named_buffers(recurse=False)):
            mod.register_buffer(n, getattr(src, n).detach().clone(), persistent=n not in mod._non_persistent_buffers_set)
            del b
    for mod, src in zip(copy.modules(), base.modules()):
        mod.training = src.training
    leftover = [n for n, p in copy.named_parameters() if p.is_meta] + [n for n, b in copy.named_buffers() if b.is_meta]
    if leftover:
        raise ValueError(f"cloning left tensors unset: {leftover[:5]}")
    return copy


@torch.no_grad()
def copy_weights(dst: nn.Module, src: nn.Module, names: list[str]) -> None:
    """Copy the parameters ``names`` of ``src`` into ``dst``'s (same shapes)."""
    a, b = dict(dst.named_parameters()), dict(src.named_parameters())
    for n in names:
        a[n].copy_(b[n])
