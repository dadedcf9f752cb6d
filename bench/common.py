"""Shared pieces of the GPU benchmarks: model shapes, timing, FLOP counts, hardware line."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable

import torch

# Qwen3-8B shape (shared/perf_targets.md), random weights.
QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
}

# Qwen3-30B-A3B shape.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
}

# A tiny shape to smoke-test the benchmark scripts on the CPU.
TINY = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}

TINY_MOE = {
    **TINY,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}

PEAK_BF16_FLOPS = 790e12  # measured 8192^3 bf16 matmul rate of this H200 (shared/perf_targets.md)
COPY_BANDWIDTH = 4.3e12  # measured device-to-device copy bandwidth, bytes/s


def hardware_line() -> str:
    """The GPU line from nvidia-smi (name, memory, driver), or torch's device name."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def active_params(cfg: dict) -> float:
    """Matmul parameters a token passes through (embedding lookup excluded, LM head included)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * d * (2 * nq + 2 * nkv)
    if cfg.get("num_experts"):
        mlp = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"] + h * cfg["num_experts"]
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    return layers * (attn + mlp) + h * cfg["vocab_size"]


def train_flops(cfg: dict, seq_lens: list[int]) -> float:
    """LoRA step FLOPs: 4·N·T (forward + activation gradients; frozen base has no weight gradients)
    plus causal attention (forward 2·S²·H·D, backward twice that)."""
    tokens = sum(seq_lens)
    n = active_params(cfg)
    hd = cfg["num_attention_heads"] * cfg["head_dim"]
    attn = sum(3 * 2 * s * s * hd for s in seq_lens) * cfg["num_hidden_layers"]
    return 4 * n * tokens + attn


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(fn: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Wall times (s) of ``iters`` calls of ``fn`` after ``warmup`` calls, synchronised."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


class MemoryMeter:
    """Static and peak allocated device memory around a region (zeros on the CPU)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.static = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.static = 0

    def stop(self) -> dict[str, float]:
        peak = torch.cuda.max_memory_allocated() if self.cuda else 0
        return {"peak_gib": gib(peak), "static_gib": gib(self.static), "activation_gib": gib(peak - self.static)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30
