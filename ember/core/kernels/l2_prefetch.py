"""Part of a weight fetched into the GPU's L2 cache ahead of the product that reads it.

A decode step alternates bandwidth-bound base products with stretches of small, latency-bound
kernels (norms, rotations, the KV write, LoRA shrinks and expands, the SwiGLU kernel), during which
HBM is nearly idle. :class:`~ember.core.sampling.prefetch.WeightPrefetch` launches this kernel on a
side stream right after each product, so part of the next product's weight streams into L2 while
those kernels run, and the product then reads that part from L2.

The part is spread evenly over the weight: ``fraction`` of its 1 KiB chunks, every one in ``1 /
fraction`` (chunk ``j`` is taken where ``floor((j + 1) · fraction) > floor(j · fraction)``). A
product's thread blocks each stream their own rows of the weight, and split-K products their own
columns; an even spread gives each of them the same share of hits, where a prefix of the weight
would speed up only the blocks that read it.

The kernel issues Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``: no registers, no
completion to wait for; one instruction per chunk) and ends. It changes no memory, so a result never
depends on it; on GPUs before sm_90, under the Triton interpreter and on the CPU it does nothing.
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused

CHUNK = 1024  # bytes per bulk prefetch (a multiple of 16, as the instruction needs)
PER_PROGRAM = 256  # chunks per program
# the prefetch of one chunk where the predicate ($2) is set; $0 is a dummy output
_PLAIN = "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], 1024; mov.u32 $0, 0; }"
# with an evict_last cache policy: the lines kept ahead of others in L2 until they are read
_EVICT_LAST = (
    "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], 1024, pol; mov.u32 $0, 0; }"
)

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(P, n_chunks, num, den, PER: tl.constexpr, ASM: tl.constexpr):
        j = tl.program_id(0).to(tl.int64) * PER + tl.arange(0, PER)
        take = (j < n_chunks) & ((j + 1) * num // den > j * num // den)
        ptr = P + j * 1024  # P is a byte pointer
        tl.inline_asm_elementwise(ASM, "=r,l,r", [ptr, take.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

def supported(t: torch.Tensor) -> bool:
    """Whether :func:`prefetch` does anything for ``t``: a contiguous CUDA tensor at a 16-byte
    aligned address (the instruction's), on sm_90 or newer, with Triton, not under the interpreter."""
    return (
        fused.HAVE_TRITON
        and not fused.INTERPRET
        and t.is_cuda
        and t.is_contiguous()
        and t.data_ptr() % 16 == 0
        and torch.cuda.get_device_capability(t.device)[0] >= 9
    )


def plan(nbytes: int, budget: int) -> tuple[int, int, int]:
    """``(chunks, num, den)``: the whole chunks of an ``nbytes`` tensor, and the fraction
    ``num / den`` of them (at most 1) that makes about ``budget`` bytes."""
    chunks = nbytes // CHUNK
    take = min(chunks, max(budget, 0) // CHUNK)
    return chunks, take, max(chunks, 1)


def chosen(nbytes: int, budget: int) -> torch.Tensor:
    """The chunk indices :func:`prefetch` takes (the kernel's rule, for tests and the bench)."""
    chunks, num, den = plan(nbytes, budget)
    j = torch.arange(chunks, dtype=torch.int64)
    return j[(j + 1) * num // den > j * num // den]


def prefetch(t: torch.Tensor, budget: int, evict_last: bool = False) -> None:
    """Start fetching about ``budget`` bytes of ``t``, spread evenly, into L2 (on the current
    stream); returns at once, and does nothing where :func:`supported` is false. ``evict_last``:
    with an ``evict_last`` cache policy, so that other traffic (a decode step's attention streams
    its KV pages through L2 meanwhile) evicts the fetched lines last."""
    if budget <= 0 or not supported(t):
        return
    chunks, num, den = plan(t.numel() * t.element_size(), budget)
    if num == 0:
        return
    grid = (triton.cdiv(chunks, PER_PROGRAM),)
    _prefetch_kernel[grid](t.view(-1).view(torch.uint8), chunks, num, den, PER=PER_PROGRAM,
                           ASM=_EVICT_LAST if evict_last else _PLAIN)
