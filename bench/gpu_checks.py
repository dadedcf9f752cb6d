"""Correctness checks of the GPU-only code paths (run on the GPU machine; CI has no GPU).

* varlen flash attention over packed documents vs per-document SDPA (forward and gradients)
* grouped products (``torch._grouped_mm``, bf16) vs a loop of matmuls
* a mixed-adapter packed batch vs each adapter alone (bf16, grouped path; and fp32, loop path)
* the decode LoRA delta kernels (split-K Triton) vs two grouped products + add: agreement, and the
  GPU time of each (CUDA graphs of repeated calls, timed with CUDA events) against the bytes read
* the static decoder's one-launch SwiGLU LoRA kernel vs the three kernels it replaces, and their time
* the one-launch paged-cache write vs the two ``index_copy_`` it replaces, and the time of each
* paged decode attention (flash-decoding kernel) vs the reference, with its time and bandwidth;
  with Inkling-2's relative bias and sinks vs the gathered PyTorch path
* the sampling kernel (plain rows) vs the fp64 PyTorch draw, with its time
* the LM head padded to aligned rows (Olmo 3's vocabulary) vs fp64, and its time padded and not
* Qwen3.8-Flash-Next's hyper-connection kernels vs eager, and their time
* rebuilt activations: a mixed-adapter MoE pass with and without them (logprobs, gradients, bytes
  kept), and the MoE combine kernel against fp32
* the MoE LoRA kernels: the expand added in place (``grouped_lora``) and the shrink factor's
  gradient over gathered rows (``gathered_wgrad``) against the grouped products they replace, with
  their time
* the Gated DeltaNet rule through fla (bf16, chunked over packed sequences with initial states,
  and the recurrent decode step) vs Ember's fp32 PyTorch rule (outputs, final states, gradients),
  a GDN layer with fla vs torch, and fla's time at 8k tokens in Qwen3-Next's head layout; the key
  heads' norm and repetition for fla against fp64 and against the path it replaced, with its time;
  strided copies as 8-byte words against ``contiguous()``; the short convolution's kernels against
  fp64 and fla's, with their time
* the static decoder (fp32, three adapters) with programmatic dependent launch (``pdl_decode``) and
  with the decode GEMM (``decode_gemm``) against the same decoder without them

Prints the largest relative errors; exits non-zero if one exceeds its bf16 tolerance.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, event_time_ms, graph_us
from ember.core.adapters import LoraConfig
from ember.core.config import AttentionSpec, config_from_hf
from ember.core.kernels.grouped import grouped_linear, grouped_wgrad, offsets_from_sizes
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
    # (spec, q/k head size, v head size, KV heads): GQA, and MLA's narrower values (DeepSeek-V3)
    cases = ((AttentionSpec("global"), 128, 128, 2), (AttentionSpec("sliding", 256), 128, 128, 2),
             (AttentionSpec("global"), 192, 128, 8))
    for spec, d, dv, hkv in cases:
        q = torch.randn(T, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, hkv, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, 8, dv, device="cuda", dtype=torch.bfloat16)
        outs = {}
        for backend in ("varlen", "sdpa"):
            q.grad = k.grad = v.grad = None
            try:
                o = PackedAttention(docs, q.device, backend)(q, k, v, spec, d**-0.5)
            except RuntimeError as e:
                print(f"attention {backend} {spec.kind}: {type(e).__name__}: {e}")
                break
            (o.float() * g.float()).sum().backward()
            outs[backend] = (o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
        if len(outs) == 2:
            for i, n in enumerate(["out", "dq", "dk", "dv"]):
                report(f"varlen vs sdpa {spec.kind} d={d} dv={dv} {n}", rel(outs["varlen"][i], outs["sdpa"][i]), 2e-2)


def check_continued() -> None:
    """Prefill attention over a cached prompt prefix (``PrefillAttention._continued``: the pages'
    keys gathered, SDPA with a lower-right causal mask; GQA read by flash without repeating the keys,
    a window through the repeated keys) against the whole prompts in one packed call, bf16."""
    from ember.core.sampling.attention import PrefillAttention
    from ember.core.sampling.kv_cache import PagedKVCache

    torch.manual_seed(0)
    ps, Hq, Hkv, D = 16, 32, 8, 128
    lengths, prefixes = [640, 530, 640, 300, 96], [512, 0, 512, 256, 64]
    for spec in (AttentionSpec("global"), AttentionSpec("sliding", 256)):
        cache = PagedKVCache(sum(-(-n // ps) for n in lengths) + 1, ps, torch.bfloat16, "cuda")
        tables = [[cache.allocate() for _ in range(-(-n // ps))] for n in lengths]
        q, k, v = (torch.randn(sum(lengths), h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        full = PackedAttention(lengths, q.device)(q, k, v, spec, D**-0.5)
        starts = np.cumsum([0] + lengths)
        prefix_rows = torch.tensor([j for s, p in zip(starts, prefixes) for j in range(s, s + p)], device="cuda")
        cache.write(0, k[prefix_rows], v[prefix_rows],
                    torch.tensor([x for t, p in zip(tables, prefixes) for x in cache.slots(t, 0, p)], device="cuda"))
        rows = torch.tensor([j for s, n, p in zip(starts, lengths, prefixes) for j in range(s + p, s + n)], device="cuda")
        slots = torch.tensor([x for t, n, p in zip(tables, lengths, prefixes) for x in cache.slots(t, p, n - p)],
                             device="cuda")
        attend = PrefillAttention(cache, slots, [n - p for n, p in zip(lengths, prefixes)],
                                  prefix_lens=prefixes, block_tables=tables)
        out = attend(0, q[rows], k[rows], v[rows], spec, D**-0.5)
        report(f"continued prefix attention {spec.kind}", rel(out, full[rows]), 1e-2)


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
    gy = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16)
    gw = grouped_wgrad(gy, x, offs)
    ref_w, start = [], 0
    for n in sizes:
        ref_w.append(gy[start : start + n].float().T @ x[start : start + n].float())
        start += n
    report("grouped_wgrad bf16", rel(gw, torch.stack(ref_w)), 1e-2)
    # more groups than one call takes (512 experts x 3 adapter groups), some empty: several calls
    from ember.core.kernels.grouped import MAX_GROUPS

    G = 3 * 512  # three calls of MAX_GROUPS
    sizes = torch.randint(0, 3, (G,), generator=torch.Generator().manual_seed(1))
    sizes[MAX_GROUPS - 1] = 0  # an empty group at the chunk border
    offs = offsets_from_sizes(sizes, x.device)
    M = int(sizes.sum())
    xa, wa, gya = x[:M, :64].contiguous(), w[:1, :32, :64].expand(G, 32, 64).contiguous(), gy[:M, :32].contiguous()
    wa = wa * torch.linspace(0.5, 1.5, G, device="cuda", dtype=torch.bfloat16)[:, None, None]
    group = torch.repeat_interleave(torch.arange(G, device="cuda"), sizes.to("cuda"))
    ref = torch.einsum("mi,moi->mo", xa.float(), wa[group].float())
    report(f"grouped_linear bf16, {G} groups", rel(grouped_linear(xa, wa, offs), ref), 1e-2)
    ref_w = torch.zeros(G, 32, 64, device="cuda").index_add_(0, group, gya.float()[:, :, None] * xa.float()[:, None])
    report(f"grouped_wgrad bf16, {G} groups", rel(grouped_wgrad(gya, xa, offs), ref_w), 1e-2)


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


def check_rebuild() -> None:
    """Rebuilt activations (``ember.core.rebuild``) on the CUDA paths (the Triton norm, activation
    and rotary kernels, flash attention, the MoE combine kernel): a mixed-adapter MoE pass gives the
    same logprobs and gradients with and without them (flash attention's backward is not bitwise
    deterministic, so within its run-to-run noise: the same pass twice sets the tolerance) while
    keeping less; and the combine kernel against fp32 at Qwen3-30B-A3B's training shape."""
    from ember.core import rebuild
    from ember.core.layers.moe import sum_rows

    worker, slots = _mixed_worker(torch.bfloat16)
    reqs = _mixed_requests(slots)

    def run(enabled: bool):
        kept = {}
        rebuild.enabled = enabled
        try:
            with rebuild.observing(lambda t: kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())):
                lp, grads = _run(worker, reqs, together=True)
        finally:
            rebuild.enabled = True
        return lp, grads, sum(kept.values())

    lp0, g0, kept0 = run(False)
    _, g1, _ = run(False)
    lp2, g2, kept2 = run(True)
    print(f"kept for backward: {kept0 / 2**20:.1f} MiB without, {kept2 / 2**20:.1f} MiB rebuilt")
    report("rebuilt activations keep less", float(kept2 >= kept0), 0)
    report("logprobs rebuilt vs not", max(rel(torch.tensor(a), torch.tensor(b)) for x, y in zip(lp2, lp0)
                                          for a, b in zip(x, y)), 1e-6)
    noise = max(rel(x[k], y[k]) for x, y in zip(g1, g0) for k in y)
    report(f"gradients rebuilt vs not (run-to-run {noise:.1e})",
           max(rel(x[k], y[k]) for x, y in zip(g2, g0) for k in y), 2 * noise + 1e-6)

    T, k, H = 16384, 8, 2048
    rows, corr = (torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    inverse = torch.randperm(T * k, device="cuda")
    want = (rows.float() + corr.float())[inverse].view(T, k, H).sum(1)
    report("sum_rows kernel with the correction vs fp32", rel(sum_rows(rows, inverse, T, extra=corr), want), 4e-3)
    report("sum_rows kernel, fp32 out", rel(sum_rows(rows, inverse, T, fp32=True, extra=corr), want), 1e-6)


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
    x.grad = None
    y = fused.RMSNormFn.apply(x, w, 1e-6, False, True)  # Olmo's order: the weight product in fp32
    (y.float() * g.float()).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    yr = norms._RMSNorm.apply(x, w, 1e-6, False, True)
    (yr.float() * g.float()).sum().backward()
    report("triton rmsnorm fp32-product y", rel(y, yr), 1e-2)
    report("triton rmsnorm fp32-product dx", rel(gx, x.grad), 1e-2)
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
    # Qwen3-Next's gated norm at its training shape ([16384 tokens, 32 heads, 128]): equal forward
    # (the same roundings), gradients within bf16; and its time against the eager formula
    xz = torch.randn(2, 16384, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wn = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
    g3 = torch.randn(16384, 32, 128, device="cuda", dtype=torch.bfloat16)

    def eager(xv, zv):
        xf = xv.float()
        yv = wn * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(xv.dtype)
        return (yv * torch.nn.functional.silu(zv.float())).to(xv.dtype)

    outs = {}
    for name, fn in (("kernel", lambda: fused.GatedRMSNormFn.apply(xz[0], xz[1], wn, 1e-6, False)),
                     ("eager", lambda: eager(xz[0], xz[1]))):
        y = fn()
        (y.float() * g3.float()).sum().backward()
        outs[name] = (y, xz.grad.clone())
        xz.grad = None
        ms = event_time_ms(lambda fn=fn: fn().backward(g3), 3, 10)
        xz.grad = None  # the timed calls' gradients
        print(f"gated norm {name}: forward + backward {ms:.3f} ms")
    report("triton gated norm y", rel(outs["kernel"][0], outs["eager"][0]), 1e-2)
    report("triton gated norm dx, dgate", rel(outs["kernel"][1], outs["eager"][1]), 1e-2)


def check_norm_rope() -> None:
    """The sampler's fused q/k norm + rotation against the separate kernels (RMSNormFn, RopeFn) on
    the heads of a packed q/k/v product: Qwen3-8B's (plain norms, full rotation) and Qwen3-Next's
    gated attention (zero-centred norms, a quarter rotated); and the two at Qwen3-8B's 64-row
    decode shape (µs, graph replay)."""
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    for case in (("qwen3-8b", 64, 32, 8, 128, False, 1.0), ("qwen3-8b prefill", 4096, 32, 8, 128, False, 1.0),
                 ("qwen3-next", 64, 16, 2, 256, True, 0.25)):
        _norm_rope_case(*case, dev, gen)


def _norm_rope_case(name, T, Hq, Hk, D, zc, partial, dev, gen) -> None:
    from ember.core.config import RopeConfig
    from ember.core.kernels import fused
    from ember.core.layers.rope import RotaryEmbedding

    packed = torch.randn(T, (Hq + 2 * Hk) * D, device=dev, generator=gen).bfloat16() * 3
    q, k = packed[:, : Hq * D].view(T, Hq, D), packed[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    qw = (torch.randn(D, device=dev, generator=gen) * 0.3 + (0 if zc else 1)).bfloat16()
    kw = (torch.randn(D, device=dev, generator=gen) * 0.3 + (0 if zc else 1)).bfloat16()
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e6, partial_rotary_factor=partial), D).cos_sin(
        torch.arange(T, device=dev) * 13, torch.bfloat16)

    def separate():
        return (fused.RopeFn.apply(fused.RMSNormFn.apply(q, qw, 1e-6, zc), cos, sin),
                fused.RopeFn.apply(fused.RMSNormFn.apply(k, kw, 1e-6, zc), cos, sin))

    def together():
        return fused.qk_norm_rope(q, k, qw, kw, 1e-6, 1e-6, zc, cos, sin)

    with torch.no_grad():
        (rq, rk), (gq, gk) = separate(), together()
        # the same values but where rstd, summed in another order, rounds a norm output the other
        # way: few values, by about a bf16 step of the head's scale
        differ = int((rq != gq).sum() + (rk != gk).sum())
        total = rq.numel() + rk.numel()
        report(f"norm_rope {name}: {differ} of {total} values differ; share", differ / total, 1e-4)
        worst = max(float(((gq.float() - rq.float()).abs().amax(-1) / rq.float().abs().amax(-1)).max()),
                    float(((gk.float() - rk.float()).abs().amax(-1) / rk.float().abs().amax(-1)).max()))
        report(f"norm_rope {name}: largest difference / its head's largest value", worst, 1e-2)
        if T == 64:
            print(f"    {name} decode shape: separate {graph_us([separate] * 20):.1f} us, "
                  f"fused {graph_us([together] * 20):.1f} us", flush=True)


def check_tempered_logprobs() -> None:
    """The chunked LM-head logprobs at per-row inverse temperatures (stable_reinforce's support
    replay), on the compiled Triton row kernels, with and without a softcap, against fp64."""
    from ember.core.logprobs import token_logprobs

    torch.manual_seed(0)
    T, H, V, K = 512, 1024, 32768, 17
    for cap in (None, 30.0):
        h = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda") * 0.05).to(torch.bfloat16)
        t = torch.randint(0, V, (T, K), device="cuda")
        inv_t = torch.rand(T, device="cuda") + 0.6
        g = torch.randn(T, K, device="cuda")
        lp = token_logprobs(h, w, t, softcap=cap, chunk=128, inv_temperature=inv_t)
        (lp * g).sum().backward()
        gh = h.grad.clone()
        h64 = h.detach().double().requires_grad_(True)
        z = h64 @ w.double().T
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        ref = torch.log_softmax(z * inv_t.double()[:, None], -1).gather(1, t)
        (ref * g.double()).sum().backward()
        report(f"tempered logprobs cap={cap}", rel(lp, ref), 1e-5)
        report(f"tempered logprobs grad cap={cap}", rel(gh, h64.grad), 1e-2)


def check_aligned_head() -> None:
    """The LM head of a vocabulary that is not a multiple of 64 (Olmo 3's 100,278), padded for
    cuBLAS (``logprobs.aligned_head``) against fp64 (values and gradients, frozen and trained
    head), and the time of a forward + backward padded and not."""
    from ember.core import logprobs
    from ember.core.logprobs import token_logprobs

    torch.manual_seed(0)
    V, K = 100278, 1
    for T, H, trained in ((512, 1024, False), (512, 1024, True)):
        h = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_(trained)
        t = torch.randint(0, V, (T, K), device="cuda")
        g = torch.randn(T, K, device="cuda")
        lp = token_logprobs(h, w, t, chunk=128)
        (lp * g).sum().backward()
        h64 = h.detach().double().requires_grad_(True)
        w64 = w.detach().double().requires_grad_(trained)
        ref = torch.log_softmax(h64 @ w64.T, -1).gather(1, t)
        (ref * g.double()).sum().backward()
        report(f"aligned head logprobs (trained={trained})", rel(lp, ref), 1e-5)
        report(f"aligned head grad hidden (trained={trained})", rel(h.grad, h64.grad), 1e-2)
        if trained:
            report("aligned head grad weight", rel(w.grad, w64.grad), 1e-2)
    T, H = 16384, 4096  # an Olmo 3 step's tokens and width
    h = (torch.randn(T, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    t = torch.randint(0, V, (T, 1), device="cuda")
    pads = logprobs._pads_head
    for name, rule in (("padded", pads), ("unpadded", lambda weight: False)):
        logprobs._pads_head = rule

        def step():
            token_logprobs(h, w, t).sum().backward()

        print(f"  LM head logprobs {T} tokens x {H} -> {V}, forward+backward, {name}: "
              f"{event_time_ms(step, 1, 5):.1f} ms")
    logprobs._pads_head = pads


def check_hyper_connections() -> None:
    """Qwen3.8-Flash-Next's hyper-connection read and write as fused kernels (the CUDA path)
    against the eager functions (outputs and the gradients of x and y, bf16), with the GPU time
    of each at a training step's shape (8 x 2048 tokens, 4 streams x 2560)."""
    import time

    from ember.core.layers.hyper_connections import GatedResidual, hc_read, hc_write

    torch.manual_seed(0)
    T, H, n, rank = 16384, 2560, 4, 320
    site = GatedResidual(H, n, rank, 1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in site.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
            p.requires_grad_(False)  # frozen, as in the model (spec §3.9): no weight gradients
    x0 = torch.randn(T, n * H, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(T, n * H, device="cuda", dtype=torch.bfloat16)
    weights = (site.hc_norm.weight, site.input_mix_weight_down.weight, site.input_mix_weight_up.weight,
               site.block_inject_weight.weight, n, site.hc_norm.eps)

    def step(fused):
        x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        read, gates = site.read(x) if fused else hc_read(x, *weights)
        out = GatedResidual.write(x, y * read, gates) if fused else hc_write(x, y * read, gates)
        out.backward(dout)
        return out.detach(), x.grad, y.grad

    res = {}
    for fused in (False, True):
        t0 = time.perf_counter()
        res[fused] = step(fused)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = event_time_ms(lambda f=fused: step(f), 2, 10)
        print(f"  hyper-connection read + write, forward+backward, {'kernels' if fused else 'eager'}: "
              f"{ms:.2f} ms (first call {first:.1f} s)")
        if "--profile" in sys.argv:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(fused)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    for i, name in enumerate(("out", "dx", "dy")):
        report(f"hyper-connection kernels vs eager {name}", rel(res[True][i], res[False][i]), 1e-2)


def check_paged_decode() -> None:
    """The paged decode attention kernel (flash-decoding, bf16): time per call inside a CUDA graph
    (as a decode step runs it) and the K+V bandwidth it reaches, vs the reference for correctness.
    Hq=32, Hkv=8, D=128, pages of 16, every sequence ``ctx`` tokens long, in shuffled pages. The
    KV heads a program takes are the shapes' choice (marked ``*``); ``--sweep`` times 1, 2 and 4
    as well."""
    from ember.core.kernels import paged_decode
    from ember.core.kernels.paged_decode import _decode_block_n, _decode_launch, paged_decode_triton
    from ember.core.sampling.attention import paged_decode_torch

    peak = 4.3e12  # H200 device-to-device copy (read + write), bytes/s; pure reads can pass it a little
    hq, hkv, d, page, scale = 32, 8, 128, 16, 128**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"paged decode: Hq={hq} Hkv={hkv} D={d} bf16 page={page}; K+V bytes read / time vs {peak / 1e12:.1f} TB/s")

    def case(b: int, lens: list[int], width: int):
        pages = sum(-(-n // page) for n in lens) + 1
        kp = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vp = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = (torch.randperm(pages - 1, device="cuda", generator=gen) + 1).int()  # page 0 is scratch
        table = torch.zeros(b, width, dtype=torch.int32, device="cuda")
        used = 0
        for i, n in enumerate(lens):
            table[i, : -(-n // page)] = perm[used : used + -(-n // page)]
            used += -(-n // page)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        return q, kp, vp, table, torch.tensor(lens, dtype=torch.int32, device="cuda")

    def check(name, q, kp, vp, table, lens, window=0, rows=8):
        got = paged_decode_triton(q, kp, vp, table, lens, scale, window)
        ref = paged_decode_torch(q[:rows], kp, vp, table[:rows], lens[:rows], scale, window)
        report(f"paged decode {name}", rel(got[:rows], ref), 2e-2)
        empty = lens[:rows] == 0
        if empty.any() and got[:rows][empty].abs().max().item() != 0:
            report(f"paged decode {name}: empty rows are zero", 1.0, 0.0)

    def timed(sets) -> float:
        """Seconds a call: 20 calls over the cache sets in turn, in one CUDA graph (``graph_us``)."""
        calls = [functools.partial(paged_decode_triton, *sets[i % len(sets)][:5], scale) for i in range(20)]
        return graph_us(calls, iters=10) * 1e-6

    # KV heads a program: the shapes' choice, and with --sweep each one forced
    choices = (None, 1, 2, 4) if "--sweep" in sys.argv else (None,)
    for b in (1, 64, 256):
        for ctx in (128, 512, 2048, 8192):
            for width in (-(-ctx // page), 32768 // page):  # a tight table; a decode step's static one
                nbytes = b * ctx * hkv * 2 * d * 2
                # several layers' caches in turn (>= 512 MB together), so small cases are not timed in L2
                sets = [case(b, [ctx] * b, width) for _ in range(min(20, -(-(512 << 20) // nbytes)))]
                q, kp, vp, table, lens = sets[0]
                check(f"B={b} ctx={ctx} W={width}", q, kp, vp, table, lens)
                for forced in choices:
                    paged_decode._DECODE_LAUNCH["heads"] = forced
                    if forced:
                        check(f"B={b} ctx={ctx} W={width} heads={forced}", q, kp, vp, table, lens)
                    heads, _, splits = _decode_launch(b, hkv, hq // hkv, _decode_block_n(d, d), width * page, q.device)
                    sec = timed(sets)
                    print(
                        f"  B={b:4d} ctx={ctx:5d} W={width:5d} heads={heads}{'' if forced else '*'} splits={splits:2d}: "
                        f"{sec * 1e6:8.1f} us  {nbytes / sec / 1e9:7.0f} GB/s ({100 * nbytes / sec / peak:4.1f}% of peak)",
                        flush=True,
                    )
                paged_decode._DECODE_LAUNCH["heads"] = None
                del sets, q, kp, vp, table, lens
    # ragged lengths (empty rows included) and a sliding window, against the reference
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 3000, (64,), generator=g).tolist()
    lens[:3] = [0, 1, 17]
    q, kp, vp, table, seq = case(64, lens, 4096 // page)
    check("ragged B=64", q, kp, vp, table, seq, rows=64)
    check("ragged B=64 window=1000", q, kp, vp, table, seq, window=1000, rows=64)
    check("ragged B=64 window=1000 one row", q[3:4], kp, vp, table[3:4], seq[3:4], window=1000, rows=1)


def _paged_cache(b: int, lens: torch.Tensor, hkv: int, d: int, page: int, gen: torch.Generator):
    """Random bf16 key and value pages for ``b`` rows of lengths ``lens`` on shuffled pages of
    ``page`` tokens (page 0 unused), a block table 4,096 tokens wide, the lengths (int32)."""
    npages = int((-(-lens // page)).sum()) + 1
    kp = torch.randn(npages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vp = torch.randn(npages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = (torch.randperm(npages - 1, device="cuda", generator=gen) + 1).int()
    table = torch.zeros(b, 4096 // page, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lens.tolist()):
        table[i, : -(-n // page)] = perm[used : used + -(-n // page)]
        used += -(-n // page)
    return kp, vp, table, lens.to(torch.int32).cuda()


def check_shared_prefix_decode() -> None:
    """Cascade decode attention (``prefix``: a group's shared prompt read once for the group, each
    row's own tokens apart, the partials merged) against the plain kernel and the fp32 reference,
    bf16, Hq=32 Hkv=8 D=128 (Qwen3-8B), pages of 16 in a 4,096-token table: GRPO-shaped groups
    (G rows with a P-token prompt, own tails of 1..256 tokens). Prints each kernel's time (CUDA
    graph) against the bytes it must read: the unique pages (cascade) and every row's (plain)."""
    from ember.core.kernels import paged_decode
    from ember.core.kernels.paged_decode import paged_decode_triton
    from ember.core.sampling.attention import paged_decode_torch, shared_prefix_groups

    hq, hkv, d, page, scale = 32, 8, 128, 16, 128**-0.5
    gen = torch.Generator(device="cuda").manual_seed(5)
    host = torch.Generator().manual_seed(5)
    token_bytes = hkv * 2 * d * 2
    for groups, size, plen in ((64, 8, 512), (64, 8, 2048), (4, 16, 2048), (32, 16, 512)):
        b = groups * size
        own = torch.randint(1, 257, (b,), generator=host)
        npages = groups * plen // page + int((-(-own // page)).sum()) + 1
        kp = torch.randn(npages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vp = torch.randn(npages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = (torch.randperm(npages - 1, generator=host) + 1).tolist()
        table = np.zeros((b, 4096 // page), dtype=np.int32)
        used = 0
        for g in range(groups):
            common = perm[used : used + plen // page]
            used += plen // page
            for r in range(g * size, (g + 1) * size):
                mine = perm[used : used + -(-int(own[r]) // page)]
                used += len(mine)
                table[r, : len(common) + len(mine)] = common + mine
        lens = (own + plen).to(torch.int32)
        pre, members = shared_prefix_groups(table, lens.numpy(), page)
        prefix = (torch.from_numpy(pre).cuda(), torch.from_numpy(members).cuda())
        bt, seq = torch.from_numpy(table).cuda(), lens.cuda()
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        rows = min(b, 64)
        ref = paged_decode_torch(q[:rows].float(), kp.float(), vp.float(), bt[:rows], seq[:rows], scale)
        plain = paged_decode_triton(q, kp, vp, bt, seq, scale)
        cascade = paged_decode_triton(q, kp, vp, bt, seq, scale, prefix=prefix)
        name = f"G={size} x {groups} groups, prompt {plen}"
        report(f"shared-prefix decode {name}: cascade vs reference", rel(cascade[:rows], ref), 2e-2)
        report(f"shared-prefix decode {name}: cascade vs plain kernel", rel(cascade, plain), 1e-2)
        t_plain = _graph_time_us(functools.partial(paged_decode_triton, q, kp, vp, bt, seq, scale))
        t_cascade = _graph_time_us(functools.partial(paged_decode_triton, q, kp, vp, bt, seq, scale, prefix=prefix))
        every = int(lens.sum()) * token_bytes
        unique = (groups * plen + int(own.sum())) * token_bytes
        print(f"  {name} ({b} rows): plain {t_plain:7.1f} us ({every / t_plain / 1e3:5.0f} GB/s of every row's "
              f"{every / 1e9:.2f} GB) | cascade {t_cascade:7.1f} us ({unique / t_cascade / 1e3:5.0f} GB/s of the "
              f"{unique / 1e9:.2f} GB of unique pages) | {t_plain / t_cascade:.2f}x", flush=True)
        if "--sweep" in sys.argv:  # the split kernel's KV heads a program, with and without the prefix kernel
            for heads in (1, 2, 4):
                paged_decode._DECODE_LAUNCH["heads"] = heads
                t_p = _graph_time_us(functools.partial(paged_decode_triton, q, kp, vp, bt, seq, scale))
                t_c = _graph_time_us(functools.partial(paged_decode_triton, q, kp, vp, bt, seq, scale, prefix=prefix))
                print(f"    split kernel heads={heads}: plain {t_p:7.1f} us | cascade {t_c:7.1f} us", flush=True)
            paged_decode._DECODE_LAUNCH["heads"] = None
        if "--sweep" in sys.argv and size == 8:  # the prefix kernel's launch choices
            default = dict(paged_decode._PREFIX_LAUNCH)
            for rows, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3)):
                paged_decode._PREFIX_LAUNCH.update(rows=rows, num_warps=warps, num_stages=stages)
                try:
                    t = _graph_time_us(functools.partial(paged_decode_triton, q, kp, vp, bt, seq, scale, prefix=prefix))
                    print(f"    prefix kernel rows={rows:2d} warps={warps} stages={stages}: cascade {t:7.1f} us", flush=True)
                except Exception as e:  # noqa: BLE001 - a choice that does not compile (shared memory) is reported
                    print(f"    prefix kernel rows={rows:2d} warps={warps} stages={stages}: {type(e).__name__}")
            paged_decode._PREFIX_LAUNCH.update(default)

def check_relative_decode() -> None:
    """Inkling-2's decode attention through the paged kernel (relative bias by distance and sinks:
    ``HAS_BIAS`` / ``HAS_SINK``), bf16, against the gathered PyTorch path of the same contract in
    fp32, on a global layer (extent 512) and a sliding one (window 512); ragged lengths over
    shuffled pages of 16, an empty row, several splits (64 rows x 8 KV heads)."""
    from ember.core.kernels.paged_decode import paged_decode_triton
    from ember.core.layers.relative_attention import RelativeAttentionSpec
    from ember.core.sampling.attention import gather_pages, relative_decode

    hq, hkv, d, page, b, scale = 48, 8, 128, 16, 64, 128**-0.5
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = torch.randint(1, 3000, (b,), generator=torch.Generator().manual_seed(2))
    lens[:3] = torch.tensor([0, 1, 600])
    kp, vp, table, seq = _paged_cache(b, lens, hkv, d, page, gen)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    profiles = torch.randn(b, hq, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    sinks = torch.randn(b, hq, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    keys, k_pos = gather_pages(kp, table)
    values, _ = gather_pages(vp, table)
    live = seq > 0
    for window in (None, 512):
        spec = RelativeAttentionSpec(window=window, rel_extent=512)
        got = paged_decode_triton(q, kp, vp, table, seq, scale, window or 0, profiles=profiles, sinks=sinks)
        ref = relative_decode(q.float(), keys.float(), values.float(), k_pos, profiles.float(), sinks.float(),
                              seq.long() - 1, spec, scale)
        report(f"paged decode relative bias + sinks, window={window}", rel(got[live], ref[live]), 2e-2)
        if got[~live].abs().max().item() != 0:
            report("paged decode relative: the empty row is zero", 1.0, 0.0)


def check_selected_decode() -> None:
    """Qwen3.8-Flash-Next's decode attention under a QSA block selection through the paged kernel
    (``HAS_SELECT``: only the chosen blocks and the tail read), bf16, against the gathered fp32 PyTorch path
    (``masked_decode`` over ``BlockSelection.token_mask``); ragged lengths over shuffled pages of 16,
    an empty row, 128-token blocks, 8 of them chosen (64 rows x 2 KV heads, several splits)."""
    from ember.core.kernels.paged_decode import paged_decode_triton
    from ember.core.layers.qsa import BlockSelection
    from ember.core.sampling.attention import gather_pages, masked_decode

    hq, hkv, d, page, b, r, k, scale = 16, 2, 256, 16, 64, 128, 8, 256**-0.5
    gen = torch.Generator(device="cuda").manual_seed(4)
    lens = torch.randint(1, 4000, (b,), generator=torch.Generator().manual_seed(5))
    lens[:3] = torch.tensor([0, 1, 1500])
    kp, vp, table, seq = _paged_cache(b, lens, hkv, d, page, gen)
    blocks = torch.full((b, k), -1, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        visible = n // r
        pick = torch.randperm(visible)[:k] if visible > k else torch.arange(visible)
        blocks[i, : len(pick)] = pick
    blocks = blocks.cuda()
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    got = paged_decode_triton(q, kp, vp, table, seq, scale, selected=blocks, select_block=r)
    keys, _ = gather_pages(kp, table)
    values, _ = gather_pages(vp, table)
    valid = BlockSelection(blocks, r, seq.long() - 1).token_mask(slice(None), keys.shape[1])
    ref = masked_decode(q.float(), keys.float(), values.float(), valid, scale)
    live = seq > 0
    report("paged decode QSA block selection", rel(got[live], ref[live]), 2e-2)
    if got[~live].abs().max().item() != 0:
        report("paged decode selection: the empty row is zero", 1.0, 0.0)


HBM_TBPS = copy_bandwidth() / 1e12  # measured copy bandwidth of this GPU; floor = bytes / this


def _graph_time_us(fn, inner: int = 20, reps: int = 50) -> float:
    """GPU time of one ``fn()`` (microseconds): ``inner`` calls captured in a CUDA graph, replayed
    ``reps`` times between CUDA events (so host launch overhead is not measured, as in decode)."""
    return graph_us([fn] * inner, reps)


def check_lora_decode() -> None:
    """Decode LoRA delta: the split-K Triton kernels (``lora_delta_add``, fused add) vs the two
    ``torch._grouped_mm`` calls + add of the grouped path, bf16, Qwen3-8B-like shapes."""
    from ember.core.kernels import lora_decode

    if not lora_decode.triton_ok(torch.zeros(1, device="cuda")):
        print("lora decode kernels: Triton unavailable, skipped")
        return
    K, R = 4096, 32
    print(f"lora decode delta (in={K}, r={R}, bf16): GPU us per call; floor = bytes read / {HBM_TBPS} TB/s")
    print(f"  {'G':>3} {'busy':>4} {'N':>4} {'out':>6} | {'triton':>8} {'grouped':>8} {'floor':>7} | speedup")
    torch.manual_seed(0)
    worst = 0.0
    for G, busy in ((2, 1), (33, 1), (33, 8)):
        for N in (8, 64, 256):
            for n_out in (4096, 1024, 12288):
                A = (torch.randn(G, R, K, device="cuda") * K**-0.5).to(torch.bfloat16)
                B = (torch.randn(G, n_out, R, device="cuda") * R**-0.5).to(torch.bfloat16)
                A[0] = 0  # slot 0: no adapter (as LoraStacks builds it)
                B[0] = 0
                # N rows spread over slots 1..busy (sorted by slot); the other slots are empty
                counts = torch.zeros(G, dtype=torch.long)
                counts[1 : busy + 1] = N // busy
                counts[busy] += N - int(counts.sum())
                offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
                x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
                # correctness: the delta alone (y = 0), against fp64 and against the grouped path
                exact = torch.zeros(N, n_out, dtype=torch.float64, device="cuda")
                start = 0
                for g, end in enumerate(offs.tolist()):
                    if end > start:
                        exact[start:end] = x[start:end].double() @ A[g].double().T @ B[g].double().T
                    start = end
                got = lora_decode.lora_delta_add(torch.zeros(N, n_out, device="cuda", dtype=torch.bfloat16),
                                                 x, A, B, offs, skip_first=True)
                grouped = lora_decode.lora_delta_torch(x, A, B, offs)
                if not lora_decode._STATE["ok"]:
                    report("lora decode kernels ran", 1.0, 0.0)
                    return
                worst = max(worst, rel(got, exact))
                report(f"lora delta G={G} busy={busy} N={N} out={n_out} vs grouped", rel(got, grouped), 1e-2)
                # timing: y += delta in place vs y + two grouped products
                y = torch.randn(N, n_out, device="cuda", dtype=torch.bfloat16)
                args = (x, A, B, offs)
                t_tri = _graph_time_us(lambda y=y, a=args: lora_decode.lora_delta_add(y, *a, skip_first=True))
                t_ref = _graph_time_us(lambda y=y, a=args: y + lora_decode.lora_delta_torch(*a))
                nbytes = 2 * (N * K + busy * R * K + busy * n_out * R + 2 * N * n_out)
                floor = nbytes / (HBM_TBPS * 1e12) * 1e6
                print(f"  {G:>3} {busy:>4} {N:>4} {n_out:>6} | {t_tri:8.1f} {t_ref:8.1f} {floor:7.1f} | {t_ref / t_tri:5.2f}x")
    print(f"lora delta triton vs fp64: worst rel err {worst:.2e}")
    report("lora delta triton vs fp64", worst, 1e-2)


def check_add_norm() -> None:
    """The residual add and the RMSNorm in one kernel (``norms.add_rms_norm``, the sampler's
    pre-norm layers): the add's and the norm kernel's values bit for bit (bf16, Qwen3-8B's width),
    and the GPU time of one launch against the two, at a decode step's 64 rows and a 4,096-token
    prefill, in a CUDA graph."""
    from ember.core.kernels import fused
    from ember.core.layers import norms

    torch.manual_seed(0)
    for rows in (64, 4096):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(4096, device="cuda") * 0.1 + 1).to(torch.bfloat16)
        with torch.no_grad():
            s, y = norms.add_rms_norm(x, r, w, 1e-6)
            ref_s = x + r
            ref_y = fused.RMSNormFn.apply(ref_s, w, 1e-6, False)
            report(f"add_rms_norm {rows} rows: sum and norm equal to the two kernels",
                   float(not (torch.equal(s, ref_s) and torch.equal(y, ref_y))), 0.0)
            one = _graph_time_us(lambda x=x, r=r, w=w: norms.add_rms_norm(x, r, w, 1e-6))
            two = _graph_time_us(lambda x=x, r=r, w=w: fused.RMSNormFn.apply(x + r, w, 1e-6, False))
        print(f"  add + rmsnorm, {rows} rows: one kernel {one:.1f} us, add then norm {two:.1f} us")


def check_grouped_lora() -> None:
    """The grouped LoRA expand added in place (``kernels.grouped_lora``) against the grouped product
    and the add it replaces (bf16, rank 32), at Qwen3-Next's (512 experts, 163,840 rows) and
    Qwen3-30B-A3B's (128 experts, 131,072 rows) training shapes: the forward's corrections (gate_up,
    down) and the backward's input gradients (a shrink factor read transposed). Values within bf16
    rounding of the fp32 sum; GPU time of each, and of the kernel's tile shapes, in a CUDA graph."""
    from ember.core.kernels import grouped_lora

    torch.manual_seed(0)
    for label, N, E, shapes in (("qwen3-next", 163840, 512, (1024, 2048, 512)),
                                ("qwen3-30b-a3b", 131072, 128, (1536, 2048, 768))):
        sizes = torch.distributions.Multinomial(N, torch.ones(E)).sample().long()
        offs = offsets_from_sizes(sizes, torch.device("cuda"))
        h = (torch.randn(N, 32, device="cuda") * 0.1).to(torch.bfloat16)
        for n_out, transposed in zip(shapes, (False, False, True)):
            y = torch.randn(N, n_out, device="cuda", dtype=torch.bfloat16)
            if transposed:  # the backward: gh @ A, A [E, r, out] read as [E, out, r]
                B = (torch.randn(E, 32, n_out, device="cuda") * 0.1).to(torch.bfloat16).transpose(1, 2)
            else:
                B = (torch.randn(E, n_out, 32, device="cuda") * 0.1).to(torch.bfloat16)
            ref = y.float() + grouped_linear(h, B, offs).float()
            got = grouped_lora.expand_add(y.clone(), h, B, offs)
            report(f"grouped_lora {label} [{N}, {n_out}]{' (transposed)' if transposed else ''}: against fp32",
                   rel(got, ref), 4e-3)
            two = _graph_time_us(lambda y=y, h=h, B=B, o=offs: y + grouped_linear(h, B, o), inner=5, reps=20)
            times = {}
            for cfg in ((64, 128, 4), (64, 256, 8), (128, 128, 8), (32, 256, 4), (64, 64, 4), (64, 128, 8),
                        (32, 128, 4), (128, 64, 4), (32, 64, 2)):
                times[cfg] = _graph_time_us(
                    lambda y=y, h=h, B=B, o=offs, cfg=cfg: grouped_lora.expand_add(y, h, B, o, cfg), inner=5, reps=20)
            best = min(times, key=times.get)
            gb = 2 * y.numel() * y.element_size() / 1e9
            print(f"  [{N}, {n_out}]: grouped_mm + add {two:.0f} us; in place {times[grouped_lora.CONFIG]:.0f} us "
                  f"(default), best {best} {times[best]:.0f} us = {gb / times[best] * 1e6:.0f} GB/s; "
                  + ", ".join(f"{c}: {t:.0f}" for c, t in times.items()))


def check_gathered_wgrad() -> None:
    """The LoRA shrink factor's gradient over gathered rows (``kernels.gathered_wgrad``) against
    what it replaces, the gather ``x[rows]`` and ``torch._grouped_mm`` (bf16, rank 32), at
    Qwen3-Next's (512 experts, 16,384 tokens, top-10, hidden 2048) and Qwen3-30B-A3B's (128
    experts, top-8) training shapes, rows sorted by expert as an MoE layer sorts them: values against
    the fp32 sum; GPU time of each, and of the kernel's tile shapes, in a CUDA graph."""
    from ember.core.kernels import gathered_wgrad

    torch.manual_seed(0)
    for label, T, k, E, H in (("qwen3-next", 16384, 10, 512, 2048), ("qwen3-30b-a3b", 16384, 8, 128, 2048)):
        experts = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).reshape(-1)
        order = torch.argsort(experts, stable=True)
        rows = torch.arange(T, device="cuda").repeat_interleave(k)[order]
        offs = torch.searchsorted(experts[order], torch.arange(1, E + 1, device="cuda")).to(torch.int32)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        gh = (torch.randn(T * k, 32, device="cuda") * 0.1).to(torch.bfloat16)
        ref = grouped_wgrad(gh.float(), x[rows].float(), offs)  # fp32: its loop of matmuls, one expert at a time
        got = gathered_wgrad.wgrad_gathered(gh, x, rows, offs)
        report(f"gathered_wgrad {label} [{T * k}, {H}] rank 32: against fp32", rel(got, ref), 4e-3)
        report(f"gathered_wgrad {label}: the same as gather + grouped_mm",
               rel(got, grouped_wgrad(gh, x[rows], offs)), 4e-3)
        two = _graph_time_us(lambda gh=gh, x=x, r=rows, o=offs: grouped_wgrad(gh, x[r], o), inner=5, reps=20)
        times = {}
        for cfg in ((64, 128, 4), (32, 128, 4), (64, 256, 8), (64, 64, 4), (128, 128, 8)):
            times[cfg] = _graph_time_us(
                lambda gh=gh, x=x, r=rows, o=offs, cfg=cfg: gathered_wgrad.wgrad_gathered(gh, x, r, o, config=cfg),
                inner=5, reps=20)
        best = min(times, key=times.get)
        gb = (rows.numel() * H * 2 + gh.numel() * 2 + E * 32 * H * 2) / 1e9
        print(f"  {label}: gather + grouped_mm {two:.0f} us; kernel {times[gathered_wgrad.CONFIG]:.0f} us (default), "
              f"best {best} {times[best]:.0f} us = {gb / times[best] * 1e6:.0f} GB/s of its bytes; "
              + ", ".join(f"{c}: {t:.0f}" for c, t in times.items()))


def check_router_topk() -> None:
    """The router's top-k kernel (``kernels.router_topk``) against ``torch.topk`` on softmax
    probabilities of bf16 logits (equal scores are common there): the same values in the same
    order, the same experts on every row whose k-th and (k+1)-th scores differ, and the lowest
    experts among scores equal to the k-th (``torch.topk``'s choice on CUDA) elsewhere; and the GPU
    time of each at Qwen3-Next's (512 experts, k 10) and Qwen3-30B-A3B's (128, k 8) training
    shapes, in a CUDA graph."""
    from ember.core.kernels import router_topk

    torch.manual_seed(0)
    for T, E, k in ((16384, 512, 10), (16384, 128, 8), (64, 512, 10)):
        logits = torch.randn(T, E, device="cuda").to(torch.bfloat16)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        idx = router_topk.topk_indices(probs, k)
        ref_v, ref_i = torch.topk(probs, k + 1, dim=-1)
        same_values = torch.equal(probs.gather(1, idx), ref_v[:, :k])
        clear = ref_v[:, k - 1] > ref_v[:, k]
        same_set = torch.equal(idx[clear].sort(-1).values, ref_i[clear, :k].sort(-1).values)
        torch_set = torch.topk(probs, k, dim=-1).indices.sort(-1).values
        same_ties = torch.equal(idx[~clear].sort(-1).values, torch_set[~clear])
        report(f"router top-k [{T}, {E}], k {k}: values, experts ({int((~clear).sum())} rows tie at the k-th)",
               float(not (same_values and same_set and same_ties)), 0.0)
        ours = _graph_time_us(lambda p=probs, k=k: router_topk.topk_indices(p, k))
        theirs = _graph_time_us(lambda p=probs, k=k: torch.topk(p, k, dim=-1))
        print(f"  [{T}, {E}], k {k}: kernel {ours:.1f} us, torch.topk {theirs:.1f} us")


def check_l2norm_heads() -> None:
    """The GDN key heads' norm and repetition for fla (``kernels.l2norm_heads``) at Qwen3-Next's
    training shape (16,384 tokens, 16 key heads of 128 read from the ``[q | k | v]`` columns, two
    value heads each): values and input gradients against the fp64 formula, and the GPU time of
    forward + backward against what it replaces (``repeat_interleave``, then fla's own norm and
    its backward, then autograd's sum of the copies' gradients)."""
    from fla.modules.l2norm import l2norm as fla_l2norm

    from ember.core.kernels.l2norm_heads import CONFIG, l2norm_repeat

    torch.manual_seed(0)
    T, H, D, r = 16384, 16, 128, 2
    qkv = torch.randn(T, H, 4 * D, device="cuda", dtype=torch.bfloat16)
    x = qkv[..., :D].requires_grad_()
    dy = torch.randn(T, H * r, D, device="cuda", dtype=torch.bfloat16)
    y = l2norm_repeat(x, r)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    ref = (x64 * torch.rsqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(r, 1)
    (ref_dx,) = torch.autograd.grad(ref, x64, dy.double())
    report("l2norm_heads [16384, 16 -> 32, 128] out vs fp64", rel(y.detach(), ref.detach()), 4e-3)
    report("l2norm_heads input gradient vs fp64", rel(dx, ref_dx), 8e-3)
    old = fla_l2norm(x.repeat_interleave(r, 1))
    (old_dx,) = torch.autograd.grad(old, x, dy)
    report("l2norm_heads vs fla's path: out", rel(y.detach(), old.detach()), 4e-3)
    report("l2norm_heads vs fla's path: input gradient", rel(dx, old_dx), 8e-3)

    def ours(cfg=None):
        torch.autograd.grad(l2norm_repeat(x, r, config=cfg), x, dy)

    def theirs():
        torch.autograd.grad(fla_l2norm(x.repeat_interleave(r, 1)), x, dy)

    configs = {cfg: event_time_ms(lambda cfg=cfg: ours(cfg), 3, 50) * 1e3
               for cfg in ((4096, 4), (2048, 4), (8192, 8), (4096, 8), (2048, 2), (1024, 4))}
    best = min(configs, key=configs.get)
    t_theirs = event_time_ms(theirs, 3, 50) * 1e3
    # bf16 bytes: read x, write r copies; read r gradients and one copy, write dx
    floor_us = T * H * D * ((1 + r) + (r + 2)) * 2 / copy_bandwidth() * 1e6
    print(f"  forward + backward, one of q or k: kernel {configs[CONFIG]:.0f} us (default {CONFIG}), best {best} "
          f"{configs[best]:.0f} us; repeat + fla's norm {t_theirs:.0f} us (the kernel's bytes at the copy "
          f"bandwidth: {floor_us:.0f} us); " + ", ".join(f"{c}: {t:.0f}" for c, t in configs.items()))


def check_causal_conv() -> None:
    """The GDN short convolution's kernels (``kernels.causal_conv``: SiLU fused, the backward
    recomputing the pre-activation) against the fp64 convolution and against fla-core's
    ``causal_conv1d`` (the path they replaced), at Qwen3-Next's training shape (8 × 2048 tokens,
    8,192 channels, kernel 4): values, the input gradient (the weight frozen, as under LoRA), the
    weight's gradient (full fine-tuning), and the GPU time of forward + backward, with the tile
    shapes swept."""
    import torch.nn.functional as F
    from fla.modules.conv import causal_conv1d

    from ember.core.kernels.causal_conv import CONFIG, positions, silu_causal_conv
    from ember.core.layers.packed_conv import causal_conv

    torch.manual_seed(0)
    lens, C, K = [2048] * 8, 8192, 4
    T = sum(lens)
    pos = positions(lens).cuda()
    cu = torch.tensor([0, *lens]).cumsum(0)
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(C, K, device="cuda") * 0.5).to(torch.bfloat16)
    dy = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    y = silu_causal_conv(x, w, pos)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64, w64 = x.detach().double().requires_grad_(), w.double().requires_grad_()
    ref = F.silu(causal_conv(x64, w64, lens)[0])
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), dy.double())
    report("causal_conv [16384, 8192] out vs fp64", rel(y.detach(), ref.detach()), 4e-3)
    report("causal_conv input gradient vs fp64", rel(dx, ref_dx), 8e-3)
    wt = w.clone().requires_grad_()
    dx_ft, dw = torch.autograd.grad(silu_causal_conv(x, wt, pos), (x, wt), dy)
    report("causal_conv weight gradient vs fp64", rel(dw, ref_dw), 8e-3)
    report("causal_conv input gradient with the weight trained = frozen", rel(dx_ft, dx.double()), 0.0)

    def fla():
        return causal_conv1d(x[None], w, activation="silu", cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)[0][0]

    report("causal_conv vs fla's: out", rel(y.detach(), fla().detach()), 4e-3)
    configs = {cfg: event_time_ms(lambda cfg=cfg: torch.autograd.grad(silu_causal_conv(x, w, pos, cfg), x, dy),
                                  3, 20) * 1e3
               for cfg in ((32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 64, 4), (64, 64, 4), (128, 64, 8))}
    best = min(configs, key=configs.get)
    t_fla = event_time_ms(lambda: torch.autograd.grad(fla(), x, dy), 3, 20) * 1e3
    t_fwd = event_time_ms(lambda: silu_causal_conv(x.detach(), w, pos), 3, 20) * 1e3
    floor_us = T * C * 2 * 5 / copy_bandwidth() * 1e6  # read x; write y; read x and dy, write dx
    print(f"  forward + backward: kernel {configs[CONFIG]:.0f} us (default {CONFIG}; forward {t_fwd:.0f} us), "
          f"best {best} {configs[best]:.0f} us; fla's causal_conv1d {t_fla:.0f} us (the bytes at the copy "
          f"bandwidth: {floor_us:.0f} us); " + ", ".join(f"{c}: {t:.0f}" for c, t in configs.items()))


def check_copies() -> None:
    """Strided bf16 activations made contiguous as 8-byte words (``layers.copies``) against
    ``x.contiguous()``, at the Gated DeltaNet projection's cuts of Qwen3-Next's ``[16384, 16, 768]``
    per-key-head columns: equal bit for bit, and the GPU time and bandwidth of each."""
    from ember.core.layers import copies

    torch.manual_seed(0)
    qkvz = torch.randn(16384, 16, 768, device="cuda", dtype=torch.bfloat16)
    for name, x in (("qkv [16384, 16, 512] of 768", qkvz[..., :512]), ("z [16384, 16, 256] of 768", qkvz[..., 512:]),
                    ("v [16384, 16, 256] of 512", qkvz[..., :512].contiguous()[..., 256:])):
        report(f"copies {name}: words vs contiguous", float(not torch.equal(copies.contiguous(x), x.contiguous())), 0.0)
        gb = 2 * x.numel() * x.element_size() / 1e9
        plain = event_time_ms(lambda x=x: x.contiguous(), 3, 50)
        words = event_time_ms(lambda x=x: copies.contiguous(x), 3, 50)
        print(f"  {name}: contiguous() {plain * 1e3:.0f} us ({gb / plain * 1e3:.0f} GB/s), as words "
              f"{words * 1e3:.0f} us ({gb / words * 1e3:.0f} GB/s)")


def check_kv_write() -> None:
    """The one-launch paged-cache write (``kernels.kv_write``) against the two ``index_copy_`` it
    replaces: equal bit for bit (bf16, strided value heads of a packed q/k/v product), and the GPU
    time of each at a Qwen3-8B decode step's shape (64 rows, 8 × 128 heads) in a CUDA graph."""
    from ember.core.kernels.kv_write import kv_write

    pages, page_size, H, D = 4096, 16, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in (64, 4096):
        kc = torch.randn(pages, page_size, H, D, device="cuda", generator=gen).bfloat16()
        vc = torch.randn_like(kc)
        qkv = torch.randn(T, (32 + 2 * H) * D, device="cuda", generator=gen).bfloat16()
        k = qkv[:, 32 * D : (32 + H) * D].view(T, H, D)
        v = qkv[:, (32 + H) * D :].view(T, H, D)
        slots = torch.randperm(pages * page_size, device="cuda", generator=gen)[:T]
        want_k, want_v = kc.clone(), vc.clone()
        want_k.view(-1, H, D).index_copy_(0, slots, k)
        want_v.view(-1, H, D).index_copy_(0, slots, v)
        kv_write(kc, vc, k, v, slots)
        same = torch.equal(kc, want_k) and torch.equal(vc, want_v)
        report(f"kv_write {T} rows equals index_copy_", 0.0 if same else 1.0, 0.0)

        def copies(kc=kc, vc=vc, k=k, v=v, slots=slots):
            kc.view(-1, H, D).index_copy_(0, slots, k)
            vc.view(-1, H, D).index_copy_(0, slots, v)

        t_kernel = _graph_time_us(lambda kc=kc, vc=vc, k=k, v=v, slots=slots: kv_write(kc, vc, k, v, slots))
        t_copies = _graph_time_us(copies)
        print(f"  {T} rows: kv_write {t_kernel:.1f} us, two index_copy_ {t_copies:.1f} us")


def check_swiglu_lora() -> None:
    """The static decoder's one-launch SwiGLU LoRA kernel (``kernels.swiglu_decode``: gate/up
    expand, ``silu(g) * u``, down shrink) against the three kernels it replaces, bf16, Qwen3-8B's
    MLP (intermediate 12,288, rank 32): agreement, and the GPU time of each over 36 layers' stacks
    in a CUDA graph, at 64 rows of one adapter and 256 rows of eight."""
    from ember.core.kernels import lora_decode as ld
    from ember.core.kernels.swiglu_decode import swiglu_config, swiglu_lora
    from ember.core.layers.activations import silu_mul

    I, R, layers = 12288, 32, 36
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, busy in ((64, 1), (256, 8)):
        G = busy + 1
        counts = torch.zeros(G, dtype=torch.long)
        counts[1:] = N // busy
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        n_rows = torch.tensor([N], dtype=torch.int32, device="cuda")
        active = ld.active_groups(offs, n_rows, skip_first=True)
        stacks = []
        for _ in range(layers):
            B = torch.zeros(G, 2 * I, 2 * R, device="cuda", dtype=torch.bfloat16)
            B[:, :I, :R] = (torch.randn(G, I, R, device="cuda", generator=gen) * R**-0.5).bfloat16()
            B[:, I:, R:] = (torch.randn(G, I, R, device="cuda", generator=gen) * R**-0.5).bfloat16()
            A_d = (torch.randn(G, R, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
            B[0], A_d[0] = 0, 0
            gu = torch.randn(N, 2 * I, device="cuda", generator=gen).bfloat16()
            h_gu = torch.randn(N, 2 * R, device="cuda", generator=gen)
            stacks.append((gu, h_gu, B, A_d, torch.zeros(N, R, device="cuda")))

        def three(gu, h_gu, B, A_d, h_d, offs=offs, n_rows=n_rows, active=active):
            y = gu.clone()
            ld.lora_expand_add(y, h_gu, B, offs, n_rows, True, active=active)
            act = silu_mul(y[:, :I], y[:, I:])
            ld.lora_shrink(act, A_d, offs, n_rows, True, out=h_d.zero_(), active=active)
            return act

        def one(gu, h_gu, B, A_d, h_d, offs=offs, n_rows=n_rows, active=active):
            return swiglu_lora(gu, offs, active, n_rows, (h_gu, B), (A_d, h_d.zero_()))

        gu, h_gu, B, A_d, h_d = stacks[0]
        want_act = three(gu, h_gu, B, A_d, h_d)
        want_h = h_d.clone()
        act = one(gu, h_gu, B, A_d, h_d)
        report(f"swiglu_lora {N} rows, act vs the three kernels", rel(act, want_act), 1e-2)
        report(f"swiglu_lora {N} rows, h_down vs the three kernels", rel(h_d, want_h), 1e-3)
        t_three = graph_us([lambda a=a: three(*a) for a in stacks], iters=10) * layers
        t_one = graph_us([lambda a=a: one(*a) for a in stacks], iters=10) * layers
        print(f"  {N} rows over {busy} adapter(s), 36 layers: one kernel {t_one:.0f} us per step, "
              f"the three kernels (with h zeroing) {t_three:.0f} us")
        # the launch shapes (rows a block, intermediate columns a program), against the default
        default = swiglu_config(N)
        for cfg in itertools.product((16, 32, 64), (64, 128, 256, 512)):
            def one_cfg(gu, h_gu, B, A_d, h_d, cfg=cfg, offs=offs, n_rows=n_rows, active=active):
                return swiglu_lora(gu, offs, active, n_rows, (h_gu, B), (A_d, h_d.zero_()), config=cfg)
            try:
                act = one_cfg(gu, h_gu, B, A_d, h_d)
                t = graph_us([lambda a=a: one_cfg(*a) for a in stacks], iters=10) * layers
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is a result too
                print(f"    BLOCK_M {cfg[0]:3d}, BLOCK_K {cfg[1]:3d}: failed, {type(e).__name__}: {e}")
                continue
            report(f"swiglu_lora {N} rows {cfg}, act vs the three kernels", rel(act, want_act), 1e-2)
            report(f"swiglu_lora {N} rows {cfg}, h_down vs the three kernels", rel(h_d, want_h), 1e-3)
            mark = "  (default)" if cfg == default else ""
            print(f"    BLOCK_M {cfg[0]:3d}, BLOCK_K {cfg[1]:3d}: {t:6.0f} us per step{mark}")


def check_sampling() -> None:
    """The Triton sampling kernel vs the fp64 PyTorch draw on [256, 151936] logits (temperatures
    0, 0.6, 1, 1.5; one uniform number per row): tokens must agree (up to a draw at a CDF boundary,
    about never), logprobs within fp32 rounding; its GPU time against the bytes it reads."""
    from ember.core.kernels import sampling as ks
    from ember.core.sampling import logits as L

    torch.manual_seed(0)
    B, V = 256, 151936
    z = torch.randn(B, V, device="cuda") * 4
    inv_t = torch.tensor([0.0, 1 / 0.6, 1.0, 1 / 1.5] * (B // 4), dtype=torch.float64, device="cuda")
    u = torch.rand(B, dtype=torch.float64, device="cuda").clamp(1e-6, 1 - 1e-6)
    tok, lp = ks.sample_rows(z, inv_t, u)
    ks_available, ks.available = ks.available, lambda z: False
    try:
        ref_tok, ref_lp = L.sample_rows(z, inv_t, u)
    finally:
        ks.available = ks_available
    mismatch = int((tok != ref_tok).sum())
    print(f"sampling kernel: {mismatch} of {B} tokens differ from the fp64 draw")
    report("sampling kernel tokens", mismatch / B, 1 / B)
    report("sampling kernel logprobs", float((lp - ref_lp).abs().max()), 1e-4)
    for rows in (64, 256):
        t = _graph_time_us(lambda r=rows: ks.sample_rows(z[:r], inv_t[:r], u[:r]))
        floor = 3 * rows * V * 4 / (HBM_TBPS * 1e12) * 1e6
        print(f"  sample_rows {rows} x {V}: {t:.1f} us (3 reads of the logits at {HBM_TBPS} TB/s: {floor:.1f} us)")


def check_gdn() -> None:
    """fla's gated delta rule (bf16) vs Ember's PyTorch rule on the same bf16 inputs in fp32."""
    from ember.core.layers import gated_deltanet as gd
    from ember.core.models.base import ForwardContext
    from ember.core.sampling.kv_cache import RecurrentStateStore

    if gd._fla_ops() is None:
        report("gdn: fla-core is not installed", float("inf"), 0)
        return
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    Hk, Hv, dk, dv = 16, 32, 128, 128  # Qwen3-Next's linear-attention heads
    r = Hv // Hk
    lens = [1000, 2500, 64, 37, 700]
    T, N = sum(lens), len(lens)

    def inputs():
        q = torch.randn(T, Hk, dk, device=dev, dtype=bf)
        k = torch.randn(T, Hk, dk, device=dev, dtype=bf)
        v = torch.randn(T, Hv, dv, device=dev, dtype=bf)
        g = -torch.rand(T, Hv, device=dev).mul(0.3) - 0.01  # log decays in fp32
        beta = torch.rand(T, Hv, device=dev, dtype=bf)
        return [t.requires_grad_() for t in (q, k, v, g, beta)]

    def torch_rule(q, k, v, g, beta, h0, dtype=torch.float32):
        qf = gd.l2norm(q.to(dtype).repeat_interleave(r, 1)) * dk**-0.5
        kf = gd.l2norm(k.to(dtype).repeat_interleave(r, 1))
        return gd.chunk_gated_delta_rule(qf, kf, v.to(dtype), g.to(dtype), beta.to(dtype), lens, h0)

    q, k, v, g, beta = inputs()
    h0 = torch.randn(N, Hv, dk, dv, device=dev) * 0.1
    do = torch.randn(T, Hv, dv, device=dev)
    dh = torch.randn(N, Hv, dk, dv, device=dev)
    res = {}
    for name in ("fla", "torch", "torch64"):
        for t in (q, k, v, g, beta):
            t.grad = None
        if name == "fla":
            o, h = gd.fla_gated_delta_rule(q, k, v, g, beta, lens, h0, True)  # q, k at the key heads
        else:
            dt = torch.float64 if name == "torch64" else torch.float32
            o, h = torch_rule(q, k, v, g, beta, h0.to(dt), dt)
        ((o.double() * do.double()).sum() + (h.double() * dh.double()).sum()).backward()
        res[name] = [o.detach(), h.detach()] + [t.grad.clone() for t in (q, k, v, g, beta)]
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta"]
    for i, n in enumerate(names):
        report(f"gdn torch fp32 vs fp64 {n}", rel(res["torch"][i], res["torch64"][i]), 1e-4)
        report(f"gdn fla bf16 vs torch {n}", rel(res["fla"][i], res["torch64"][i]), 2.5e-2)

    # one decode step per sequence from those states: fla's recurrent kernel vs the torch form
    q1, k1 = torch.randn(N, Hk, dk, device=dev, dtype=bf), torch.randn(N, Hk, dk, device=dev, dtype=bf)
    v1, beta1 = torch.randn(N, Hv, dv, device=dev, dtype=bf), torch.rand(N, Hv, device=dev, dtype=bf)
    g1 = -torch.rand(N, Hv, device=dev) * 0.3
    o_f, h_f = gd.fla_gated_delta_rule(q1, k1, v1, g1, beta1, [1] * N, h0, True)
    qf = gd.l2norm(q1.float().repeat_interleave(r, 1)) * dk**-0.5
    kf = gd.l2norm(k1.float().repeat_interleave(r, 1))
    o_t, h_t = gd.recurrent_gated_delta_rule(qf, kf, v1.float(), g1, beta1.float(), h0)
    report("gdn fla recurrent vs torch out", rel(o_f, o_t), 1e-2)
    report("gdn fla recurrent vs torch state", rel(h_f, h_t), 1e-2)

    # the layer (LoRA-free), prefill then two decode steps, through ctx.state: fla vs torch
    shape = gd.GDNShape(Hk, Hv, dk, dv, 4, 1e-6, "silu")
    layer = gd.GatedDeltaNet(1024, shape, 0, fused_projections=True).to(dev, bf)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
    x = torch.randn(T, 1024, device=dev, dtype=bf)
    steps = [torch.randn(N, 1024, device=dev, dtype=bf) for _ in range(2)]
    outs = {}
    for backend in ("fla", "torch"):
        layer.backend = backend
        store = RecurrentStateStore()
        seqs = list(range(N))
        pos = torch.zeros(T, dtype=torch.long, device=dev)
        ys = [layer(x, ForwardContext(positions=pos, attend=None, seq_lens=lens, state=store.view(seqs)))]
        for xs in steps:
            ctx = ForwardContext(positions=pos[:N], attend=None, seq_lens=[1] * N, state=store.view(seqs))
            ys.append(layer(xs, ctx))
        outs[backend] = ys
    for i, n in enumerate(["prefill", "decode 1", "decode 2"]):
        report(f"gdn layer fla vs torch {n}", rel(outs["fla"][i], outs["torch"][i]), 2.5e-2)

    # a training pass of the layer (no state: the convolution kernel, SiLU fused), output and input gradient
    dy = torch.randn(T, 1024, device=dev, dtype=bf)
    grads = {}
    for backend in ("fla", "torch"):
        layer.backend = backend
        xg = x.clone().requires_grad_(True)
        y = layer(xg, ForwardContext(positions=pos, attend=None, seq_lens=lens))
        (y.float() * dy.float()).sum().backward()
        grads[backend] = (y.detach(), xg.grad)
    report("gdn layer fla vs torch training pass out", rel(grads["fla"][0], grads["torch"][0]), 2.5e-2)
    report("gdn layer fla vs torch training pass dx", rel(grads["fla"][1], grads["torch"][1]), 2.5e-2)
    layer.backend = None

    # time at 8k tokens (4 x 2048), the anchor's layout (perf_anchors: 0.47 ms fwd / 1.44 ms bwd),
    # with the key heads' norm and repetition (kernels.l2norm_heads)
    lens8 = [2048] * 4
    q = torch.randn(8192, Hk, dk, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(8192, Hk, dk, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(8192, Hv, dv, device=dev, dtype=bf, requires_grad=True)
    g = (-torch.rand(8192, Hv, device=dev) * 0.3).requires_grad_()
    beta = torch.rand(8192, Hv, device=dev, dtype=bf).requires_grad_()
    do = torch.randn(8192, Hv, dv, device=dev, dtype=bf)

    def fwd():
        return gd.fla_gated_delta_rule(q, k, v, g, beta, lens8, None, False)[0]

    def fwd_bwd():
        fwd().backward(do)

    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"  fla gdn 4 x 2048 tokens, {Hk}/{Hv} heads x {dk}: {name} {event_time_ms(fn, 3, 20):.3f} ms")


def check_pdl() -> None:
    """Programmatic dependent launch (Hopper) between small Triton kernels in a CUDA graph: a chain
    of 16 launches, each reading the last one's output, with and without ``launch_pdl`` (each
    kernel waits on ``gdc_wait`` before its loads and lets its dependents start after them). The
    chain's result is checked (a missing wait would read stale values), then the microseconds per
    kernel are printed at decode-like sizes, alone and behind a cuBLAS product. Decides whether the
    decode step's Triton kernels should launch this way."""
    import torch.nn.functional as F
    import triton
    import triton.language as tl

    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        print(f"pdl: triton {triton.__version__} has no gdc_wait; skipped")
        return

    @triton.jit
    def bump(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        if PDL:
            gdc_wait()
        x = tl.load(X + offs, mask=m)
        if PDL:
            gdc_launch_dependents()
        tl.store(Y + offs, x + 1.0, mask=m)

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    xin = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    for n in (64 * 128, 64 * 4096):
        bufs = [torch.zeros(n, device="cuda") for _ in range(2)]

        def chain(pdl: bool, gemm: bool = False, bufs=bufs, n=n):
            if gemm:
                F.linear(xin, w)
            for i in range(16):
                bump[(triton.cdiv(n, 1024),)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=1024, PDL=pdl,
                                              launch_pdl=pdl)

        line = f"  {n:>7} floats:"
        for pdl in (False, True):
            try:
                bufs[0].zero_()
                g = torch.cuda.CUDAGraph()
                chain(pdl)  # compile outside the capture
                bufs[0].zero_()
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    chain(pdl)
                g.replay()
                torch.cuda.synchronize()
                report(f"pdl={pdl} chain of 16 at {n}: every step saw the last one's output",
                       float((bufs[0] != 16.0).any()), 0.0)
            except Exception as e:  # noqa: BLE001 - an older Triton or driver: say so and go on
                print(f"pdl={pdl}: {type(e).__name__}: {e}")
                continue
            alone = graph_us([lambda pdl=pdl: chain(pdl)]) / 16
            behind = graph_us([lambda pdl=pdl: chain(pdl, gemm=True)])
            line += f"  pdl={pdl}: {alone:5.2f} us/kernel, product + 16 kernels {behind:6.1f} us"
        print(line, flush=True)


def _decoder_variants(label: str, variants: list[tuple[str, dict]], base: dict | None = None) -> None:
    """The static decoder with each of ``variants``' ``SamplerConfig`` options against the same
    engine without them (``base``'s options in both): 8 layers of a Qwen3 in fp32 (so the LoRA
    shrink's atomic adds move logprobs by ~1e-6, not the bf16 ulps that flip tokens of a random
    model), three adapters mixed, 48 prompts sampled 64 tokens each through CUDA graphs, seeds
    fixed. Run the base options again among the variants to show the noise."""
    from bench.common import random_ember_model
    from bench.sample import fill_adapters, make_prompts
    from ember.core.adapters import AdapterBank
    from ember.core.sampling import GenerationRequest, SamplerConfig, SamplingEngine, StopRule

    cfg = {"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3072,
           "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
           "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "tie_word_embeddings": False}
    model = random_ember_model(cfg, "cuda", torch.float32, seed=0)
    bank = AdapterBank(model, max_adapters=4, max_rank=32)
    slots = fill_adapters(bank, 3, 16)
    prompts = make_prompts(cfg["vocab_size"], 48, 40)

    def sample(options: dict):
        config = SamplerConfig(max_seqs=64, kv_tokens=64 * 128, static_decode=True, cuda_graphs=True,
                               **{"dependent_launch": False, "decode_gemm": False, **(base or {}), **options})
        engine = SamplingEngine(model, bank, config, max_seq_len=128)
        assert engine.static is not None
        reqs = [GenerationRequest(p, 64, [7 + i], slot=slots[i % 3], temperature=1.0, stop=StopRule())
                for i, p in enumerate(prompts)]
        seqs = [s for r in engine.generate(reqs) for s in r.sequences]
        return [list(s.tokens) for s in seqs], [np.asarray(s.logprobs) for s in seqs]

    base_tokens, base_lp = sample({})
    for name, options in variants:
        tokens, lp = sample(options)
        same = sum(a == b for a, b in zip(tokens, base_tokens))
        # logprobs of the positions before a sequence's first different token
        err = 0.0
        for t0, t1, l0, l1 in zip(base_tokens, tokens, base_lp, lp):
            n = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), len(t0))
            if n:
                err = max(err, float(np.abs(l0[:n] - l1[:n]).max()))
        print(f"  {label}, {name}: {same}/{len(tokens)} sequences identical, max |d logprob| {err:.2e}")
        report(f"{label} ({name}) against the base engine: logprobs, fp32", err, 1e-4)
        report(f"{label} ({name}) against the base engine: share of sequences not identical",
               1 - same / len(tokens), 0.1)


def check_pdl_decode() -> None:
    """Programmatic dependent launch (``SamplerConfig.dependent_launch``) in the static decoder
    (:func:`_decoder_variants`). A kernel that read its input before the kernel before it finished
    would change the logprobs far beyond the noise. Also on the fp8 rollout copies."""
    from ember.core.kernels import pdl

    if not pdl.supported(torch.device("cuda")):
        print("pdl decode: needs sm_90 and a Triton with griddepcontrol; skipped")
        return
    variants = [("base again", {}), ("dependent launch", {"dependent_launch": True})]
    _decoder_variants("pdl decode", variants)
    # the fp8 rollout copies' products (activation quantisation, the fp8 decode GEMM, its split sum)
    _decoder_variants("pdl decode, fp8 rollout", variants, base={"rollout_precision": "fp8"})


def check_decode_gemm_decode() -> None:
    """The decode GEMM with the LoRA expand in its epilogue (``SamplerConfig.decode_gemm``) in the
    static decoder (:func:`_decoder_variants`), alone and with programmatic dependent launch (its
    weight prefetch before the wait)."""
    from ember.core.kernels import pdl

    variants = [("base again", {}), ("decode GEMM", {"decode_gemm": True})]
    if pdl.supported(torch.device("cuda")):
        variants.append(("decode GEMM + dependent launch", {"decode_gemm": True, "dependent_launch": True}))
    _decoder_variants("decode GEMM", variants)


def check_shrink_windows() -> None:
    """The LoRA shrinks carried by the base products (``SamplerConfig.shrink_windows``, on by
    default: three adapters in four windows) against the shrink kernels, in the static decoder
    (:func:`_decoder_variants`). A window filled with another adapter's factors, or read at the
    wrong position, would change the logprobs far beyond the noise."""
    _decoder_variants("shrink windows", [("windows again", {}), ("shrink kernels", {"shrink_windows": False})])


def check_qkv_kernel() -> None:
    """The q/k/v kernel (``SamplerConfig.qkv_kernel``: the q/k/v LoRA expand, the q/k norms and
    rotations and the KV write in one launch; the default) against the three kernels, in the static
    decoder (:func:`_decoder_variants`), with shrink windows and without. A delta added to the wrong
    head's columns, a key left unrotated or stored at the wrong slot would change the logprobs far
    beyond the noise."""
    _decoder_variants("q/k/v kernel", [("q/k/v kernel again", {}), ("three kernels", {"qkv_kernel": False}),
                                       ("q/k/v kernel, shrink kernels", {"shrink_windows": False})])


CHECKS = {
    "gdn": lambda: check_gdn(),
    "sampling": lambda: check_sampling(),
    "attention": lambda: check_attention(),
    "continued": lambda: check_continued(),
    "grouped": lambda: check_grouped(),
    "fused": lambda: check_fused_kernels(),
    "norm_rope": lambda: check_norm_rope(),
    "tempered": lambda: check_tempered_logprobs(),
    "head": lambda: check_aligned_head(),
    "hc": lambda: check_hyper_connections(),
    "paged_decode": lambda: check_paged_decode(),
    "relative_decode": lambda: check_relative_decode(),
    "selected_decode": lambda: check_selected_decode(),
    "shared_prefix_decode": lambda: check_shared_prefix_decode(),
    "lora_linear": lambda: check_lora_linear(),
    "lora_decode": lambda: check_lora_decode(),
    "kv_write": lambda: check_kv_write(),
    "add_norm": lambda: check_add_norm(),
    "router_topk": lambda: check_router_topk(),
    "l2norm_heads": lambda: check_l2norm_heads(),
    "copies": lambda: check_copies(),
    "causal_conv": lambda: check_causal_conv(),
    "grouped_lora": lambda: check_grouped_lora(),
    "gathered_wgrad": lambda: check_gathered_wgrad(),
    "pdl": lambda: check_pdl(),
    "pdl_decode": lambda: check_pdl_decode(),
    "decode_gemm": lambda: check_decode_gemm_decode(),
    "swiglu_lora": lambda: check_swiglu_lora(),
    "shrink_windows": lambda: check_shrink_windows(),
    "qkv_kernel": lambda: check_qkv_kernel(),
    "mixed": lambda: check_mixed(),
    "rebuild": lambda: check_rebuild(),
}

if __name__ == "__main__":
    # python3 bench/gpu_checks.py [check ...] [--profile]   (default: all of them; --profile: a
    # kernel table of the timed step, for the checks that time one)
    print(torch.__version__, torch.cuda.get_device_name())
    for name in [a for a in sys.argv[1:] if not a.startswith("--")] or list(CHECKS):
        CHECKS[name]()
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)
