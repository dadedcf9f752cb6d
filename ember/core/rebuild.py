"""Saved activations that the backward rebuilds instead of keeping.

Some tensors a training forward saves for its backward are cheap functions of tensors that are
saved anyway. A norm's output is one: the norm keeps its input and one fp32 scalar per row for
its own backward, yet the LoRA product (or the experts' gather) that reads the output keeps the
output as well, to form its ``A`` gradient. A gated activation's output is another: the
activation keeps its two inputs, and the down projection keeps the output. While
:func:`rebuilding` is entered (the engine's training forwards), the code that makes such a tensor
declares it with :func:`rebuildable`; a ``saved_tensors_hooks`` pair then stores, for whoever
saves that tensor (or a view of it), the recipe instead of the tensor, and the backward gets the
same kernel run again on the same inputs: the same values, bit for bit. A layer of the
Qwen3-30B-A3B shape keeps 53.5 instead of 82.0 KB per token (``bench/activation_split.py``),
for one elementwise pass per rebuilt tensor in the backward.

Where nothing else keeps the inputs (no input needs a gradient, so the producer saved nothing)
:func:`rebuildable` declines: the recipe would keep them instead. Inside a checkpointed layer
(:mod:`ember.core.checkpointing`) the checkpoint's own hooks take over and keep nothing. An input
modified in place after the declaration makes the rebuild fail loudly (its version counter moved),
as autograd does for its own saved tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_entries: dict[int, _Recipe] | None = None  # storage address -> recipe, while rebuilding() is entered
_observers: list[Callable[[torch.Tensor], None]] = []
enabled = True  # False: declarations are ignored and every saved tensor is kept (a baseline to measure against)


class _Recipe:
    """How to make a declared tensor again: ``fn(*args)`` with ``args``' tensors at the versions
    they had when the tensor was made."""

    __slots__ = ("__weakref__", "args", "dtype", "fn", "made", "shape", "stride", "versions")

    def __init__(self, out: torch.Tensor, fn: Callable[..., torch.Tensor], args: tuple):
        self.fn = fn
        self.args = args  # tensors, or _Saved views of other recipes (a chain: never the tensor itself)
        self.versions = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
        self.dtype, self.shape, self.stride = out.dtype, out.shape, out.stride()
        # the rebuilt tensor, kept for every saver until the last one's backward has run (the
        # savers hold this recipe: it goes with the last of them)
        self.made: torch.Tensor | None = None

    def rebuild(self) -> torch.Tensor:
        if self.made is not None:
            return self.made
        for t, version in self.versions:
            if t._version != version:
                raise RuntimeError("an input of a rebuilt activation was modified in place after the forward "
                                   "used it (ember.core.rebuild)")
        with torch.no_grad():
            out = self.fn(*(_unpack(a) for a in self.args))
        if (out.dtype != self.dtype or out.shape != self.shape or out.stride() != self.stride
                or not _whole_storage(out)):
            raise RuntimeError(f"rebuilt activation differs in layout: {out.dtype} {tuple(out.shape)} "
                               f"{out.stride()} against {self.dtype} {tuple(self.shape)} {self.stride}")
        self.made = out
        return out


class _Saved:
    """What a saved tensor became: a view (shape, stride, offset within the storage) of a recipe's
    tensor."""

    __slots__ = ("offset", "recipe", "shape", "stride")

    def __init__(self, recipe: _Recipe, t: torch.Tensor):
        self.recipe, self.shape, self.stride, self.offset = recipe, t.shape, t.stride(), t.storage_offset()


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage from its start (a kernel's fresh output), so that a
    view of it and a view of a rebuild are the same positions of their storages."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int | None:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None  # tensor subclasses (DTensor, fakes under compile) are saved as they are
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _declared(t: torch.Tensor) -> _Saved | None:
    """``t`` as a view of a declared tensor's recipe, or None."""
    recipe = _entries.get(_storage_key(t)) if _entries else None
    if recipe is None or recipe.dtype != t.dtype:
        return None
    return _Saved(recipe, t)


def _pack(t: torch.Tensor):
    saved = _declared(t)
    if saved is None:
        for fn in _observers:
            fn(t)
        return t
    return saved


def _unpack(saved):
    if not isinstance(saved, _Saved):
        return saved
    return saved.recipe.rebuild().as_strided(saved.shape, saved.stride, saved.offset)


@contextmanager
def rebuilding(on: bool = True) -> Iterator[None]:
    """Within: tensors declared :func:`rebuildable` are saved for backward as their recipes
    (``on`` False: nothing happens; the engine's memory policy decides per pass). Enter it around a
    training forward only (not its backward), one at a time in a process (the worker runs its
    passes one after another); an inner entry is part of the outer one."""
    global _entries
    if _entries is not None or not on:
        yield
        return
    _entries = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _entries.clear()  # the savers hold their recipes; a declared tensor kept past the forward keeps none
        _entries = None


def rebuildable(out: torch.Tensor, fn: Callable[..., torch.Tensor], *args, chained: bool = False) -> torch.Tensor:
    """Declare that ``fn(*args)`` makes ``out`` again (the same kernel on the same inputs: bit for
    bit the same tensor, of the same layout). Returns ``out``.

    The recipe keeps ``args``, except those that are themselves declared (their recipes stand in:
    a chain of elementwise steps keeps only the first one's inputs). So declare only what its
    producer's backward keeps the inputs of anyway; with ``chained``, the declaration counts only
    when some input is itself declared (a rotary embedding of a norm's output: its own backward
    keeps none of its input). Does nothing outside :func:`rebuilding`, without grad mode, or when no
    tensor input needs a gradient (the producer then saved none of them)."""
    entries = _entries
    if entries is None or not enabled or not torch.is_grad_enabled():
        return out
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return out
    key = _storage_key(out)
    if key is None or out.numel() == 0 or not _whole_storage(out):
        return out  # (empty tensors share addresses)
    args = tuple((_declared(a) or a) if isinstance(a, torch.Tensor) else a for a in args)
    if chained and not any(isinstance(a, _Saved) for a in args):
        return out
    recipe = _Recipe(out, fn, args)
    entries[key] = recipe
    weakref.finalize(out, _forget, entries, key, weakref.ref(recipe))
    return out


def _forget(entries: dict, key: int, recipe: weakref.ref) -> None:
    """A declared tensor is gone: its storage address may be reused by another tensor."""
    if entries.get(key) is recipe():
        entries.pop(key, None)


@contextmanager
def observing(fn: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within: ``fn(t)`` for every tensor that a forward inside :func:`rebuilding` saves as itself
    (not as a recipe; not inside checkpointed layers, whose own hooks keep nothing). The
    saved-tensor hooks of :func:`rebuilding` are the innermost of a training forward, so outer
    hooks see nothing of it: measure through this."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


__all__ = ["observing", "rebuildable", "rebuilding"]
