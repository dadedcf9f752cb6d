"""Attention over the paged KV cache.

* Prefill (every sequence of the pass starts at position 0): the pass's own keys and values are
  stored in the cache and attention runs exactly as in training (:class:`PackedAttention`: varlen
  flash attention on CUDA, per-document SDPA elsewhere), so prompt logprobs match the trainer's.
* Decode (one new token per sequence): the query attends to the sequence's cached keys through its
  block table. On CUDA (and under ``TRITON_INTERPRET=1``) a Triton kernel does flash-decoding:
  programs per (sequence, KV head, split of the sequence) walk 64 tokens at a time across pages
  with an online softmax, all query heads of the KV head's group in one ``tl.dot``, reading each
  cached key once, and a second small kernel merges the splits. Grid and scratch depend only on
  shapes (batch, heads, block-table width), so a decode step can be captured in a CUDA graph.
  Elsewhere a gather of the pages and a masked softmax compute the same thing.

Sliding-window layers (``AttentionSpec("sliding", window)``) see the last ``window`` positions,
the current token included.

Inkling-2's ``relative(...)`` (relative bias by distance and sinks, sliding or global) runs the same
kernel with the bias and the sink added (so it captures too); without Triton it gathers the pages
(:func:`gather_pages`, only those of the window on sliding layers). A QSA block selection
(``accepts_selection``; Qwen3.8-Flash-Next) runs the kernel over the chosen blocks and the tail
only (without Triton, a gather of all pages and a masked softmax); the QSA indexer's raw keys are kept in the pages
(``store_index_keys`` / ``index_keys`` / ``index_key_table``).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ember.core.config import AttentionSpec
from ember.core.kernels import fused, pdl
from ember.core.layers.attention import PackedAttention
from ember.core.layers.qsa import BlockSelection, selected_attention
from ember.core.layers.relative_attention import PackedRelativeAttention, RelativeAttentionSpec
from ember.core.sampling.kv_cache import SCRATCH_PAGE, PagedKVCache

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decode_split_range(n, window, lo, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """The visible tokens ``[start, n)`` of a sequence (those at ``lo`` and after: a shared
        prefix before ``lo`` is attended apart), the BLOCK_N-aligned blocks covering them
        (``first``, ``nblk``), and how they are dealt to splits: ``per`` (>= 2 unless the sequence is
        shorter) consecutive blocks each, to ``active`` (>= 1) splits. The kernels derive the same
        split layout from ``seq_lens``, so a short sequence of a long table is not split thinner
        than is worth merging."""
        start = tl.maximum(tl.maximum(n - window, 0), lo)  # window = 2**30 when the layer has none
        first = start // BLOCK_N
        nblk = (n + BLOCK_N - 1) // BLOCK_N - first  # 0 when n == 0
        active = tl.maximum(tl.minimum(nblk // 2, NUM_SPLITS), 1)  # >= 2 blocks a split
        per = tl.maximum((nblk + active - 1) // active, 1)
        active = tl.maximum((nblk + per - 1) // per, 1)  # no split left without a block
        return start, first, nblk, per, active

    @triton.jit
    def _decode_extent(n, sel_span):
        """The tokens a sequence of length ``n`` walks: ``n``, or ``sel_span`` virtual ones under a
        block selection (``sel_span > 0``; none for an empty row)."""
        return tl.where(sel_span > 0, tl.where(n > 0, sel_span, 0), n)

    @triton.jit
    def _paged_decode_kernel(
        Q,
        K,
        V,
        O,
        ACC,
        ML,
        BT,
        LENS,
        P,
        SINK,
        SEL,
        PRE,
        qk_scale,
        window,
        rel_extent,
        sel_block,
        sel_span,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_ob,
        stride_oh,
        stride_bt,
        stride_pb,
        stride_ph,
        stride_sb,
        stride_selb,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRE_SPLITS: tl.constexpr,
        SLOTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SINK: tl.constexpr,
        HAS_SELECT: tl.constexpr,
        HAS_PREFIX: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per (sequence, KV head, split): the split's share of the sequence's visible
        tokens, BLOCK_N at a time (any number of pages: each token's page comes from the block
        table), the group's REP query heads at once through tl.dot, online softmax in fp32 (base 2).

        A sequence whose tokens fit one split (or NUM_SPLITS == 1) is finished here; otherwise each
        split leaves its unnormalised ``acc`` and its ``(m, l)`` in fp32 scratch for
        :func:`_paged_decode_combine`.

        ``HAS_BIAS``: ``P[b, h, dist]`` (``[B, Hq, rel_extent]``) is added to the score of the key
        ``dist = n - 1 - pos`` tokens back when ``dist < rel_extent`` (Inkling-2's relative bias).
        ``HAS_SINK``: ``SINK[b, h]`` is one more logit in the softmax, with no value (a sink).
        ``HAS_SELECT`` (a QSA block selection): only the keys of the ``sel_block``-token blocks listed
        in ``SEL[b]`` (``[B, C]`` block numbers, ``-1``: none) and those after the query's last
        complete block are visible, and only those are read: the program walks ``sel_span = (C + 1)
        · sel_block`` virtual tokens, the listed blocks' then the tail's, instead of the sequence.
        ``HAS_PREFIX``: the first ``PRE[b]`` tokens are a prefix shared with other rows, which
        :func:`_shared_prefix_kernel` (the grid before this one) attended for all of them at once,
        leaving partials in slots ``NUM_SPLITS ..`` of ``SLOTS`` per row and head; this program walks
        the rest. With one split it starts from the prefix's partials and finishes the row; with
        several, each split leaves its partial too and the combine kernel merges them all."""
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        n = tl.load(LENS + b)
        extent = _decode_extent(n, sel_span)
        pre = 0
        if HAS_PREFIX:
            pre = tl.load(PRE + b)
        start, first, nblk, per, active = _decode_split_range(extent, window, pre, BLOCK_N, NUM_SPLITS)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        tok = tl.arange(0, BLOCK_N)
        rmask = r < REP
        dmask = d < D
        dvmask = dv < DV
        heads = hk * REP + r
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=rmask[:, None] & dmask[None, :], other=0.0).to(K.dtype.element_ty)
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
        bt_base = BT + b.to(tl.int64) * stride_bt
        m = tl.full([REP_PAD], -1e30, tl.float32)
        lsum = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, DV_PAD], tl.float32)
        if HAS_PREFIX and NUM_SPLITS == 1:  # continue the online softmax from the prefix's partials
            _, _, _, _, shared = _decode_split_range(pre, 1 << 30, 0, BLOCK_N, PRE_SPLITS)
            part = (b * (REP * tl.num_programs(1)) + heads).to(tl.int64) * SLOTS + NUM_SPLITS
            for j in range(PRE_SPLITS):
                # scalar conditions become row limits (the interpreter cannot AND a tensor and a scalar)
                ok = r < tl.where((pre > 0) & (j < shared), REP, 0)
                m_j = tl.load(ML + (part + j) * 2, mask=ok, other=-1e30)
                l_j = tl.load(ML + (part + j) * 2 + 1, mask=ok, other=0.0)
                acc_j = tl.load(ACC + (part + j)[:, None] * DV + dv[None, :], mask=ok[:, None] & dvmask[None, :],
                                other=0.0)
                m_new = tl.maximum(m, m_j)
                alpha = tl.exp2(m - m_new)
                beta = tl.exp2(m_j - m_new)
                lsum = lsum * alpha + l_j * beta
                acc = acc * alpha[:, None] + acc_j * beta[:, None]
                m = m_new
        blk0 = first + split * per
        blk1 = tl.minimum(blk0 + per, first + nblk)  # empty for splits past ``active``
        for blk in range(blk0, blk1):
            pos = blk * BLOCK_N + tok
            valid = (pos < extent) & (pos >= start)
            if HAS_SELECT:  # virtual token -> position: the listed blocks' tokens, then the tail's
                listed = sel_span - sel_block
                in_list = pos < listed
                chosen = tl.load(SEL + b.to(tl.int64) * stride_selb + pos // sel_block, mask=valid & in_list, other=-1)
                virtual = pos
                pos = tl.where(in_list, chosen * sel_block + virtual % sel_block,
                               n // sel_block * sel_block + virtual - listed)
                valid = valid & tl.where(in_list, chosen >= 0, pos < n)
            page = tl.load(bt_base + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = (pos % PAGE).to(tl.int64)
            k_row = page * stride_kp + slot * stride_ks
            v_row = page * stride_vp + slot * stride_vs
            k = tl.load(k_base + k_row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [REP_PAD, BLOCK_N]
            if HAS_BIAS:
                dist = n - 1 - pos
                near = valid & (dist < rel_extent)
                p_ptr = P + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + dist[None, :]
                bias = tl.load(p_ptr, mask=rmask[:, None] & near[None, :], other=0.0)
                scores += bias.to(tl.float32) * 1.4426950408889634  # base 2, as qk_scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            prob = tl.exp2(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(prob, axis=1)
            v = tl.load(v_base + v_row[:, None] + dv[None, :], mask=valid[:, None] & dvmask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        o_ptr = O + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
        if HAS_SINK:  # the finished output's softmax has the sink's term too (partials: the combine)
            sink = tl.load(SINK + b * stride_sb + heads, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m, sink)
            out = acc * tl.exp2(m - m_f)[:, None] / (lsum * tl.exp2(m - m_f) + tl.exp2(sink - m_f))[:, None]
        else:
            out = acc / tl.maximum(lsum, 1e-30)[:, None]  # length 0: acc = 0 -> zeros
        if NUM_SPLITS == 1:
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=rmask[:, None] & dvmask[None, :])
        else:
            merged = active > 1  # several partials: the combine kernel finishes the row
            if HAS_PREFIX:
                merged = merged | (pre > 0)
            # scalar conditions become row limits (Triton's interpreter cannot AND a tensor and a scalar)
            done = tl.where(merged, 0, tl.where(split == 0, REP, 0))  # finished by this program
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=(r < done)[:, None] & dvmask[None, :])
            part = r < tl.where(merged, tl.where(split < active, REP, 0), 0)  # a partial to merge
            row = (b * (REP * tl.num_programs(1)) + heads).to(tl.int64) * SLOTS + split  # [B, Hq, SLOTS]
            tl.store(ACC + row[:, None] * DV + dv[None, :], acc, mask=part[:, None] & dvmask[None, :])
            tl.store(ML + row * 2, m, mask=part)
            tl.store(ML + row * 2 + 1, lsum, mask=part)

    @triton.jit
    def _paged_decode_combine(
        O,
        ACC,
        ML,
        LENS,
        SINK,
        PRE,
        window,
        sel_span,
        stride_ob,
        stride_oh,
        stride_sb,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRE_SPLITS: tl.constexpr,
        SLOTS: tl.constexpr,
        SLOTS_PAD: tl.constexpr,
        HAS_SINK: tl.constexpr,
        HAS_PREFIX: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per (sequence, query head): merges the partial softmaxes of the sequence's
        splits and (``HAS_PREFIX``) of its shared prefix's splits, and the sink's logit with
        ``HAS_SINK`` (sequences finished by a single split are left alone)."""
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(LENS + b)
        pre = 0
        if HAS_PREFIX:
            pre = tl.load(PRE + b)
        _, _, _, _, active = _decode_split_range(_decode_extent(n, sel_span), window, pre, BLOCK_N, NUM_SPLITS)
        shared = 0  # the prefix's partials, in slots NUM_SPLITS .. NUM_SPLITS + shared - 1
        merged = active > 1
        if HAS_PREFIX:
            _, _, _, _, shared = _decode_split_range(pre, 1 << 30, 0, BLOCK_N, PRE_SPLITS)
            shared = tl.where(pre > 0, shared, 0)
            merged = merged | (pre > 0)
        if merged:
            s = tl.arange(0, SLOTS_PAD)
            smask = (s < active) | ((s >= NUM_SPLITS) & (s < NUM_SPLITS + shared))
            row0 = (b * tl.num_programs(1) + h).to(tl.int64) * SLOTS
            ms = tl.load(ML + (row0 + s) * 2, mask=smask, other=-1e30)
            ls = tl.load(ML + (row0 + s) * 2 + 1, mask=smask, other=0.0)
            m_all = tl.max(ms, axis=0)
            if HAS_SINK:
                sink = tl.load(SINK + b * stride_sb + h).to(tl.float32) * 1.4426950408889634
                m_all = tl.maximum(m_all, sink)
            w = tl.where(smask, tl.exp2(ms - m_all), 0.0)
            total = tl.sum(w * ls, axis=0)
            if HAS_SINK:
                total += tl.exp2(sink - m_all)
            dv = tl.arange(0, DV_PAD)
            dvmask = dv < DV
            acc = tl.zeros([DV_PAD], tl.float32)
            for i in range(active):
                wi = tl.exp2(tl.load(ML + (row0 + i) * 2) - m_all)
                acc += wi * tl.load(ACC + (row0 + i) * DV + dv, mask=dvmask, other=0.0)
            for i in range(NUM_SPLITS, NUM_SPLITS + shared):
                wi = tl.exp2(tl.load(ML + (row0 + i) * 2) - m_all)
                acc += wi * tl.load(ACC + (row0 + i) * DV + dv, mask=dvmask, other=0.0)
            out = acc / tl.maximum(total, 1e-30)
            tl.store(O + b * stride_ob + h * stride_oh + dv, out.to(O.dtype.element_ty), mask=dvmask)


    @triton.jit
    def _shared_prefix_kernel(
        Q,
        K,
        V,
        ACC,
        ML,
        BT,
        PRE,
        MEM,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_mem,
        REP: tl.constexpr,
        REP_P: tl.constexpr,
        MB: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PRE_SPLITS: tl.constexpr,
        SLOTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Cascade attention's first level: one program per (MB members of a prefix group, KV head,
        split) attends the queries of those rows (``MB * REP`` query heads in one ``tl.dot``) over
        the prefix they share, so its keys and values are read once for the group, not once a row.

        ``MEM[g]`` lists a group's rows (``GROUP`` columns, ``-1`` after the last); they share the
        first ``PRE[row]`` tokens, whose pages the first row's block table gives. Each row and head
        gets a partial softmax in slot ``NUM_SPLITS + split`` of ``SLOTS``, which the split kernel
        continues over the row's own tokens (one split) or the combine kernel merges with its
        splits' partials (several)."""
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        g = pid // (GROUP // MB)
        chunk = pid % (GROUP // MB)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        mem_base = MEM + g.to(tl.int64) * stride_mem
        leader = tl.load(mem_base)
        # an empty chunk (or group) walks nothing: members fill a group's columns from the first
        n = tl.where(tl.load(mem_base + chunk * MB) >= 0, tl.load(PRE + tl.maximum(leader, 0)), 0)
        _, first, nblk, per, active = _decode_split_range(n, 1 << 30, 0, BLOCK_N, PRE_SPLITS)
        i = tl.arange(0, MB * REP_P)
        r = i % REP_P
        row = tl.load(mem_base + chunk * MB + i // REP_P)
        live = (row >= 0) & (r < REP)
        row = tl.maximum(row, 0).to(tl.int64)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        tok = tl.arange(0, BLOCK_N)
        dmask = d < D
        dvmask = dv < DV
        heads = hk * REP + r
        q_ptr = Q + row[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=live[:, None] & dmask[None, :], other=0.0).to(K.dtype.element_ty)
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
        bt_base = BT + tl.maximum(leader, 0).to(tl.int64) * stride_bt
        m = tl.full([MB * REP_P], -1e30, tl.float32)
        lsum = tl.zeros([MB * REP_P], tl.float32)
        acc = tl.zeros([MB * REP_P, DV_PAD], tl.float32)
        blk0 = first + split * per
        blk1 = tl.minimum(blk0 + per, first + nblk)  # empty for splits past ``active``
        for blk in range(blk0, blk1):
            pos = blk * BLOCK_N + tok
            valid = pos < n
            page = tl.load(bt_base + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = (pos % PAGE).to(tl.int64)
            k_row = page * stride_kp + slot * stride_ks
            v_row = page * stride_vp + slot * stride_vs
            k = tl.load(k_base + k_row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [MB * REP_P, BLOCK_N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            prob = tl.exp2(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(prob, axis=1)
            v = tl.load(v_base + v_row[:, None] + dv[None, :], mask=valid[:, None] & dvmask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        # scalar conditions become row limits (Triton's interpreter cannot AND a tensor and a scalar)
        keep = live & (i < tl.where((n > 0) & (split < active), MB * REP_P, 0))
        out_row = (row * (REP * tl.num_programs(1)) + heads) * SLOTS + NUM_SPLITS + split  # [B, Hq, SLOTS]
        tl.store(ACC + out_row[:, None] * DV + dv[None, :], acc, mask=keep[:, None] & dvmask[None, :])
        tl.store(ML + out_row * 2, m, mask=keep)
        tl.store(ML + out_row * 2 + 1, lsum, mask=keep)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_DECODE_LAUNCH = {"num_warps": 4, "num_stages": 2}  # of the split kernel
PREFIX_GROUP = 16  # rows a prefix group lists (a larger group is listed as several)
# the prefix kernel's launch: query heads a program takes (MB rows of the group times their REP) and
# warps/stages (module-level so ``bench/gpu_checks.py shared_prefix_decode --sweep`` can sweep them;
# on an H100 this choice was the fastest of 16/32/64 heads x 4/8 warps x 2/3 stages, by 1-20 %)
_PREFIX_LAUNCH = {"rows": 32, "num_warps": 4, "num_stages": 2}
PREFIX_MIN_TOKENS = 64  # a shorter shared prefix is attended by each row (one BLOCK_N)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: size the grid as for an H100/H200


def _decode_block_n(d_pad: int, dv_pad: int) -> int:
    """Tokens per iteration: 64 for head dims up to 128, fewer for wider heads (register budget)."""
    widest = max(d_pad, dv_pad)
    return 64 if widest <= 128 else 32 if widest <= 256 else 16


def _decode_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits of the sequence axis: as many as keep the grid within one wave of ~4 programs per SM
    (none once ``batch * kv_heads`` fills that alone), at most one per two BLOCK_N blocks of the
    longest sequence the block table can describe. Depends only on shapes (CUDA graphs).

    Measured on an H200 (132 SMs; Hkv=8, D=128, bf16): with 512 or more (sequence, KV head) pairs a
    single split was fastest at 128..8192 tokens; with fewer, ``4 * SMs // pairs`` splits were
    within a few percent of the best tried (more splits than one wave holds were slower)."""
    programs = batch * kv_heads
    want = 4 * _sm_count(device) // programs
    return max(1, min(want, max_tokens // (2 * block_n), _MAX_SPLITS))


def paged_decode_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
    profiles: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    select_block: int = 1,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton decode attention: ``q`` ``[B, Hq, D]`` against each sequence's ``seq_lens[b]`` cached
    tokens (``block_table`` ``[B, W]`` int32) -> ``[B, Hq, Dv]``; rows with length 0 give zeros.
    Optional (Inkling-2, :func:`relative_decode`'s contract): ``profiles`` ``[B, Hq, R]``, a bias
    by distance back from the query (``R`` nearest keys), and ``sinks`` ``[B, Hq]``, a logit
    without a value. ``selected`` ``[B, C]`` (QSA: block numbers of ``select_block`` tokens,
    ``-1``: none; distinct, complete blocks): only the keys of those blocks and those after the
    query's last complete block are visible, and only they are read (``C + 1`` blocks a row).
    ``prefix`` (cascade attention; no window, bias, sink or selection): ``(lens [B], members [G,
    PREFIX_GROUP])`` from :func:`shared_prefix_groups`: the rows of a group share their first
    ``lens[row]`` tokens, which are read once for the group, and each row reads only the rest;
    the result is the same attention.

    Flash-decoding: the visible tokens of a sequence are dealt to up to ``num_splits`` programs
    per KV head (by default chosen from the shapes: batch, heads, block-table width) and a second
    kernel merges their partial softmaxes. Grid and scratch depend only on shapes, never on the
    lengths, so the call can be captured in a CUDA graph."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_pages.shape
    Dv = v_pages.shape[-1]
    rep = Hq // Hkv
    out = torch.empty(B, Hq, Dv, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    q = q.contiguous()
    d_pad, dv_pad = max(16, _pow2(D)), max(16, _pow2(Dv))  # tl.dot needs >= 16 along each axis
    block_n = _decode_block_n(d_pad, dv_pad)
    sel_span = (selected.shape[1] + 1) * int(select_block) if selected is not None else 0
    if num_splits is None:
        longest = sel_span or block_table.shape[1] * page
        num_splits = _decode_num_splits(B, Hkv, longest, block_n, q.device)
    num_splits = max(1, int(num_splits))
    pre_splits = 0
    if prefix is not None:
        if window or profiles is not None or sinks is not None or selected is not None:
            raise ValueError("a shared prefix is attended apart only without a window, bias, sink or selection")
        pre_splits = _decode_num_splits(max(1, B // PREFIX_GROUP), Hkv, block_table.shape[1] * page, block_n, q.device)
    slots = num_splits + pre_splits
    if slots > 1:
        acc = torch.empty(B, Hq, slots, Dv, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, Hq, slots, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # not touched
    window = int(window or 1 << 30)
    if profiles is not None and profiles.stride(-1) != 1:
        profiles = profiles.contiguous()
    if sinks is not None and sinks.stride(-1) != 1:
        sinks = sinks.contiguous()
    P = profiles if profiles is not None else out  # not read without the flags
    S = sinks if sinks is not None else out
    C = selected if selected is not None else out
    pre, members = prefix if prefix is not None else (out, out)
    launch = {"D": D, "D_PAD": d_pad, "DV": Dv, "DV_PAD": dv_pad, "PAGE": page, "BLOCK_N": block_n,
              "NUM_SPLITS": num_splits, "PRE_SPLITS": max(pre_splits, 1), "SLOTS": slots,
              "DOT_PRECISION": "ieee" if k_pages.dtype == torch.float32 else "tf32"}
    if prefix is not None and members.shape[0]:
        rep_p = _pow2(rep)
        launch_opts = dict(_PREFIX_LAUNCH)
        mb = min(PREFIX_GROUP, max(1, launch_opts.pop("rows") // rep_p))  # rows of the group a program takes
        _shared_prefix_kernel[(members.shape[0] * (PREFIX_GROUP // mb), Hkv, pre_splits)](
            q, k_pages, v_pages, acc, ml, block_table, pre, members,
            float(scale) * _LOG2E,
            q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            block_table.stride(0), members.stride(0),
            REP=rep, REP_P=rep_p, MB=mb, GROUP=PREFIX_GROUP,
            **launch, **launch_opts, **pdl.options(),
        )
    _paged_decode_kernel[(B, Hkv, num_splits)](
        q,
        k_pages,
        v_pages,
        out,
        acc,
        ml,
        block_table,
        seq_lens,
        P,
        S,
        C,
        pre,
        float(scale) * _LOG2E,
        window,
        P.shape[-1] if profiles is not None else 0,
        int(select_block),
        sel_span,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        P.stride(0),
        P.stride(1),
        S.stride(0),
        C.stride(0),
        REP=rep,
        REP_PAD=max(16, _pow2(rep)),
        HAS_BIAS=profiles is not None,
        HAS_SINK=sinks is not None,
        HAS_SELECT=selected is not None,
        HAS_PREFIX=prefix is not None,
        **launch,
        **_DECODE_LAUNCH,
        **pdl.options(),
    )
    if num_splits > 1:
        _paged_decode_combine[(B, Hq)](
            out,
            acc,
            ml,
            seq_lens,
            S,
            pre,
            window,
            sel_span,
            out.stride(0),
            out.stride(1),
            S.stride(0),
            DV=Dv,
            DV_PAD=dv_pad,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            PRE_SPLITS=max(pre_splits, 1),
            SLOTS=slots,
            SLOTS_PAD=_pow2(slots),
            HAS_SINK=sinks is not None,
            HAS_PREFIX=prefix is not None,
            num_warps=4,
            **pdl.options(),
        )
    return out


def paged_decode_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Reference decode attention (same contract as :func:`paged_decode_triton`): gathers the
    block table's pages and applies a masked softmax in fp32."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_pages.shape
    W = block_table.shape[1]
    L = W * page
    idx = block_table.long()
    k = k_pages[idx].reshape(B, L, Hkv, D).float()
    v = v_pages[idx].reshape(B, L, Hkv, -1).float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhrd,blhd->bhrl", qg, k) * scale
    pos = torch.arange(L, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    valid = pos[None, :] < lens
    if window:
        valid &= pos[None, :] >= lens - window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of length 0 -> zeros
    out = torch.einsum("bhrl,blhd->bhrd", probs, v)
    return out.reshape(B, Hq, -1).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache: the Triton kernel where it runs (reading each
    ``prefix`` group's shared tokens once), else the reference."""
    out = _decode_triton_or_none(q, k_pages, v_pages, block_table, seq_lens, scale, window, prefix=prefix)
    return out if out is not None else paged_decode_torch(q, k_pages, v_pages, block_table, seq_lens, scale, window)


_TRITON_DECODE = {"ok": True}


def _decode_triton_or_none(q: torch.Tensor, k_pages: torch.Tensor, *args, **kwargs) -> torch.Tensor | None:
    """:func:`paged_decode_triton` where it runs; ``None`` where it does not (or once it failed:
    the caller then takes its PyTorch path)."""
    if not (_TRITON_DECODE["ok"] and fused.use_triton(q, k_pages)):
        return None
    try:
        return paged_decode_triton(q, k_pages, *args, **kwargs)
    except Exception as e:  # e.g. a GPU/Triton combination the kernel was never compiled for
        if fused.INTERPRET:
            raise
        _TRITON_DECODE["ok"] = False
        warnings.warn(f"paged decode kernel failed ({type(e).__name__}: {e}); using the PyTorch path", stacklevel=2)
        return None


def _window(spec: AttentionSpec) -> int:
    return int(spec.window) if spec.kind == "sliding" and spec.window else 0


def shared_prefix_groups(table: np.ndarray, lens: np.ndarray, page: int, min_tokens: int = PREFIX_MIN_TOKENS
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The prefix groups of a decode step (cascade attention, :func:`paged_decode_triton`'s
    ``prefix``): rows whose block tables (``[B, W]``; ``lens`` ``[B]`` tokens, the new one
    included) begin with the same pages share those tokens, since a page is shared only through
    the prefix cache or a fork, which share every page before it too.

    Each row's shared prefix is its leading pages that another row's table also holds (the
    deepest node of the prefix tree it shares; never the page the step writes), and the rows
    whose deepest shared page is the same form a group. Returns each row's shared tokens
    (``int32 [B]``; 0 alone or below ``min_tokens``) and the groups' rows (``int32 [G,
    PREFIX_GROUP]``, ``-1`` after the last; a larger group takes several lines)."""
    lens = np.asarray(lens, dtype=np.int64)
    shared = np.zeros(len(lens), dtype=np.int32)
    full = np.maximum(lens - 1, 0) // page  # pages before the one the new token goes to
    width = min(int(full.max(initial=0)), table.shape[1])
    if width * page < min_tokens:
        return shared, np.zeros((0, PREFIX_GROUP), dtype=np.int32)
    cols = np.arange(width)
    pages = np.where(cols < full[:, None], table[:, :width], SCRATCH_PAGE).astype(np.int64)
    held = np.bincount(pages.ravel())[pages] >= 2
    held &= pages != SCRATCH_PAGE
    depth = np.cumprod(held, axis=1).sum(axis=1)  # leading pages some other row holds too
    rows = np.flatnonzero(depth * page >= min_tokens)
    deepest = pages[rows, depth[rows] - 1]
    order = np.argsort(deepest, kind="stable")
    rows, deepest = rows[order], deepest[order]
    starts = np.flatnonzero(np.r_[True, deepest[1:] != deepest[:-1]])
    lines = []
    for a, b in zip(starts, np.r_[starts[1:], len(rows)]):
        if b - a < 2:
            continue  # no other row shares this row's deepest page
        group = rows[a:b]
        shared[group] = depth[group] * page
        for c in range(0, len(group), PREFIX_GROUP):
            line = np.full(PREFIX_GROUP, -1, dtype=np.int32)
            line[: len(group[c : c + PREFIX_GROUP])] = group[c : c + PREFIX_GROUP]
            lines.append(line)
    members = np.stack(lines) if lines else np.zeros((0, PREFIX_GROUP), dtype=np.int32)
    return shared, members


class PrefillAttention:
    """``ForwardContext.attend`` of a prefill pass: store the pass's keys/values at ``slot_mapping``
    and attend within each prompt exactly as training does.

    Besides ``attend(layer, q, k, v, spec, scale)`` it serves the attention variants that need more
    than that (every prompt starts at position 0, so each is the trainer's own packed call):

    * a QSA block ``selection`` (``accepts_selection``): :func:`~ember.core.layers.qsa.selected_attention`;
    * ``relative(layer, q, k, v, profiles, sinks, spec, scale)`` (Inkling-2's relative bias and sinks):
      :class:`~ember.core.layers.relative_attention.PackedRelativeAttention` with ``relative_backend``;
    * ``store_index_keys`` / ``index_keys``: the QSA indexer's raw keys kept in the cache's pages.

    With ``prefix_lens`` (packed order), a document may continue a prefix already in the cache (its
    first ``prefix_lens[i]`` tokens, shared prompt pages, listed in ``block_tables[i]`` with the
    pages its own tokens go to): the pass holds only its remaining tokens, at positions from
    ``prefix_lens[i]``, and they attend over the prefix's cached keys and their own
    (:meth:`_continued`). Documents without a prefix still run the trainer's packed call. Only plain
    attention (sliding windows included) continues a prefix; the variants above refuse it.
    """

    accepts_selection = True

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        doc_lengths: list[int],
        positions: torch.Tensor | None = None,
        relative_backend: str | None = None,
        prefix_lens: list[int] | None = None,
        block_tables: list[list[int]] | None = None,
    ):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.doc_lengths = list(doc_lengths)
        self.prefix_lens = list(prefix_lens) if prefix_lens and any(prefix_lens) else None
        if self.prefix_lens is None:
            self.packed = PackedAttention(self.doc_lengths, cache.device)
        else:
            starts = [0]
            for n in self.doc_lengths:
                starts.append(starts[-1] + n)
            fresh = [i for i, p in enumerate(self.prefix_lens) if p == 0]
            self.packed = PackedAttention([self.doc_lengths[i] for i in fresh], cache.device) if fresh else None
            self._fresh_rows = (
                torch.cat([torch.arange(starts[i], starts[i + 1]) for i in fresh]).to(cache.device) if fresh else None
            )
            # continued documents grouped by (prefix, own tokens): one batched attention per group,
            # its rows of the pass ([B, n]) and page tables ([B, pages]) made once for every layer
            groups: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(self.prefix_lens):
                if p:
                    groups.setdefault((p, self.doc_lengths[i]), []).append(i)
            ps = cache.page_size
            self._groups = [
                (p, n, (torch.tensor([starts[i] for i in docs])[:, None] + torch.arange(n)).to(cache.device),
                 torch.tensor([block_tables[i][: -(-(p + n) // ps)] for i in docs], dtype=torch.long,
                              device=cache.device))
                for (p, n), docs in groups.items()
            ]
        if positions is None:
            positions = torch.cat([torch.arange(n, device=cache.device) for n in self.doc_lengths])
        self.positions = positions
        self.relative_backend = relative_backend
        self._relative: PackedRelativeAttention | None = None

    def __call__(
        self, layer: int, q, k, v, spec: AttentionSpec, scale: float, selection: BlockSelection | None = None
    ) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        if selection is not None:
            self._no_prefix("a QSA block selection")
            if _window(spec):
                raise NotImplementedError("a QSA block selection on a sliding-window layer")
            return selected_attention(q, k, v, self.doc_lengths, selection, scale)
        if self.prefix_lens is None:
            return self.packed(q, k, v, spec, scale)
        return self._continued(layer, q, k, v, spec, scale)

    def _no_prefix(self, what: str) -> None:
        if self.prefix_lens is not None:
            raise NotImplementedError(f"{what} cannot continue a cached prompt prefix")

    # elements of one batched score tensor [B, Hq, n, L] (bounds the memory of a continued group)
    CONTINUED_ELEMENTS = 1 << 26

    def _continued(self, layer: int, q, k, v, spec: AttentionSpec, scale: float) -> torch.Tensor:
        """Attention of a pass in which some documents continue a cached prefix: those read every
        key of theirs from the pages (the prefix's and, written just before, their own), masked
        causally (and by the window) at their true positions; the others run the packed call.
        Without a window the mask is causal aligned to the last key (``causal_lower_right``), which
        SDPA runs in its flash kernel on CUDA instead of materialising it (a long prompt's later
        chunks attend over all of its cached keys), with the query heads of a key head read against
        it (``enable_gqa``): the keys and values are not repeated per query head. With a window the
        boolean mask needs the memory-efficient kernel, which takes no grouped heads: they are
        repeated."""
        T, Hq, _ = q.shape
        out = q.new_empty(T, Hq, v.shape[-1])
        if self.packed is not None:
            rows = self._fresh_rows
            out[rows] = self.packed(q[rows], k[rows], v[rows], spec, scale)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        ps = self.cache.page_size
        window = _window(spec)
        Hkv = kc.shape[2]
        rep = Hq // Hkv
        for prefix, n, rows, tables in self._groups:
            L = prefix + n
            width = tables.shape[1]
            if window:
                d = torch.arange(prefix, L, device=q.device)[:, None] - torch.arange(L, device=q.device)[None, :]
                mask = (d >= 0) & (d < window)
            per_doc = max(1, self.CONTINUED_ELEMENTS // max(1, Hq * n * L))
            for b0 in range(0, tables.shape[0], per_doc):
                t = tables[b0 : b0 + per_doc]
                B = t.shape[0]
                kk = kc[t].reshape(B, width * ps, Hkv, -1)[:, :L].to(q.dtype).transpose(1, 2)
                vv = vc[t].reshape(B, width * ps, Hkv, -1)[:, :L].to(q.dtype).transpose(1, 2)
                if rep > 1 and window:
                    kk = kk.repeat_interleave(rep, dim=1)
                    vv = vv.repeat_interleave(rep, dim=1)
                r = rows[b0 : b0 + per_doc]
                qq = q[r].transpose(1, 2)  # [B, Hq, n, D]
                # rows at a time, so that a materialised mask and scores stay bounded (CUDA's
                # kernels materialise neither without a window)
                step = n if q.is_cuda and not window else max(1, self.CONTINUED_ELEMENTS // max(1, B * Hq * L))
                for c0 in range(0, n, step):
                    c1 = min(n, c0 + step)
                    if window:
                        o = F.scaled_dot_product_attention(qq[:, :, c0:c1], kk, vv, attn_mask=mask[c0:c1], scale=scale)
                    else:  # rows c0..c1 see the keys up to their own position prefix + c1 - 1
                        hi = prefix + c1
                        o = F.scaled_dot_product_attention(qq[:, :, c0:c1], kk[:, :, :hi], vv[:, :, :hi],
                                                           attn_mask=causal_lower_right(c1 - c0, hi), scale=scale,
                                                           enable_gqa=rep > 1)
                    out[r[:, c0:c1].reshape(-1)] = o.transpose(1, 2).reshape(B * (c1 - c0), Hq, -1)
        return out

    def relative(self, layer: int, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        self._no_prefix("relative attention")
        self.cache.write(layer, k, v, self.slot_mapping)
        if self._relative is None:  # one per pass: it keeps the pass's block masks
            self._relative = PackedRelativeAttention(self.doc_lengths, self.positions, backend=self.relative_backend)
        return self._relative(q, k, v, profiles, sinks, spec, scale)

    def store_index_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Keep the pass's raw QSA index keys ``[T, d]`` in the cache (read by later decode steps)."""
        self._no_prefix("the QSA indexer")
        self.cache.write_rows(layer, INDEX_KEYS, keys, self.slot_mapping)

    def index_keys(self, layer: int, keys: torch.Tensor) -> list[torch.Tensor]:
        """Every sequence's raw index keys so far (``[n_i, d]``, packed order): the pass's own."""
        return list(keys.split(self.doc_lengths))


INDEX_KEYS = "index_keys"


def gather_pages(
    pages: torch.Tensor, block_table: torch.Tensor, first: torch.Tensor | None = None, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens in pages ``first[b] .. first[b] + count - 1`` of each row's block table (all its
    pages by default): ``[B, count * page, ...]`` and their positions ``[B, count * page]``. Columns
    past the table read the scratch page; their positions lie beyond any cached token."""
    B, W = block_table.shape
    ps = pages.shape[1]
    device = pages.device
    count = W if count is None else count
    cols = torch.arange(count, device=device)[None].expand(B, -1)
    if first is not None:
        cols = cols + first.to(device).long()[:, None]
    table = block_table.to(device).long().gather(1, cols.clamp(max=W - 1))
    table = torch.where(cols < W, table, SCRATCH_PAGE)
    x = pages[table].reshape(B, count * ps, *pages.shape[2:])
    pos = (cols[:, :, None] * ps + torch.arange(ps, device=device)).reshape(B, count * ps)
    return x, pos


def masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over gathered keys: q ``[B, Hq, D]``, k/v ``[B, L, Hkv, D]``, ``valid``
    ``[B, L]`` -> ``[B, Hq, Dv]`` (a masked softmax in fp32, as :func:`paged_decode_torch`)."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhrd,blhd->bhrl", qg, k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhrl,blhd->bhrd", probs, v.float())
    return out.reshape(B, Hq, -1).to(q.dtype)


def relative_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    profiles: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    spec: RelativeAttentionSpec,
    scale: float,
) -> torch.Tensor:
    """Relative-bias attention with sinks of one query per row over gathered keys (the batched form
    of :func:`~ember.core.layers.relative_attention.relative_attention_dense`, same numerics): q
    ``[B, Hq, D]`` at ``q_pos`` ``[B]``; k/v ``[B, L, Hkv, D]`` at ``k_pos`` ``[B, L]``; profiles
    ``[B, Hq, R]``; sinks ``[B, Hq]`` -> ``[B, Hq, Dv]``."""
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    R = spec.rel_extent
    scores = torch.einsum("bhrd,blhd->bhrl", q.view(B, Hkv, rep, D), k.to(q.dtype)).reshape(B, Hq, L) * scale
    dist = q_pos.long()[:, None] - k_pos  # [B, L]
    bias = profiles.gather(-1, dist.clamp(0, R - 1)[:, None, :].expand(B, Hq, L))
    scores = scores + bias.masked_fill(((dist < 0) | (dist >= R))[:, None], 0.0)
    masked = dist < 0
    if spec.window is not None:
        masked = masked | (dist >= spec.window)
    scores = scores.masked_fill(masked[:, None], float("-inf"))
    logits = torch.cat([scores, sinks[:, :, None].to(scores.dtype)], dim=-1).float()
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    out = torch.einsum("bhrl,blhd->bhrd", probs.view(B, Hkv, rep, L), v.to(q.dtype))
    return out.reshape(B, Hq, -1)


class DecodeAttention:
    """``ForwardContext.attend`` of a decode pass (one token per sequence): store the new keys and
    values, then attend over each sequence's cached tokens (``seq_lens`` includes the new one).

    All inputs are tensors, so the same object serves a captured CUDA graph whose buffers are
    refilled between replays (plain attention, and Inkling-2's ``relative(...)`` through the Triton
    kernel: relative bias by distance and the sink, over the last ``window`` positions on sliding
    layers; without Triton only the pages that hold them are gathered), and a QSA block
    ``selection`` (``accepts_selection``: the selected blocks plus the query's tail, through the
    kernel, which reads only those; without Triton a gather of the pages and a masked softmax).
    ``store_index_keys`` / ``index_keys`` keep and read the QSA indexer's raw keys in the pages.

    ``fixed_selection`` (the static decoder): the QSA indexer reads the index keys as one table
    (:meth:`index_key_table`) and selects for all rows at once, with no host data.

    ``prefix`` (:func:`shared_prefix_groups` on the device): plain attention without a window
    reads each group's shared prefix once for the group (cascade attention, Triton only).
    """

    accepts_selection = True

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        fixed_selection: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.fixed_selection = fixed_selection
        self.prefix = prefix

    def __call__(
        self, layer: int, q, k, v, spec: AttentionSpec, scale: float, selection: BlockSelection | None = None
    ) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        if selection is None:
            window = _window(spec)
            return paged_decode_attention(
                q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale, window,
                prefix=None if window else self.prefix,
            )
        if _window(spec):
            raise NotImplementedError("a QSA block selection on a sliding-window layer")
        out = _decode_triton_or_none(
            q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale,
            selected=selection.blocks, select_block=selection.block_size,
        )
        if out is not None:
            return out
        keys, _ = gather_pages(self.cache.k[layer], self.block_table)
        values, _ = gather_pages(self.cache.v[layer], self.block_table)
        valid = selection.token_mask(slice(None), keys.shape[1])  # causal, selected blocks + tail
        return masked_decode(q, keys, values, valid, scale)

    def relative(self, layer: int, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        out = _decode_triton_or_none(
            q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale, spec.window or 0,
            profiles=profiles, sinks=sinks,
        )
        if out is not None:
            return out
        q_pos = self.seq_lens.long() - 1
        first = count = None
        if spec.window is not None:
            ps = self.cache.page_size
            first = (q_pos - spec.window + 1).clamp(min=0) // ps
            # positions q_pos - window + 1 .. q_pos span at most this many pages
            count = min(self.block_table.shape[1], (spec.window + ps - 2) // ps + 1)
        keys, k_pos = gather_pages(self.cache.k[layer], self.block_table, first, count)
        values, _ = gather_pages(self.cache.v[layer], self.block_table, first, count)
        return relative_decode(q, keys, values, k_pos, profiles, sinks, q_pos, spec, scale)

    def store_index_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Keep the new tokens' raw QSA index keys ``[B, d]`` in the cache."""
        self.cache.write_rows(layer, INDEX_KEYS, keys, self.slot_mapping)

    def index_keys(self, layer: int, keys: torch.Tensor) -> list[torch.Tensor]:
        """Every sequence's raw index keys so far (``[n_i, d]``, the new token's included)."""
        rows = self.index_key_table(layer)
        return [rows[b, :n] for b, n in enumerate(self.seq_lens.tolist())]

    def index_key_table(self, layer: int, tokens: int | None = None) -> torch.Tensor:
        """Every row's raw index keys ``[B, L, d]``: the pages of the block table's first columns
        that hold ``tokens`` positions (all of them by default); row ``b``'s first ``seq_lens[b]``
        are its own, the new token's included."""
        table = self.block_table
        if tokens is not None:
            table = table[:, : min(table.shape[1], -(-tokens // self.cache.page_size))]
        return gather_pages(self.cache.rows[(layer, INDEX_KEYS)], table)[0]
