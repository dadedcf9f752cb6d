"""Sequence parallelism (Megatron's, with tensor parallelism) for packed tokens.

Under TP the ranks of a group run the same tokens. With sequence parallelism each of them holds
only its slice of the pass's tokens (``tensor_split`` of the packed ``T`` rows, the same on every
rank) wherever the work is per token: the residual stream, the norms, the routers and the routed
experts. The modules that mix tokens or are split by TP run on every token:

* the token mixers (``self_attn`` / ``linear_attn``: attention, MLA, Gated DeltaNet, Inkling2's
  relative attention) and the dense MLPs (``SwiGLU``, shared experts too) gather the rows of
  every tensor they take (Inkling2's global layers: ``x`` and the key and value mixtures
  ``k_in``, ``v_in``; the pass's positions and documents come in the context) (backward: a
  reduce-scatter), and their row-parallel output projection reduce-scatters the partial sums
  back to the rows of each rank (backward: an all-gather), in place of the all-reduce of plain
  TP. Their column-parallel inputs need no copy (the gather's backward already sums the
  gradient), nor do MLA's latents or Inkling2's frozen per-head projections;
* qwen4_exp's n-gram memory (computed whole on every rank) gathers its input and keeps this
  rank's rows of its output;
* a short convolution on the residual side (Inkling2's after the attention and after the MoE)
  runs on this rank's rows preceded by the ``K - 1`` rows before them
  (:meth:`SequenceParallel.with_history`: an all-gather of every rank's last ``K - 1`` rows;
  backward: their gradients reduce-scattered back), and keeps its own rows of the output;
* the final hidden states are gathered for the (vocabulary-parallel) LM head.

The routed experts run on each rank's own rows: with EP they are dispatched from there; without
EP every rank holds every expert and its factors' gradients are then parts of the whole (summed
over every rank). The router records and replays (R3) through :class:`ShardedRouting`, which
slices the pass's ``[T, k]`` replays to this rank's rows and gathers what it records.

Sequence parallelism is on for training passes (expert dispatch ``"all_to_all"``) and off for
sampling and decode steps, which keep plain TP (:func:`ember.dist.expert_parallel.set_mode`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ember.core.layers.lora import LoraRoute
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.moe import ExpertRows, Experts, Routing, RoutingRecord
from ember.core.layers.ngram_memory import PLELayer
from ember.core.layers.short_conv import ShortConvolution
from ember.core.models.base import CausalLM, ForwardContext
from ember.dist import comm
from ember.dist.mesh import Parallel
from ember.dist.tensor_parallel import PARTIAL, ColumnParallel, CopiedOutput, RowParallel

TOKEN_MIXERS = ("self_attn", "linear_attn")


class SequenceParallel:
    """The token split of the current pass, shared by the hooks of one model."""

    def __init__(self, parallel: Parallel):
        self.group, self.tp, self.rank = parallel.tp_group, parallel.layout.tp, parallel.layout.tp_rank
        self.active = True
        self.sizes: list[int] = []

    def split(self, tokens: int) -> None:
        self.sizes = [len(part) for part in torch.arange(tokens).tensor_split(self.tp)]

    def bounds(self) -> tuple[int, int]:
        start = sum(self.sizes[: self.rank])
        return start, start + self.sizes[self.rank]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds()
        return x[start:end]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_tokens(x, self.sizes, self.group)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return comm.scatter_tokens(x, self.sizes, self.group)

    def with_history(self, x: torch.Tensor, seq_lens: list[int], span: int) -> tuple[torch.Tensor, list[int]]:
        """This rank's rows ``x`` preceded by the ``span`` rows of the pass before them (fewer at
        its start), and the documents' lengths over those rows (``seq_lens``: the pass's). Every
        rank sends its last ``span`` rows to all (an all-gather of ``tp · span`` rows); backward
        returns each history row's gradient to its rank (a reduce-scatter)."""
        tails = [min(span, n) for n in self.sizes]
        # the last rows of ranks 0..rank-1, in order: their last `span` rows are the history
        got = comm.gather_tokens(x[x.shape[0] - tails[self.rank] :], tails, self.group)
        before = sum(tails[: self.rank])
        history = got[max(0, before - span) : before]
        start, end = self.bounds()
        lo, lens, pos = start - history.shape[0], [], 0
        for n in seq_lens:
            a, b = max(pos, lo), min(pos + n, end)
            if a < b:
                lens.append(b - a)
            pos += n
        return torch.cat([history, x]), lens or [0]


class ShardedRouting(RoutingRecord):
    """A pass's :class:`RoutingRecord` seen by routers that hold this rank's rows only."""

    def __init__(self, whole: RoutingRecord, sp: SequenceParallel):
        super().__init__(record=whole.record, replay=whole.replay, reference=whole.reference, flips=whole.flips)
        self.sp = sp

    def route(self, layer: int, gate: nn.Module, x: torch.Tensor) -> Routing:
        def mine(rows: dict | None):
            return None if not rows or layer not in rows else {layer: self.sp.local(rows[layer])}

        local = RoutingRecord(
            record={} if self.record is not None else None,
            replay=mine(self.replay),
            reference=mine(self.reference),
            flips={} if self.flips is not None else None,
        )
        r = local.route(layer, gate, x)
        sizes, group = self.sp.sizes, self.sp.group
        if self.record is not None:
            self.record[layer] = comm.gather_rows(local.record[layer], sizes, group)
        if local.flips and layer in local.flips:
            self.flips[layer] = comm.gather_rows(local.flips[layer].to(torch.uint8), sizes, group).bool()
        return r


class LocalExperts:
    """The ``dispatch`` of experts held whole on every rank (TP without EP): this rank's rows."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, experts: Experts, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        group = None if lora is None or not self.sp.active else self.sp.local(lora.moe_token_group())
        rows = ExpertRows.sort(routing, lora, group)
        out = experts.compute(x, rows.token, rows.weight, rows.key, rows.group, rows.groups, lora, rows.inverse)
        return experts.combine(x, rows.token, out, rows.inverse)


def apply_sequence_parallel(model: CausalLM, parallel: Parallel, kinds: dict[str, str]) -> SequenceParallel:
    """Hook ``model`` (already split by :func:`~ember.dist.tensor_parallel.shard_linears`) for
    sequence parallelism; returns the shared state (``model.sequence_parallel``). ``kinds``: the
    factor kinds, updated for the factors whose gradients become parts (see the module doc)."""
    sp = SequenceParallel(parallel)
    model.sequence_parallel = sp
    whole_states = model.hidden_states

    def hidden_states(input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if not sp.active:
            return whole_states(input_ids, ctx)
        sp.split(input_ids.shape[0])
        if ctx.routing is not None:
            ctx = replace(ctx, routing=ShardedRouting(ctx.routing, sp))
        return comm.gather_rows(whole_states(input_ids, ctx), sp.sizes, sp.group)

    model.hidden_states = hidden_states
    model.model.embed_tokens.register_forward_hook(lambda mod, args, out: sp.local(out) if sp.active else None)

    def gather_input(mod, args):
        return (sp.gather(args[0]), *args[1:]) if sp.active else None

    def gather_inputs(mod, args, kwargs):
        if not sp.active:
            return None

        def gather(x):
            if not isinstance(x, torch.Tensor):
                return x
            if x.shape[0] != sp.sizes[sp.rank]:
                raise ValueError(f"sequence parallelism: a tensor input of {type(mod).__name__} has {x.shape[0]} "
                                 f"rows, not this rank's {sp.sizes[sp.rank]} tokens")
            return sp.gather(x)

        return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

    def with_history(mod, args):
        if not sp.active:
            return None
        x, seq_lens, *state = args
        if state and state[0] is not None:
            raise ValueError("sequence parallelism runs training passes only, not a pass that continues sequences")
        return (*sp.with_history(x, seq_lens, mod.kernel - 1), *state)

    def local_rows(mod, args, out):
        return out[out.shape[0] - sp.sizes[sp.rank] :] if sp.active else None

    whole: list[str] = []  # modules that run on every token of the pass
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "shard", None), (ColumnParallel, CopiedOutput, RowParallel)):
            mod.shard.sp = sp
            if isinstance(mod.shard, CopiedOutput):
                kinds[f"{mod.lora_name}.lora_A"] = kinds[f"{mod.lora_name}.lora_B"] = PARTIAL
        if any(name.startswith(f"{w}.") for w in whole):
            continue
        if isinstance(mod, PLELayer):  # (x, input_ids, ctx): the ids are the pass's already
            mod.register_forward_pre_hook(gather_input)
            mod.register_forward_hook(lambda m, args, out: sp.local(out) if sp.active else None)
            whole.append(name)
        elif name.rsplit(".", 1)[-1] in TOKEN_MIXERS or isinstance(mod, SwiGLU):
            rows = [m for m in mod.modules() if isinstance(getattr(m, "shard", None), RowParallel)]
            if not rows:
                raise ValueError(f"sequence parallelism: {name} has no row-parallel output projection")
            mod.register_forward_pre_hook(gather_inputs, with_kwargs=True)
            whole.append(name)
        elif isinstance(mod, ShortConvolution):  # on the residual side (Inkling2's sconv_out / sconv_mlp)
            mod.register_forward_pre_hook(with_history)
            mod.register_forward_hook(local_rows)
        elif isinstance(mod, Experts):
            if mod.dispatch is None:
                mod.dispatch = LocalExperts(sp)
                for suffix in mod.lora_shapes():
                    kinds[f"{mod.lora_name}.{suffix}.lora_A"] = kinds[f"{mod.lora_name}.{suffix}.lora_B"] = PARTIAL
            else:
                mod.dispatch.sp = sp
    return sp
