"""Correctness checks of the GPU-only code paths (run on the GPU machine; CI has no GPU).

* varlen flash attention over packed documents vs per-document SDPA (forward and gradients)
* grouped products (``torch._grouped_mm``, bf16) vs a loop of matmuls
* a mixed-adapter packed batch vs each adapter alone (bf16, grouped path; and fp32, loop path)

Prints the largest relative errors; exits non-zero if one exceeds its bf16 tolerance.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.core.adapters import LoraConfig  # noqa: E402
from ember.core.config import AttentionSpec, config_from_hf  # noqa: E402
from ember.core.kernels.grouped import grouped_linear, offsets_from_sizes  # noqa: E402
from ember.core.layers.attention import PackedAttention, _varlen_fn  # noqa: E402
from ember.core.loading import random_model  # noqa: E402
from ember.engine.worker import Worker  # noqa: E402
from ember.types import Datum, ForwardBackwardInput  # noqa: E402

FAILED = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def report(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        FAILED.append(name)


def check_attention() -> None:
    fn, params = _varlen_fn()
    print("varlen_attn:", fn is not None, sorted(params))
    if fn is not None:
        print(inspect.signature(fn))
    torch.manual_seed(0)
    docs = [700, 1300, 48]
    T = sum(docs)
    for spec in (AttentionSpec("global"), AttentionSpec("sliding", 256)):
        q = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
        outs = {}
        for backend in ("varlen", "sdpa"):
            q.grad = k.grad = v.grad = None
            try:
                o = PackedAttention(docs, q.device, backend)(q, k, v, spec, 128**-0.5)
            except Exception as e:  # noqa: BLE001
                print(f"attention {backend} {spec.kind}: {type(e).__name__}: {e}")
                break
            (o.float() * g.float()).sum().backward()
            outs[backend] = (o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
        if len(outs) == 2:
            for i, n in enumerate(["out", "dq", "dk", "dv"]):
                report(f"varlen vs sdpa {spec.kind} {n}", rel(outs["varlen"][i], outs["sdpa"][i]), 2e-2)


def check_grouped() -> None:
    torch.manual_seed(0)
    x = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 256, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    sizes = [100, 0, 1700, 1000, 200]
    offs = offsets_from_sizes(sizes, x.device)
    y = grouped_linear(x, w, offs)
    ref, start = [], 0
    for g, n in enumerate(sizes):
        ref.append(x[start : start + n].float() @ w[g].float().T)
        start += n
    report("grouped_linear bf16", rel(y, torch.cat(ref)), 1e-2)


def check_mixed(dtype: torch.dtype) -> None:
    cfg = config_from_hf({
        "model_type": "qwen3_moe", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
    })
    worker = Worker(random_model(cfg, "cuda", dtype, seed=0), max_adapters=8, max_rank=32)
    slots = [worker.create_adapter(LoraConfig(rank=r, alpha=16, seed=i)) for i, r in enumerate([8, 16, 32, 16])]
    g = torch.Generator(device="cpu").manual_seed(1)
    for s in slots:
        for t in worker.adapter(s).parameters():
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    rng = np.random.default_rng(0)
    reqs = []
    for s in slots:
        seqs = [rng.integers(0, 2048, n + 1) for n in (300, 129, 64)]
        reqs.append(ForwardBackwardInput(s, [Datum(x[:-1], {"target_tokens": x[1:]}) for x in seqs]))
    alone_lp, alone_grad = [], []
    for r in reqs:
        (o,) = worker.forward_backward([r])
        alone_lp.append(o.logprobs)
        a = worker.adapter(r.slot)
        alone_grad.append([t.grad.clone() for t in a.parameters()])
        a.optimizer.zero_grad()
    mixed = worker.forward_backward(reqs)
    name = str(dtype).split(".")[-1]
    lp_err = max(rel(torch.tensor(m), torch.tensor(a)) for o, al in zip(mixed, alone_lp) for m, a in zip(o.logprobs, al))
    report(f"mixed adapters {name}: logprobs", lp_err, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    g_err = max(
        rel(t.grad, ref) for r, refs in zip(reqs, alone_grad) for t, ref in zip(worker.adapter(r.slot).parameters(), refs)
        if ref.abs().sum() > 0
    )
    report(f"mixed adapters {name}: gradients", g_err, 5e-2 if dtype == torch.bfloat16 else 1e-4)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    check_attention()
    check_grouped()
    check_mixed(torch.float32)
    check_mixed(torch.bfloat16)
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)
