"""Decode attention over the paged KV cache in Triton (flash-decoding), with cascade attention for
prefixes that several rows share.

* :func:`paged_decode_triton`: programs per (sequence, group of KV heads, split of the sequence)
  walk 64 keys at a time across pages with an online softmax, the query heads of the group's KV
  heads in one ``tl.dot`` (another head's keys masked), reading each cached key once; a second
  small kernel merges the splits. Grid and scratch depend only on shapes (batch, heads,
  block-table width), so a decode step can be captured in a CUDA graph. Options: Inkling-2's
  relative bias and sinks, a sliding window, a QSA block selection (only the chosen blocks and
  the tail are read).
* ``prefix`` (cascade attention): rows that share their first tokens' pages (the prefix index's or
  a fork's: an RL group's samples) are listed in groups
  (:func:`ember.core.sampling.attention.shared_prefix_groups`); a first kernel attends each group's
  queries over the shared prefix together, reading it once for the group, and the split kernel
  continues each row's softmax over its own tokens.

:mod:`ember.core.sampling.attention` dispatches here on CUDA (and under ``TRITON_INTERPRET=1``) and
keeps the PyTorch reference.
"""

from __future__ import annotations

import functools

import torch

from ember.core.kernels import fused, pdl

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
    def _block_scores(q, k_base, bt_base, pos, valid, k_off, d, dmask, qk_scale, stride_kp, stride_ks,
                      PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """The scores (base 2) of the queries ``q`` against the keys at positions ``pos`` (a block;
        each token's page from the block table, ``k_off`` its head's offset), and each token's page
        and slot."""
        page = tl.load(bt_base + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        k_row = page * stride_kp + slot * stride_ks + k_off
        k = tl.load(k_base + k_row[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale, page, slot

    @triton.jit
    def _softmax_step(scores, visible, valid, page, slot, m, lsum, acc, v_base, v_off, dv, dvmask, stride_vp,
                      stride_vs, DOT_PRECISION: tl.constexpr):
        """The online softmax's step over one block of ``scores`` (only the ``visible`` ones count):
        the running max, sum and unnormalised output with the block's values added (the ``valid``
        tokens' rows of it, ``v_off`` their head's offset)."""
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        lsum = lsum * alpha + tl.sum(prob, axis=1)
        v_row = page * stride_vp + slot * stride_vs + v_off
        v = tl.load(v_base + v_row[:, None] + dv[None, :], mask=valid[:, None] & dvmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, lsum, acc

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
        REP_P: tl.constexpr,
        HEADS: tl.constexpr,
        HKV: tl.constexpr,
        M_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRE_BLOCK_N: tl.constexpr,
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
        """One program per (sequence, HEADS of its KV heads, split): the split's share of the
        sequence's visible tokens, BLOCK_N at a time (any number of pages: each token's page comes
        from the block table), online softmax in fp32 (base 2).

        The tile's rows are the query heads of the program's KV heads (``REP`` each, padded to
        ``REP_P``; ``M_PAD`` rows, at least tl.dot's 16), its columns the block's tokens of each KV
        head (``HEADS * BLOCK_N``): one ``tl.dot`` scores every query head against every key of
        the block, and the scores of another head's keys are masked, so each program reads each
        cached key once and the query heads of several KV heads fill the rows that one KV head's
        few would leave as padding. Several heads a program make fewer, longer programs: a short
        sequence's few blocks become one pipelined loop instead of a program's whole latency each.

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
        :func:`_shared_prefix_kernel` (the grid before this one, ``PRE_BLOCK_N`` tokens a step)
        attended for all of them at once, leaving partials in slots ``NUM_SPLITS ..`` of ``SLOTS``
        per row and head; this program walks the rest. With one split it starts from the prefix's
        partials and finishes the row; with several, each split leaves its partial too and the
        combine kernel merges them all."""
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        n = tl.load(LENS + b)
        extent = _decode_extent(n, sel_span)
        pre = 0
        if HAS_PREFIX:
            pre = tl.load(PRE + b)
        start, first, nblk, per, active = _decode_split_range(extent, window, pre, BLOCK_N, NUM_SPLITS)
        i = tl.arange(0, M_PAD)  # tile rows: (KV head of the program, query head of it)
        hk = group * HEADS + i // REP_P
        r = i % REP_P
        rmask = (r < REP) & (i < HEADS * REP_P) & (hk < HKV)
        heads = hk * REP + r
        c = tl.arange(0, HEADS * BLOCK_N)  # tile columns: (KV head of the program, token of the block)
        hk_c = group * HEADS + c // BLOCK_N
        tok = c % BLOCK_N
        hk_c = tl.minimum(hk_c, HKV - 1).to(tl.int64)  # a head past the last is read but seen by no row
        k_off = hk_c * stride_kh
        v_off = hk_c * stride_vh
        own = (i // REP_P)[:, None] == (c // BLOCK_N)[None, :]  # a query head sees its own KV head's keys
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        dmask = d < D
        dvmask = dv < DV
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=rmask[:, None] & dmask[None, :], other=0.0).to(K.dtype.element_ty)
        bt_base = BT + b.to(tl.int64) * stride_bt
        m = tl.full([M_PAD], -1e30, tl.float32)
        lsum = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, DV_PAD], tl.float32)
        if HAS_PREFIX and NUM_SPLITS == 1:  # continue the online softmax from the prefix's partials
            _, _, _, _, shared = _decode_split_range(pre, 1 << 30, 0, PRE_BLOCK_N, PRE_SPLITS)
            part = (b * (REP * HKV) + heads).to(tl.int64) * SLOTS + NUM_SPLITS
            for j in range(PRE_SPLITS):
                # scalar conditions become row limits (the interpreter cannot AND a tensor and a scalar)
                ok = rmask & (i < tl.where((pre > 0) & (j < shared), M_PAD, 0))
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
                # int32: Triton 3.6 fails to compile this loop (RemoveLayoutConversions) with int64 positions
                chosen = tl.load(SEL + b.to(tl.int64) * stride_selb + pos // sel_block, mask=valid & in_list,
                                 other=-1).to(tl.int32)
                virtual = pos
                pos = tl.where(in_list, chosen * sel_block + virtual % sel_block,
                               n // sel_block * sel_block + virtual - listed)
                valid = valid & tl.where(in_list, chosen >= 0, pos < n)
            scores, page, slot = _block_scores(q, K, bt_base, pos, valid, k_off, d, dmask, qk_scale, stride_kp,
                                               stride_ks, PAGE, DOT_PRECISION)  # [M_PAD, HEADS * BLOCK_N]
            visible = own & valid[None, :]
            if HAS_BIAS:
                dist = n - 1 - pos
                near = visible & (dist < rel_extent)[None, :]
                p_ptr = P + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + dist[None, :]
                bias = tl.load(p_ptr, mask=rmask[:, None] & near, other=0.0)
                scores += bias.to(tl.float32) * 1.4426950408889634  # base 2, as qk_scale
            m, lsum, acc = _softmax_step(scores, visible, valid, page, slot, m, lsum, acc, V, v_off, dv, dvmask,
                                         stride_vp, stride_vs, DOT_PRECISION)
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
            done = rmask & (i < tl.where(merged, 0, tl.where(split == 0, M_PAD, 0)))  # finished by this program
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=done[:, None] & dvmask[None, :])
            part = rmask & (i < tl.where(merged, tl.where(split < active, M_PAD, 0), 0))  # a partial to merge
            row = (b * (REP * HKV) + heads).to(tl.int64) * SLOTS + split  # [B, Hq, SLOTS]
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
        PRE_BLOCK_N: tl.constexpr,
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
            _, _, _, _, shared = _decode_split_range(pre, 1 << 30, 0, PRE_BLOCK_N, PRE_SPLITS)
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
        PRE_BLOCK_N: tl.constexpr,
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
        _, first, nblk, per, active = _decode_split_range(n, 1 << 30, 0, PRE_BLOCK_N, PRE_SPLITS)
        i = tl.arange(0, MB * REP_P)
        r = i % REP_P
        row = tl.load(mem_base + chunk * MB + i // REP_P)
        live = (row >= 0) & (r < REP)
        row = tl.maximum(row, 0).to(tl.int64)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        tok = tl.arange(0, PRE_BLOCK_N)
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
            pos = blk * PRE_BLOCK_N + tok
            valid = pos < n
            scores, page, slot = _block_scores(q, k_base, bt_base, pos, valid, 0, d, dmask, qk_scale, stride_kp,
                                               stride_ks, PAGE, DOT_PRECISION)  # [MB * REP_P, PRE_BLOCK_N]
            m, lsum, acc = _softmax_step(scores, valid[None, :], valid, page, slot, m, lsum, acc, v_base, 0, dv,
                                         dvmask, stride_vp, stride_vs, DOT_PRECISION)
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
# the split kernel's launch; ``heads``: KV heads a program takes, None to choose by the shapes
# (:func:`_decode_heads`; module-level so ``bench/gpu_checks.py paged_decode --sweep`` can sweep it)
_DECODE_LAUNCH = {"num_warps": 4, "num_stages": 2, "heads": None}
PREFIX_GROUP = 16  # rows a prefix group lists (a larger group is listed as several)
# the prefix kernel's launch: query heads a program takes (MB rows of the group times their REP) and
# warps/stages (module-level so ``bench/gpu_checks.py shared_prefix_decode --sweep`` can sweep them;
# on an H100 this choice was the fastest of 16/32/64 heads x 4/8 warps x 2/3 stages, by 1-20 %)
_PREFIX_LAUNCH = {"rows": 32, "num_warps": 4, "num_stages": 2}


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: size the grid as for an H100/H200


def _decode_block_n(d_pad: int, dv_pad: int) -> int:
    """Keys per iteration (of all a program's KV heads together): 64 for head dims up to 128, fewer
    for wider heads (register budget)."""
    widest = max(d_pad, dv_pad)
    return 64 if widest <= 128 else 32 if widest <= 256 else 16


def _decode_heads(batch: int, kv_heads: int, rep: int, cols: int, device: torch.device) -> int:
    """KV heads a split-kernel program takes (a power of two): enough that their query heads fill
    the tile's 16 rows (``16 // rep``; at most ``cols // 16``, so each head keeps 16 of a step's
    ``cols`` keys), as long as the (sequence, head group) pairs still make 3 programs per SM on
    their own. Where they would not, fewer heads a program keep the grid full without splitting the
    sequences (a split costs a merge).

    Measured on an H100 (Hq=32, Hkv=8, D=128, bf16; ``gpu_checks.py paged_decode --sweep``): at 256
    sequences 4 heads a program (512 programs) were 1-6 % faster than one; at 64 sequences one head
    was 4-25 % faster than 2 or 4 with the splits they need; at one sequence, within noise."""
    if _DECODE_LAUNCH["heads"]:
        return max(1, min(_DECODE_LAUNCH["heads"], _pow2(kv_heads)))
    heads = 1
    most = min(cols // 16, 16 // _pow2(rep), kv_heads)
    while heads * 2 <= most and batch * -(-kv_heads // (heads * 2)) >= 3 * _sm_count(device):
        heads *= 2
    return heads


def _decode_launch(batch: int, kv_heads: int, rep: int, cols: int, longest: int,
                   device: torch.device) -> tuple[int, int, int]:
    """The split kernel's launch for ``batch`` sequences of at most ``longest`` tokens: KV heads a
    program (:func:`_decode_heads`), each head's tokens a step (``cols`` shared among them) and the
    splits of the sequence axis (:func:`_decode_num_splits`, over the programs' head groups)."""
    heads = _decode_heads(batch, kv_heads, rep, cols, device)
    block_n = max(1, cols // heads)
    return heads, block_n, _decode_num_splits(batch, -(-kv_heads // heads), longest, block_n, device)


def _decode_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits of the sequence axis: as many as keep the grid within one wave of ~4 programs per SM
    (none once ``batch * kv_heads`` fills that alone; ``kv_heads``: a sequence's programs), at most one per two BLOCK_N blocks of the
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
    Optional (Inkling-2, :func:`ember.core.sampling.attention.relative_decode`'s contract):
    ``profiles`` ``[B, Hq, R]``, a bias by distance back from the query (``R`` nearest keys), and
    ``sinks`` ``[B, Hq]``, a logit without a value. ``selected`` ``[B, C]`` (QSA: block numbers of ``select_block`` tokens,
    ``-1``: none; distinct, complete blocks): only the keys of those blocks and those after the
    query's last complete block are visible, and only they are read (``C + 1`` blocks a row).
    ``prefix`` (cascade attention; no window, bias, sink or selection): ``(lens [B], members [G,
    PREFIX_GROUP])`` from :func:`ember.core.sampling.attention.shared_prefix_groups`: the rows of a group share their first
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
    cols = _decode_block_n(d_pad, dv_pad)  # keys a step; the prefix kernel's tokens a step
    sel_span = (selected.shape[1] + 1) * int(select_block) if selected is not None else 0
    heads, block_n, splits = _decode_launch(B, Hkv, rep, cols, sel_span or block_table.shape[1] * page, q.device)
    num_splits = max(1, int(splits if num_splits is None else num_splits))
    pre_splits = mb = 0
    if prefix is not None:
        if window or profiles is not None or sinks is not None or selected is not None:
            raise ValueError("a shared prefix is attended apart only without a window, bias, sink or selection")
        mb = min(PREFIX_GROUP, max(1, _PREFIX_LAUNCH["rows"] // _pow2(rep)))  # rows of a group a program takes
        if mb < 2:
            prefix = None  # one row a program (many query heads a KV head): nothing read once for several
    if prefix is not None:
        pre_splits = _decode_num_splits(max(1, B // PREFIX_GROUP), Hkv, block_table.shape[1] * page, cols, q.device)
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
    launch = {"D": D, "D_PAD": d_pad, "DV": Dv, "DV_PAD": dv_pad, "PAGE": page, "PRE_BLOCK_N": cols,
              "NUM_SPLITS": num_splits, "PRE_SPLITS": max(pre_splits, 1), "SLOTS": slots,
              "DOT_PRECISION": "ieee" if k_pages.dtype == torch.float32 else "tf32"}
    if prefix is not None and members.shape[0]:
        _shared_prefix_kernel[(members.shape[0] * (PREFIX_GROUP // mb), Hkv, pre_splits)](
            q, k_pages, v_pages, acc, ml, block_table, pre, members,
            float(scale) * _LOG2E,
            q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            block_table.stride(0), members.stride(0),
            REP=rep, REP_P=_pow2(rep), MB=mb, GROUP=PREFIX_GROUP,
            num_warps=_PREFIX_LAUNCH["num_warps"], num_stages=_PREFIX_LAUNCH["num_stages"],
            **launch, **pdl.options(),
        )
    _paged_decode_kernel[(B, -(-Hkv // heads), num_splits)](
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
        REP_P=_pow2(rep),
        HEADS=heads,
        HKV=Hkv,
        M_PAD=max(16, heads * _pow2(rep)),
        BLOCK_N=block_n,
        HAS_BIAS=profiles is not None,
        HAS_SINK=sinks is not None,
        HAS_SELECT=selected is not None,
        HAS_PREFIX=prefix is not None,
        **launch,
        num_warps=_DECODE_LAUNCH["num_warps"],
        num_stages=_DECODE_LAUNCH["num_stages"],
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
            PRE_BLOCK_N=cols,
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
