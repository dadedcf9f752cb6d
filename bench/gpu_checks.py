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

from ember.core.adapters import LoraConfig
from ember.core.config import AttentionSpec, config_from_hf
from ember.core.kernels.grouped import grouped_linear, offsets_from_sizes
from ember.core.layers.attention import PackedAttention, _varlen_fn
from ember.core.loading import random_model
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput

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
    impls = getattr(torch.nn.attention, "list_flash_attention_impls", None)
    print("flash attention impls:", impls() if impls else "n/a")
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
            except RuntimeError as e:
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
    from ember.core.kernels.grouped import grouped_wgrad

    gy = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16)
    gw = grouped_wgrad(gy, x, offs)
    ref_w, start = [], 0
    for n in sizes:
        ref_w.append(gy[start : start + n].float().T @ x[start : start + n].float())
        start += n
    report("grouped_wgrad bf16", rel(gw, torch.stack(ref_w)), 1e-2)


MIXED_CFG = {
    "model_type": "qwen3_moe", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
}


def _mixed_worker(dtype: torch.dtype) -> tuple[Worker, list[int]]:
    worker = Worker(random_model(config_from_hf(MIXED_CFG), "cuda", dtype, seed=0), max_adapters=8, max_rank=32)
    slots = [worker.create_adapter(LoraConfig(rank=r, alpha=16, seed=i)) for i, r in enumerate([8, 16, 32, 16])]
    g = torch.Generator(device="cpu").manual_seed(1)
    for s in slots:
        for t in worker.adapter(s).parameters():
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    return worker, slots


def _mixed_requests(slots: list[int]) -> list[ForwardBackwardInput]:
    rng = np.random.default_rng(0)
    reqs = []
    for s in slots:
        seqs = [rng.integers(0, 2048, n + 1) for n in (300, 129, 64)]
        reqs.append(ForwardBackwardInput(s, [Datum(x[:-1], {"target_tokens": x[1:]}) for x in seqs]))
    return reqs


def _run(worker: Worker, reqs: list[ForwardBackwardInput], together: bool):
    """Per-request logprobs and per-adapter gradients, run together (one pass) or alone."""
    lps, grads = [], []
    outs = worker.forward_backward(reqs) if together else [worker.forward_backward([r])[0] for r in reqs]
    for r, o in zip(reqs, outs):
        lps.append(o.logprobs)
        grads.append({k: g.clone() for k, g in worker.adapter(r.slot).grads().items()})
    for r in reqs:
        worker.adapter(r.slot).optimizer.zero_grad()
    return lps, grads


def check_mixed() -> None:
    """Mixed-adapter pass vs each adapter alone. In bf16 both carry rounding noise, so each is
    compared with the fp32 model (same weights): the mixed pass must not be noisier than alone."""
    ref_worker, slots = _mixed_worker(torch.float32)
    reqs = _mixed_requests(slots)
    ref_lp, ref_grads = _run(ref_worker, reqs, together=False)
    mix_lp, mix_grads = _run(ref_worker, reqs, together=True)
    report("fp32 mixed vs alone: logprobs", max(rel(torch.tensor(a), torch.tensor(b)) for x, y in zip(mix_lp, ref_lp) for a, b in zip(x, y)), 1e-5)
    report("fp32 mixed vs alone: gradients", max(rel(x[k], y[k]) for x, y in zip(mix_grads, ref_grads) for k in y), 1e-4)
    bf_worker, _ = _mixed_worker(torch.bfloat16)
    alone_lp, alone_grads = _run(bf_worker, reqs, together=False)
    mixed_lp, mixed_grads = _run(bf_worker, reqs, together=True)
    lp_alone = max(rel(torch.tensor(a), torch.tensor(b)) for x, y in zip(alone_lp, ref_lp) for a, b in zip(x, y))
    lp_mixed = max(rel(torch.tensor(a), torch.tensor(b)) for x, y in zip(mixed_lp, ref_lp) for a, b in zip(x, y))
    print(f"bf16 logprobs vs fp32: alone {lp_alone:.2e}, mixed {lp_mixed:.2e}")
    report("bf16 mixed logprobs no noisier than alone", lp_mixed, 2 * lp_alone + 1e-3)
    worst = []
    for i, (ga, gm, gr) in enumerate(zip(alone_grads, mixed_grads, ref_grads)):
        for k in gr:
            worst.append((rel(gm[k], gr[k]), rel(ga[k], gr[k]), i, k))
    worst.sort(reverse=True)
    for m, a, i, k in worst[:6]:
        print(f"  adapter {i} {k}: mixed vs fp32 {m:.2e}, alone vs fp32 {a:.2e}")
    report("bf16 mixed gradients no noisier than alone", max(m - 2 * a for m, a, _, _ in worst), 1e-2)


def check_lora_linear() -> None:
    """The fused single-adapter LoRA linear vs the plain formula (bf16, forward and gradients)."""
    from ember.core.layers.lora import _LoraLinearFn

    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    A = (torch.randn(32, 1024, device="cuda") * 0.02).requires_grad_()
    B = (torch.randn(2048, 32, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    half = 2048  # two adapter spans: rows [0, 2048) and [2048, 4096) with different scales
    A2, B2 = A * 0.5, B * 2.0
    y = _LoraLinearFn.apply(x, W, None, ((0, half, 2.0), (half, 4096, 3.0)), A.to(torch.bfloat16),
                            B.to(torch.bfloat16), A2.to(torch.bfloat16), B2.to(torch.bfloat16))
    (y.float() * g.float()).sum().backward()
    got = (y.detach(), x.grad.clone(), A.grad.clone(), B.grad.clone())
    x.grad = A.grad = B.grad = None
    xf = x.detach().double().requires_grad_()
    Af, Bf = A.detach().double().requires_grad_(), B.detach().double().requires_grad_()
    yr = xf @ W.double().T
    yr = torch.cat([yr[:half] + 2.0 * (xf[:half] @ Af.T) @ Bf.T,
                    yr[half:] + 3.0 * (xf[half:] @ (0.5 * Af).T) @ (2.0 * Bf).T])
    (yr * g.double()).sum().backward()
    for name, a, b in zip(["y", "dx", "dA", "dB"], got, (yr, xf.grad, Af.grad, Bf.grad)):
        report(f"fused lora linear {name}", rel(a, b), 2e-2)


def check_fused_kernels() -> None:
    from ember.core.kernels import fused
    from ember.core.layers import activations, norms

    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    g = torch.randn_like(x)
    y = fused.RMSNormFn.apply(x, w, 1e-6, False)
    (y.float() * g.float()).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    yr = norms._RMSNorm.apply(x, w, 1e-6, False)
    (yr.float() * g.float()).sum().backward()
    report("triton rmsnorm y", rel(y, yr), 1e-2)
    report("triton rmsnorm dx", rel(gx, x.grad), 1e-2)
    gu = torch.randn(4096, 2 * 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g2 = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    y = fused.SiluMulFn.apply(gu[:, :3072], gu[:, 3072:])
    (y.float() * g2.float()).sum().backward()
    got = gu.grad.clone()
    gu.grad = None
    yr = activations._SiluMul.apply(gu[:, :3072], gu[:, 3072:])
    (yr.float() * g2.float()).sum().backward()
    report("triton silu_mul y", rel(y, yr), 1e-2)
    report("triton silu_mul grads", rel(got, gu.grad), 1e-2)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    check_attention()
    check_grouped()
    check_fused_kernels()
    check_lora_linear()
    check_mixed()
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)
