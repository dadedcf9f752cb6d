"""Checks of an engine's options that need no model: shared by ``ember serve`` (before it starts any
engine) and the engine process itself (``python -m ember.engine.service``, which the supervisor
starts and a user may start by hand), so both refuse the same values with the same message.
Torch-free: the API process imports it."""

from __future__ import annotations

# --warmup of ember serve and of the engine (ember.engine.warmup)
WARMUP_MODES = ("auto", "on", "off")
# --activation-checkpointing of ember serve and of the engine (ember.core.checkpointing)
CHECKPOINTING_MODES = ("auto", "on", "off")


def engine_flag_errors(
    *,
    nproc: int = 1,
    ep: int = 1,
    tp: int = 1,
    expert_fsdp: bool = False,
    full_finetune: bool = False,
    ray: str | None = None,
    optimizer_offload: str = "none",
    optimizer_device_gib: float = 0.0,
    max_prefill_tokens: int = 1,
) -> list[str]:
    """Every problem with these options, as messages naming the flags (empty: all fine)."""
    errors = []
    for flag, n in (("--ep", ep), ("--tp", tp)):
        if nproc < 1 or n < 1 or nproc % n:
            errors.append(f"{flag} {n} must divide --nproc {nproc}")
    if ep > 1 and tp > 1 and ep % tp:
        errors.append(f"--ep {ep} must be a multiple of --tp {tp} (expert groups span whole TP groups)")
    if expert_fsdp and ep >= 1 and nproc // ep < 2:
        errors.append(f"--expert-fsdp needs --nproc ({nproc}) > --ep ({ep}): no two processes hold the same experts")
    if full_finetune and (nproc > 1 or ray):
        errors.append("--full-finetune runs each engine on one process: not with --nproc > 1 or --ray")
    if not (optimizer_offload in ("none", "host") or optimizer_offload.startswith("disk:") and len(optimizer_offload) > 5):
        errors.append(f"--optimizer-offload must be none, host or disk:DIR, got {optimizer_offload!r}")
    if optimizer_device_gib < 0:
        errors.append(f"--optimizer-device-gib must be >= 0, got {optimizer_device_gib}")
    if max_prefill_tokens < 1:
        errors.append(f"--max-prefill-tokens must be at least 1, got {max_prefill_tokens}")
    return errors


def flag_values(args) -> dict:
    """The keyword arguments of :func:`engine_flag_errors` from parsed ``argparse`` arguments."""
    names = ("nproc", "ep", "tp", "expert_fsdp", "full_finetune", "ray", "optimizer_offload",
             "optimizer_device_gib", "max_prefill_tokens")
    return {n: getattr(args, n) for n in names}
