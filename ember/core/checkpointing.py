"""Per-layer activation checkpointing, applied to a built model from outside the model files.

:func:`apply_checkpointing` wraps the ``forward`` of every decoder layer of ``model.model.layers``
(an instance attribute: module names, state-dict keys and LoRA names stay as they are). While the
returned :class:`LayerCheckpointing` is :meth:`~LayerCheckpointing.on` and grad mode is on, each
layer runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: autograd keeps
only the layer's inputs, and the backward runs the layer's forward again to rebuild what its
gradient needs. Otherwise the wrapper calls the layer's own ``forward`` and nothing changes.
Layers take whatever arguments their family passes (``(x, ctx)``; qwen4_exp ``(x, input_ids,
ctx)``; inkling2 ``(partial, bank, run)``); non-tensor arguments pass through unchanged, with
three exceptions that make the recompute see exactly what the first forward saw:

* **MoE routing (R3).** The layer's :class:`~ember.core.models.base.ForwardContext` (an argument,
  or the ``ctx`` field of a dataclass argument, as inkling2's ``_Pass``) gets a
  :class:`LayerRouting` in place of ``ctx.routing``. In the first forward it runs the pass's own
  routing (the live router, or the :class:`~ember.core.layers.moe.RoutingRecord` with its replay,
  record, reference and flips, also :mod:`ember.dist`'s ``ShardedRouting``) to *choose* the
  experts, under ``no_grad``, and keeps that choice; the router then runs once more with the
  choice as its replay, which is what the layer uses. In the recompute the router runs with the
  kept choice as its replay, and the pass's record, flips and their collectives are not touched
  again. The router's code path is thus the same in the first forward and in the recompute (the
  same saved tensors: ``torch.utils.checkpoint`` checks their shapes), the experts are exactly the
  first forward's whatever the recomputed scores (bf16 rounding, or a replay that changed since),
  and the mixing weights are the live router's scores over those experts, as in R3, so gradients
  reach the router the same way. Where the pass routed live, ``gather`` of the scores at the
  chosen experts gives the same weights and the same gradients as the top-k values did.
* **Mutable arguments.** Inkling2's :class:`~ember.core.layers.attn_residuals.ResidualBank` grows
  as the pass goes on (a layer that opens a block appends to it). The recompute gets a fresh bank
  that holds the blocks the first forward saw (the same tensors), so it reads the same mixtures
  and its append reaches no one. Another argument that a layer mutates needs its rule in
  :data:`SNAPSHOTS`.
* **Pass state of parallel layouts** (:meth:`LayerCheckpointing.track`). Under sequence
  parallelism the token split of the pass (``SequenceParallel.sizes``, ``active``) and the
  experts' dispatch mode (``ExpertParallel.mode``) are read inside layers. They are recorded at
  each layer's first forward and set again for its recompute, so a pass that ran in between
  (another split, a decode step's dispatch) cannot leak into a backward.

**Collectives.** Under expert, tensor and sequence parallelism a layer's forward holds
collectives (all-to-all, all-gather, reduce-scatter, FSDP's gathers). Every rank checkpoints the
same layers (the engine decides per pass, and agrees across ranks: :mod:`ember.engine.worker`)
and the recompute runs a layer's whole forward again (early stop is off, so where the last saved
tensor falls cannot cut a recompute short on one rank), so the recompute enters the layer's
collectives again, on every rank, in the forward's order; the backward reaches every layer on
every rank (``ember.dist.parallelize`` makes the embedding output require grad everywhere).

**Full fine-tuning** uses the same wrapper: it knows nothing of LoRA. Under FSDP2 a decoder
block that is its own ``fully_shard`` unit keeps the wrapped ``forward`` (``fully_shard`` swaps
the class, not the instance attribute): FSDP's hooks bracket the checkpointed call, the
arrangement of torchtitan's ``checkpoint_wrapper`` inside ``fully_shard`` (not tested here yet;
with ``--expert-fsdp`` the experts' gathers simply run again in the recompute, on every rank).

:func:`activation_bytes` estimates a pass's activation memory (what ``--activation-checkpointing
auto`` compares with the free device memory), and :func:`layers_to_checkpoint` picks the fewest
layers whose checkpointing makes up the difference (``auto`` checkpoints only those).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ember.core.layers.attn_residuals import ResidualBank
from ember.core.layers.gated_attention import GatedAttention
from ember.core.layers.gated_deltanet import GatedDeltaNet
from ember.core.layers.mla import MultiHeadLatentAttention
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.moe import Experts, Routing
from ember.core.layers.shared_expert_moe import SharedExpertMoE
from ember.core.models.base import CausalLM, ForwardContext


def _bank_snapshot(bank: ResidualBank) -> Callable[[], ResidualBank]:
    blocks = list(bank.normed)

    def fresh() -> ResidualBank:
        copy = ResidualBank()
        copy.normed = list(blocks)
        return copy

    return fresh


# Arguments that layers mutate: type -> snapshot(arg) taken before the first forward, returning
# what makes the argument of a recompute (called once per recompute).
SNAPSHOTS: dict[type, Callable[[Any], Callable[[], Any]]] = {ResidualBank: _bank_snapshot}


class LayerRouting:
    """``ctx.routing`` of one checkpointed decoder-layer call (see the module doc): the first
    forward chooses through ``inner`` (the pass's routing, or ``None``: live) and keeps the choice
    per MoE layer index; the recompute replays it, touching nothing of ``inner``."""

    def __init__(self, inner):
        self.inner = inner
        self.chosen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.recomputing = False

    def route(self, layer: int, gate: nn.Module, x: torch.Tensor) -> Routing:
        if self.recomputing:
            experts, live = self.chosen[layer]
            r = gate(x, experts)
            r.live = live
            return r

        def choose(x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
            with torch.no_grad():
                first = gate(x, replay)
            r = gate(x, first.experts)
            r.live = first.live  # the router's own choice where a replay overrode it, else None
            self.chosen[layer] = (first.experts, first.live)
            return r

        return choose(x) if self.inner is None else self.inner.route(layer, choose, x)


def _context(args: tuple) -> ForwardContext | None:
    """The layer's forward context: an argument, or the ``ctx`` field of a dataclass argument."""
    for a in args:
        if isinstance(a, ForwardContext):
            return a
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            for f in dataclasses.fields(a):
                if f.init and isinstance(getattr(a, f.name), ForwardContext):
                    return getattr(a, f.name)
    return None


def _with_routing(arg, routing: LayerRouting):
    """``arg`` with its forward context's ``routing`` replaced (other arguments as they are)."""
    if isinstance(arg, ForwardContext):
        return dataclasses.replace(arg, routing=routing)
    if dataclasses.is_dataclass(arg) and not isinstance(arg, type):
        for f in dataclasses.fields(arg):
            value = getattr(arg, f.name)
            if f.init and isinstance(value, ForwardContext):
                return dataclasses.replace(arg, **{f.name: dataclasses.replace(value, routing=routing)})
    return arg


class _Call:
    """One checkpointed call of a decoder layer: what its recompute must see again."""

    def __init__(self, owner: LayerCheckpointing, forward: Callable, args: tuple):
        self.owner = owner
        self.forward = forward
        ctx = _context(args) if owner.moe else None
        self.routing = LayerRouting(ctx.routing) if ctx is not None else None
        self.snapshots = {i: SNAPSHOTS[type(a)](a) for i, a in enumerate(args) if type(a) in SNAPSHOTS}
        self.state = [(obj, name, getattr(obj, name)) for obj, names in owner.pass_state for name in names]
        self.recomputing = False

    def run(self, *args, **kwargs):
        """The layer's forward: the first call with its own arguments, a recompute with fresh
        copies of the mutable ones; both with :attr:`routing` in their context."""
        if self.recomputing:
            args = tuple(self.snapshots[i]() if i in self.snapshots else a for i, a in enumerate(args))
        if self.routing is not None:
            args = tuple(_with_routing(a, self.routing) for a in args)
        return self.forward(*args, **kwargs)

    def contexts(self):
        """``context_fn`` of ``torch.utils.checkpoint``: (first forward, recompute)."""
        return _NoContext(), _Recompute(self)


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Recompute:
    """Entered around each recompute of a call (re-entrant: a second backward recomputes again)."""

    def __init__(self, call: _Call):
        self.call = call
        self.saved: list = []

    def __enter__(self):
        call = self.call
        self.saved = [(obj, name, getattr(obj, name)) for obj, name, _ in call.state]
        for obj, name, value in call.state:
            setattr(obj, name, value)
        call.recomputing = True
        if call.routing is not None:
            call.routing.recomputing = True
        call.owner.recomputes += 1
        return self

    def __exit__(self, *exc):
        call = self.call
        call.recomputing = False
        if call.routing is not None:
            call.routing.recomputing = False
        for obj, name, value in self.saved:
            setattr(obj, name, value)
        return False


class LayerCheckpointing:
    """The checkpointing wrappers of one model's decoder layers (:func:`apply_checkpointing`).

    ``active``: the indices of the layers that calls now (in grad mode) checkpoint (empty: none);
    the engine sets it per training pass with :meth:`on`. ``recomputes``: layer recomputes so far
    (tests, logs).
    """

    def __init__(self, model: CausalLM):
        self.model = model
        self.active: frozenset[int] = frozenset()
        self.recomputes = 0
        self.moe = bool(model.moe_routers())
        self.pass_state: list[tuple[object, tuple[str, ...]]] = []
        for i, layer in enumerate(model.model.layers):
            self._wrap(i, layer)
        self._track_parallel_state()

    def _wrap(self, index: int, layer: nn.Module) -> None:
        forward = layer.forward  # the class's method, bound

        def checkpointed(*args, **kwargs):
            if index not in self.active or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call = _Call(self, forward, args)
            with set_checkpoint_early_stop(False):
                return checkpoint(call.run, *args, use_reentrant=False, context_fn=call.contexts, **kwargs)

        layer.forward = checkpointed

    def track(self, obj: object, *names: str) -> None:
        """Record attributes ``names`` of ``obj`` at each layer's first forward and set them
        again for its recompute (state of the pass that layers read)."""
        if not any(o is obj and n == names for o, n in self.pass_state):
            self.pass_state.append((obj, names))

    def _track_parallel_state(self) -> None:
        """What :mod:`ember.dist` keeps per pass on a parallelized model: the sequence-parallel
        token split (``model.sequence_parallel``) and each sharded MoE layer's dispatch mode."""
        sp = getattr(self.model, "sequence_parallel", None)
        if sp is not None:
            self.track(sp, "sizes", "active")
        seen = set()
        for mod in self.model.modules():
            dispatch = getattr(mod, "dispatch", None)
            if dispatch is not None and hasattr(dispatch, "mode") and id(dispatch) not in seen:
                seen.add(id(dispatch))
                self.track(dispatch, "mode")

    @contextmanager
    def on(self, enabled: bool | Iterable[int] = True) -> Iterator[None]:
        """Checkpoint layers in the passes run inside (in grad mode): all of them (``True``), none
        (``False``) or those of the given indices."""
        before = self.active
        if isinstance(enabled, bool):
            self.active = frozenset(range(len(self.model.model.layers))) if enabled else frozenset()
        else:
            self.active = frozenset(enabled)
        try:
            yield
        finally:
            self.active = before


def apply_checkpointing(model: CausalLM) -> LayerCheckpointing:
    """Wrap every layer of ``model.model.layers`` (once per model; later calls return the same
    :class:`LayerCheckpointing`). Apply it after the model is parallelized."""
    existing = model.__dict__.get("activation_checkpointing")
    if existing is not None:
        existing._track_parallel_state()
        return existing
    ckpt = LayerCheckpointing(model)
    model.__dict__["activation_checkpointing"] = ckpt
    return ckpt


# --- memory estimate (--activation-checkpointing auto) ----------------------------------------

# What autograd keeps per token and layer, in elements of the model dtype (layer_elements), with
# norm, rotary and gated-activation outputs rebuilt in the backward (ember.core.rebuild):
# * 2 residual-width tensors (the layer input and the residual between its sublayers, which the
#   norms keep); 4 in post-norm layers (``post_norm``: Olmo 3; the LoRA products keep the residual
#   stream and the norms their sublayers' outputs); under hyper-connections (qwen4_exp) about 8
#   per stream (the mixing in fp32 and the LoRA products' inputs);
# * attention: the q/k norms' inputs (or the rotated q and k where there are none), v and the
#   output; gated attention's q_proj is twice as wide (the output gate: one storage with q; the
#   gated output is rebuilt). MLA: q and k per head, the values (padded to the q/k head size
#   for flash attention when narrower, else the kv_b_proj output they are a view of), the output
#   and the two latent norms' inputs. Gated DeltaNet: about 15 times its q/k/v/z width (Ember's
#   PyTorch rule; fla's kernels on CUDA keep about a third of that). Inkling2's relative attention
#   counts as attention;
# * a dense MLP 2 of its widths (gate and up; the activation is rebuilt); routed experts k rows of
#   2 widths; shared experts 2 widths, and one hidden size for a sigmoid-gated shared expert.
# Fitted to what a LoRA forward keeps (bench/activation_split.py: bf16, rank 32 on attention and
# MLP, on the CPU, attention keeping what flash attention keeps; per deep layer, measured /
# estimated KB): Qwen3-8B 86.8 / 86.0, Olmo3-7B 110.2 / 109.6, Qwen3-30B-A3B 53.5 / 51.2,
# GLM-4.7-Flash dense 101.3 / 100.4 and MoE 91.8 / 90.1, DeepSeek-V3 dense 304.3 / 303.1 and MoE
# 305.6 / 303.1, Qwen3-Next-80B-A3B GDN 406.7 / 403.5 and gated attention 64.0 / 61.4,
# Qwen3.8-Flash-Next GDN 767.6 / 688.6 and QSA attention 260.5 / 236.0 (the hyper-connections
# eager) (tests/unit/test_activation_checkpointing.py). The engine scales the estimate by what its
# own passes kept (Worker._kept_scale), which covers the GPU kernels' differences.
RESIDUAL_TENSORS = 2
POST_NORM_TENSORS = 4
STREAM_TENSORS = 8
GDN_FACTOR = 15
# the LM head's chunked logprobs: fp32 chunks of at most 1 GiB (ember.core.logprobs), logits and
# their gradient
HEAD_BYTES = 2 << 30


def _mla_elements(mla) -> int:
    n, qk, v = mla.num_heads, mla.qk_head_dim, mla.v_head_dim
    values = n * qk if v != qk else n * (mla.qk_nope_head_dim + v)  # a padded copy, or kv_b_proj's output
    return 2 * n * qk + values + n * max(v, qk) + (mla.q_lora_rank or 0) + mla.kv_lora_rank


_ELEMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_elements(model: CausalLM, rebuilt: bool = True) -> list[int]:
    """The estimate above for each decoder layer of ``model`` (elements per token, whole widths:
    the model's config, not this rank's shards); without ``rebuilt``, plus what rebuilding saves
    (a pass that keeps every saved activation: :mod:`ember.core.rebuild` off). Worked out once per
    model (a walk over every layer's modules; a training pass asks three times)."""
    known = _ELEMENTS.setdefault(model, {})
    if rebuilt not in known:
        known[rebuilt] = _layer_elements(model, rebuilt)
    return list(known[rebuilt])


def _layer_elements(model: CausalLM, rebuilt: bool) -> list[int]:
    cfg = model.config
    H = cfg.hidden_size
    streams = int(getattr(model.model, "streams", 1))  # qwen4_exp's hyper-connection streams
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    routers = model.moe_routers()
    out = []
    for i, layer in enumerate(model.model.layers):
        if streams > 1:
            residual = STREAM_TENSORS * streams * H
        else:
            residual = (POST_NORM_TENSORS if getattr(layer, "post_norm", False) else RESIDUAL_TENSORS) * H
        mods = list(layer.modules())
        gdn = next((m for m in mods if isinstance(m, GatedDeltaNet)), None)
        mla = next((m.cfg for m in mods if isinstance(m, MultiHeadLatentAttention)), None)
        # what rebuilding saves: the sublayers' normed inputs (pre-norm), the rotated q and k of
        # q/k norms, a gated output, the latent and gated norms' outputs, the activation outputs
        saved = 2 * H if streams == 1 and not getattr(layer, "post_norm", False) else 0
        if mla is not None:
            mixer = _mla_elements(mla)
            saved += (mla.q_lora_rank or 0) + mla.kv_lora_rank
        elif gdn is not None:
            mixer = GDN_FACTOR * 2 * (gdn.shape.key_dim + gdn.shape.value_dim)
            saved += gdn.shape.value_dim
        elif any(isinstance(m, GatedAttention) for m in mods):
            mixer = 3 * q + 2 * kv
            saved += 2 * q + kv
        else:
            mixer = 2 * q + 2 * kv
            saved += q + kv if any(hasattr(m, "q_norm") for m in mods) else 0
        experts = next((m for m in mods if isinstance(m, Experts)), None)
        has_mlp = any(isinstance(m, SwiGLU) for m in mods)
        if experts is not None:
            moe = cfg.moe
            k = moe.top_k if moe is not None else routers[i].top_k
            inter = moe.intermediate_size if moe is not None else experts.gate_up_proj.shape[1] // 2
            shared = moe.shared_intermediate_size if moe is not None and has_mlp else 0
            gated = any(isinstance(m, SharedExpertMoE) for m in mods)
            mlp = k * 2 * inter + 2 * shared + (H if gated else 0)
            saved += k * inter + shared
        else:
            mlp = 2 * cfg.intermediate_size if has_mlp else 0
            saved += cfg.intermediate_size if has_mlp else 0
        out.append(residual + mixer + mlp + (0 if rebuilt else saved))
    return out


def kept_bytes(model: CausalLM, tokens: int, checkpointed: Iterable[int] = (), dtype_bytes: int | None = None,
               tp: int = 1, rebuilt: bool = True) -> int:
    """Estimated activation memory a training forward of ``tokens`` tokens keeps (bytes) when the
    layers ``checkpointed`` are checkpointed (each keeps only its input: one hidden size per
    token, one per stream under hyper-connections): ``tokens ×`` :func:`layer_elements` in the
    model's dtype, divided by ``tp`` (tensor and sequence parallelism split every part of it);
    ``rebuilt``: with :mod:`ember.core.rebuild` on."""
    if dtype_bytes is None:
        dtype_bytes = model.model.embed_tokens.weight.element_size()
    ckpt = set(checkpointed)
    kept_input = model.config.hidden_size * int(getattr(model.model, "streams", 1))
    elements = sum(kept_input if i in ckpt else e for i, e in enumerate(layer_elements(model, rebuilt)))
    return int(tokens * elements * dtype_bytes / max(tp, 1))


def activation_bytes(model: CausalLM, tokens: int, dtype_bytes: int | None = None, tp: int = 1) -> int:
    """Estimated activation memory of a training pass of ``tokens`` tokens without checkpointing
    (bytes): :func:`kept_bytes` plus :data:`HEAD_BYTES`."""
    return kept_bytes(model, tokens, (), dtype_bytes, tp) + HEAD_BYTES


def checkpoint_order(model: CausalLM, elements: list[int] | None = None) -> list[int]:
    """The order in which ``auto`` adds layers to checkpoint: most kept per token first, ties by
    index (the same on every rank of a sharded engine). ``elements``: :func:`layer_elements`
    of ``model`` if already computed."""
    elements = layer_elements(model) if elements is None else elements
    return sorted(range(len(elements)), key=lambda i: (-elements[i], i))


def layers_to_checkpoint(model: CausalLM, excess: int, tokens: int, dtype_bytes: int | None = None,
                         tp: int = 1, scale: float = 1.0) -> list[int]:
    """The fewest decoder layers whose checkpointing frees ``excess`` bytes of a pass of ``tokens``
    tokens, taken in :func:`checkpoint_order` (those that keep the most per token first). A
    checkpointed layer still keeps its input (one hidden size per token, one per stream under
    hyper-connections), and its backward rebuilds its activations, one layer at a time, so the
    largest chosen layer's activations count against what is freed. ``scale`` multiplies the
    estimate (the engine's measured-to-estimated ratio, below 1 where the estimate is high). All
    layers if that is not enough."""
    if excess <= 0:
        return []
    if dtype_bytes is None:
        dtype_bytes = model.model.embed_tokens.weight.element_size()
    per_token = dtype_bytes * scale * tokens / max(tp, 1)
    kept = model.config.hidden_size * int(getattr(model.model, "streams", 1))
    elements = layer_elements(model)
    chosen: list[int] = []
    freed = 0.0
    for i in checkpoint_order(model, elements):
        chosen.append(i)
        freed += max(elements[i] - kept, 0) * per_token
        if freed - elements[chosen[0]] * per_token >= excess:
            return sorted(chosen)
    return list(range(len(elements)))


def available_bytes(device: torch.device) -> int:
    """Memory a pass can still take on a CUDA ``device``: the driver's free memory plus what
    PyTorch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


__all__ = ["SNAPSHOTS", "LayerCheckpointing", "LayerRouting", "activation_bytes", "apply_checkpointing",
           "available_bytes", "checkpoint_order", "kept_bytes", "layer_elements", "layers_to_checkpoint"]
