"""Running an engine's GPU code paths once before it serves.

On a fresh GPU machine the first pass of some families is slow for reasons that have nothing to
do with its size: flash-linear-attention autotunes each of its Triton kernels on first use (Gated
DeltaNet families: 45-187 s on an H200), FlexAttention compiles Inkling2's relative attention
(5-7 s per variant, 17 s of its first step, and once more for the first batch of another
composition), and Triton compiles Ember's own kernels (the sampler's, the hyper-connections'). Without a warm-up the first client's request pays for it and
may time out.

:func:`warm_up` runs, through the worker's public calls (so a sharded engine's ranks all take
part), a LoRA training pass at each of :data:`LENGTHS` (two lengths, so that compilers that
specialise on a first shape build their dynamic-shape variant) and one sampling request with and
one without the adapter, then frees the adapter and the sampler's KV cache. Nothing persists: no
optimizer step, no slot kept, no KV cache held, and passes this short do not feed the
activation-memory estimate of ``auto`` checkpointing (``ember.engine.worker.MEASURE_MIN_TOKENS``).
fla's autotuning keys hold head counts and sizes but not the sequence length, so what a short pass
tunes serves every pass. CUDA graphs of decode steps are captured again at the first real sample.
Triton keeps the compiled kernels and, on an engine's GPU, the autotuning choices
(:func:`keep_autotuning`) in its cache directory, so a restart on the same machine warms up in
seconds.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from ember.core.adapters import LoraConfig
from ember.engine_flags import WARMUP_MODES
from ember.types import Datum, ForwardBackwardInput, RequestError, SampleInput, SamplingParams

log = logging.getLogger(__name__)

LENGTHS = (192, 320)  # tokens of the two warm-up training passes
PROMPT, NEW = 16, 4  # the warm-up sample's prompt and new tokens
MODES = WARMUP_MODES


def keep_autotuning() -> None:
    """Have Triton keep its autotuning results on disk, beside its compiled kernels
    (``TRITON_CACHE_AUTOTUNING``; a value the user set wins). An engine started again on the same
    machine then reads fla's choices instead of timing every configuration again. On an H100, a
    Qwen3-Next-8l process's first step took 22 s with the compiled kernels cached and 5-7 s with the
    choices cached too (docs/performance.md, 2026-12-06, fourteenth session). Triton reads the
    setting when a module's kernels are decorated, so this runs before fla is imported (the Gated
    DeltaNet layers import it at their first pass on CUDA)."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def wants_warm_up(mode: str, device: str) -> bool:
    """``auto``: on CUDA devices only (the CPU compiles and tunes nothing)."""
    if mode not in MODES:
        raise ValueError(f"warm-up must be one of {MODES}, not {mode!r}")
    return mode == "on" or (mode == "auto" and str(device).startswith("cuda"))


def _check(outs: list, what: str) -> None:
    errors = [out.message for out in outs if isinstance(out, RequestError)]
    if errors:
        raise RuntimeError(f"warm-up {what} failed: {errors[0]}")


def warm_up(worker, vocab_size: int, lengths: tuple[int, ...] = LENGTHS) -> float:
    """Run the training and sampling paths of ``worker`` (a :class:`~ember.engine.worker.Worker`
    or a fan-out of ranks) once on random tokens; returns the seconds it took. Raises if a pass
    fails: what fails here would fail the first client's request too."""
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    slot = worker.create_adapter(LoraConfig(rank=8, alpha=8.0, targets=frozenset(("attn", "mlp"))))
    try:
        for i, n in enumerate(lengths):
            t0 = time.perf_counter()
            seq = rng.integers(0, vocab_size, n + 1)
            datum = Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})
            _check(worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy")]), "training pass")
            log.info("warm-up: training pass", extra={"pass": f"{i + 1}/{len(lengths)}", "tokens": n,
                                                      "seconds": round(time.perf_counter() - t0, 1)})
        t0 = time.perf_counter()
        prompt = rng.integers(0, vocab_size, PROMPT)
        params = SamplingParams(max_tokens=NEW, seed=0)
        try:
            _check(worker.sample([SampleInput(slot, prompt, params), SampleInput(0, prompt, params)]), "sample")
        finally:
            # its KV cache (a share of the free memory) would stay allocated in an engine that
            # only trains; the first real sample allocates it again, with the kernels compiled
            worker.release_sampler()
        log.info("warm-up: sampling", extra={"seconds": round(time.perf_counter() - t0, 1)})
    finally:
        worker.free_adapter(slot)
    return time.perf_counter() - start
