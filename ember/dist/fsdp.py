"""FSDP2 in Ember: the one place that applies ``torch.distributed.fsdp.fully_shard``.

* :func:`shard_modules`: the general hook. It shards a list of modules, frozen or trainable, over
  one process group. Each module's parameters become ``DTensor(Shard(0))`` pieces. They are
  all-gathered before each of the module's forward methods and freed after it
  (``reshard_after_forward``), and gathered again in backward when a product saved them.
* :func:`shard_expert_weights` (``ember serve --expert-fsdp``): the experts of every MoE layer over
  the ranks that hold the same experts (``efsdp``). The experts are frozen and their LoRA factors
  live in the adapter bank, so FSDP reduces no gradient here. The bank's expert gradients are summed
  over the same ``efsdp`` group by :mod:`ember.dist.adapters`, as without this option.
* :func:`unsharded`: every FSDP module of a model gathered once for a whole sampling run, so that a
  decode step does not all-gather every MoE layer again.

Public FSDP2 API only (``fully_shard``, ``register_fsdp_forward_method``, ``DeviceMesh.from_group``,
``unshard``/``reshard``, ``set_reshard_after_forward``, ``set_gradient_divide_factor``), for the
project's torch >= 2.9. Checked on 2.13 and 2.11 (CPU, gloo); not yet over NCCL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from ember.core.layers.moe import Experts
from ember.dist.mesh import Parallel

_RESHARD = "_ember_reshard_after_forward"  # what unsharded() restores


def shard_modules(
    modules: Sequence[nn.Module],
    group,
    *,
    reshard_after_forward: bool = True,
    forward_methods: Sequence[str] = (),
    name: str = "fsdp",
    **fsdp_kwargs,
) -> list[FSDPModule]:
    """Shard every module of ``modules`` separately over the process group ``group``, in place
    (``fully_shard`` on a one-dimensional mesh over ``group``). Each module is then one all-gather
    unit: its parameters are gathered before its ``forward`` and each of ``forward_methods`` (the
    methods that callers use *instead of* ``forward``, e.g. a sampler's ``decode``; never a method
    that ``forward`` itself calls: see :func:`shard_expert_weights`) and freed after them when
    ``reshard_after_forward``. Gradients of trainable parameters are reduce-scattered as SUMS, never
    means: Tinker's losses are sums, so the divide factor is 1. ``fsdp_kwargs`` go to
    ``fully_shard`` (``mp_policy``, ``offload_policy``, ``ignored_params``, ...).

    Every rank of ``group`` must run the same modules' forward methods in the same order, since each
    one is an all-gather. Call this on loaded modules, the same ones on every rank of ``group``.
    ``reshard_after_forward`` is passed explicitly, so a module that is an FSDP root (as each
    ``Experts`` is) frees its parameters after forward too (FSDP's default keeps a root's gathered).
    Returns the modules.

    **Full fine-tuning** (one tenant, trainable base) will call this hook too:

    * the experts of each MoE layer first, over the expert groups (``parallel.efsdp_group``), as
      :func:`shard_expert_weights` does, so that they are units of their own (torch < 2.13 has no
      per-parameter mesh inside one unit; on 2.13 ``shard_placement_fn`` returning a
      ``ShardPlacementResult`` could keep them in their block's unit);
    * then the decoder blocks one by one, bottom-up, over the ranks that hold the same dense
      weights (``parallel.dp_group``; FSDP2 leaves a submodule that is already sharded, the
      experts, to its own unit), then the model itself (the root: embedding, final norm, head),
      with ``forward_methods`` for the methods that callers use instead of ``forward`` (a Llama
      layer's ``step``, which passes without gradients chain instead of calling ``forward``:
      :meth:`ember.core.models.base.CausalLM.hidden_states`);
    * ``mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and, for the optimizer
      off the GPU, ``offload_policy=CPUOffloadPolicy(pin_memory=True)`` with the process group
      backend ``"cpu:gloo,cuda:nccl"``.

    The gradients are then the sums over ``group`` of every rank's gradients, and each rank holds
    its ``Shard(0)`` piece (``param.grad.to_local()``), on which the optimizer runs.
    """
    if not modules:
        return []
    device = next(p.device for m in modules for p in m.parameters())
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(name,))
    out = []
    for m in modules:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
        for method in forward_methods:
            register_fsdp_forward_method(m, method)
        if any(p.requires_grad for p in m.parameters()):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # gloo has no PREMUL_SUM
                m.set_force_sum_reduction_for_comms(True)
        setattr(m, _RESHARD, reshard_after_forward)
        out.append(m)
    return out


def shard_expert_weights(model: nn.Module, parallel: Parallel) -> int:
    """``--expert-fsdp``: shard every MoE layer's experts over the ranks that hold the same experts
    (``parallel.efsdp_group``: ``world / ep`` ranks). Each of them keeps ``1/efsdp`` of its expert
    block (split on the expert dimension; FSDP pads a remainder). A layer's block is all-gathered
    for the duration of its ``Experts.forward`` and freed after it. In backward it is gathered
    again for the products that saved it (``_ExpertProjection``; the storage FSDP refills is the
    one autograd saved) and freed once the layer's input gradient is computed. Returns the number
    of sharded modules.

    The unit is ``forward``, not :meth:`Experts.compute`. The dispatchers of
    :mod:`ember.dist.expert_parallel` call ``compute`` (and ``combine``), but only from inside
    ``forward`` (``Experts.forward`` calls ``dispatch``). So the forward hooks already bracket every
    ``compute``, and the gathered window also spans the layer's all-to-alls. Hooking ``compute`` as
    well (``register_fsdp_forward_method``) would nest two FSDP forwards of one module. The outer
    post-forward then reshards whatever ``reshard_after_forward`` says, which breaks
    :func:`unsharded`, and the backward gathers once more.

    Applied after :func:`~ember.core.loading.load_model`, on each rank's loaded expert block: the
    peak memory at load is still the whole block; sharding on the meta device before loading (each
    rank reading only its piece) is the next step. Raises ``ValueError`` when it cannot apply: no MoE
    layers, or ``efsdp == 1`` (``world == ep``: no two ranks hold the same experts)."""
    efsdp = parallel.layout.efsdp
    if efsdp == 1:
        raise ValueError(
            f"--expert-fsdp needs more processes than --ep: {parallel.world} processes at --ep "
            f"{parallel.layout.ep} leave one rank per block of experts"
        )
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        raise ValueError("--expert-fsdp needs a model with MoE layers")
    shard_modules(experts, parallel.efsdp_group, name="efsdp")
    return len(experts)


@contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Inside: every FSDP module of ``model`` gathered (one all-gather each, on entry) and kept
    gathered through every forward (a sampling run's prefill and decode steps); on exit they are
    sharded again. Memory inside is that of the unsharded modules (with ``--expert-fsdp``: every
    layer's whole expert block). A model without FSDP modules: nothing happens. Every rank of the
    modules' groups must enter it together."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_reshard_after_forward(getattr(m, _RESHARD, True), recurse=False)
            m.reshard()
