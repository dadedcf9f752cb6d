"""The one-launch paged-cache write (``ember.core.kernels.kv_write``) equals ``index_copy_``
(run on the CPU through Triton's interpreter): strided value heads (a column slice of a packed
projection), a dtype conversion, padding rows on one scratch slot, and the fallback for values of
another head shape (MLA)."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import fused
    from ember.core.kernels.kv_write import kv_write
    assert fused.use_triton(torch.zeros(1))

    def reference(kc, vc, k, v, slots):
        kc, vc = kc.clone(), vc.clone()
        kc.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(vc.dtype))
        return kc, vc

    g = torch.Generator().manual_seed(0)
    pages, page_size, H, D = 6, 4, 3, 24  # D not a power of two: masked head columns
    # (the interpreter's fp32 -> bf16 rounding is not the GPU's, so the conversion tested is the exact one)
    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        kc = torch.randn(pages, page_size, H, D, generator=g).to(cache_dtype)
        vc = torch.randn(pages, page_size, H, D, generator=g).to(cache_dtype)
        qkv = torch.randn(5, (4 + 2 * H) * D, generator=g).to(dtype)  # packed q (4 heads), k, v
        k = torch.randn(5, H, D, generator=g).to(dtype)
        v = qkv[:, (4 + H) * D :].view(5, H, D)  # strided rows, as the decoder's value heads
        assert not v.is_contiguous()
        slots = torch.tensor([9, 3, 22, 0, 17])
        want = reference(kc, vc, k, v, slots)
        kv_write(kc, vc, k, v, slots)
        assert torch.equal(kc, want[0]) and torch.equal(vc, want[1]), dtype
    # padding rows all on one scratch slot: the real rows' slots are written as index_copy_ does
    kc, vc = torch.zeros(pages, page_size, H, D), torch.zeros(pages, page_size, H, D)
    k, v = torch.randn(4, H, D, generator=g), torch.randn(4, H, D, generator=g)
    slots = torch.tensor([5, 0, 0, 6])
    kv_write(kc, vc, k, v, slots)
    assert torch.equal(kc.view(-1, H, D)[5], k[0]) and torch.equal(vc.view(-1, H, D)[6], v[3])
    assert kc.view(-1, H, D)[0].abs().sum() > 0  # one of the padding rows landed there
    # values of another head shape (MLA) take index_copy_
    kc, vc = torch.zeros(pages, page_size, H, D), torch.zeros(pages, page_size, H, 16)
    k, v = torch.randn(2, H, D, generator=g), torch.randn(2, H, 16, generator=g)
    want = reference(kc, vc, k, v, torch.tensor([1, 2]))
    kv_write(kc, vc, k, v, torch.tensor([1, 2]))
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])
    # no rows: nothing written
    kv_write(kc, vc, k[:0], v[:0], torch.tensor([], dtype=torch.long))
    print("OK")
    """
)


def test_kv_write_kernel_matches_index_copy():
    assert "OK" in run_interpreted(SCRIPT, timeout=300)
