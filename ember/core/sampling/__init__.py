"""Sampling in the training engine: paged KV cache, continuous batching, Tinker sampling semantics.

* :mod:`.engine` — :class:`SamplingEngine` (prefill + decode steps) and :class:`SamplerConfig`
* :mod:`.scheduler` — admission of requests into the running batch (continuous batching)
* :mod:`.kv_cache` — paged KV cache (block tables, shared pages) and recurrent-state store
* :mod:`.attention` — prefill and decode attention over the cache (Triton decode kernel on CUDA)
* :mod:`.decode` / :mod:`.graphs` — eager decode steps; static-shape steps for CUDA graphs
* :mod:`.static_route` / :mod:`.lora_stacks` / :mod:`.packed_linears` — the static steps' LoRA
  route, stacked factors and packed base weights
* :mod:`.logits` — LM-head logits, temperature / top-k / top-p, seeded sampling
* :mod:`.requests` — token-level requests, results and stop rules
"""

from ember.core.sampling.engine import EngineStats, SamplerConfig, SamplingEngine, StepRecord
from ember.core.sampling.logits import derive_seed
from ember.core.sampling.requests import (
    GenerationRequest,
    GenerationResult,
    InvalidGeneration,
    SequenceResult,
    StopRule,
)

__all__ = [
    "EngineStats",
    "GenerationRequest",
    "GenerationResult",
    "InvalidGeneration",
    "SamplerConfig",
    "SamplingEngine",
    "SequenceResult",
    "StepRecord",
    "StopRule",
    "derive_seed",
]
