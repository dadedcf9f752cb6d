"""A layer's keys and values stored in the paged cache in one launch (Triton).

``kc[slot[t]] = k[t]`` and ``vc[slot[t]] = v[t]`` for every token ``t`` (flat cache slots
``page · page_size + offset``), converting to the cache's dtype. In PyTorch these are two
``index_copy_`` launches per layer, each ~3 µs at a decode step's few rows: 72 launches and
0.22 ms of a Qwen3-8B step on an H100 (``bench/sample_diag.py --only steps``). The heads are read
through their strides (``v`` is a column slice of the packed q/k/v product), so no copy is made
first. Under ``TRITON_INTERPRET=1`` it runs on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels import pdl
from ember.core.kernels.fused import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _kv_write(K, V, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh, H, D,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        slot = tl.load(SLOTS + t).to(tl.int64)
        dst = slot * H * D + h * D + d  # the cache is contiguous: [slots, H, D]
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


def kv_write(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``k`` ``[T, ...]`` and ``v`` ``[T, ...]`` at the flat ``slots`` ``[T]`` of the caches
    ``kc`` and ``vc`` (``[pages, page_size, ...]``, the trailing shapes ``k``'s and ``v``'s). One
    kernel where both are ``[T, H, D]`` and the caches contiguous; else (other head shapes, as
    MLA's values, or no Triton) ``index_copy_``."""
    kc_flat, vc_flat = kc.view(-1, *k.shape[1:]), vc.view(-1, *v.shape[1:])
    same = k.dim() == 3 and v.shape == k.shape and vc.shape == kc.shape
    if not (same and use_triton(kc, vc, k, v, slots) and kc.is_contiguous() and vc.is_contiguous()
            and k.stride(-1) == 1 and v.stride(-1) == 1):
        kc_flat.index_copy_(0, slots, k.to(kc.dtype))
        vc_flat.index_copy_(0, slots, v.to(vc.dtype))
        return
    T, H, D = k.shape
    if T:
        _kv_write[(T,)](k, v, kc_flat, vc_flat, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), H, D,
                        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
                        **pdl.options())
