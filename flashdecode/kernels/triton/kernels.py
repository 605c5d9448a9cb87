"""The Triton split and combine kernels (``docs/design.md``, "Semantics"; the schedule is the
planner's, see ``schedule``).

Split kernel, grid (P, Hk, row tiles): program (p, h, t) finds its sequence and key blocks with
the planner's rule, loads BLOCK_M packed query rows (r = i * GROUP + g) of KV head h, and streams
its blocks once. The main loop (software-pipelined) takes the blocks whose keys are cached and seen
by every row, with only a column mask for the range's ends, as the plain kernel always did; blocks
that need per-row masks (a window starts or ends inside them) or hold appended tokens go through a
second, masked loop, compiled only when the problem has windows or appended tokens. A sequence
served by one program writes out/lse; the others write float32 partials that the combine kernel
merges. Bad values (lengths, left pads, batch indices, block ids) are clamped for every access and
make the program's rows NaN. fp8 caches (FP8): the program's k descale multiplies the score scale
(and the softcap's inner factor), its v descale the output, before any partial is written; a
bfloat16 q is converted to float16 once (after rotary), each row scaled by a power of two that the
row's score factors undo (``attend.fp16_rows``), so both products take float16 operands.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attend import (LOG2E, append_tokens, attend_block, bad_block_ids, fp16_rows, rotary_columns, rotate,
                     row_offsets, tile_mask)
from .launch import gdc_launch_dependents, gdc_wait
from .schedule import entry, key_range, locate, query_rows, split_counts

LN2 = tl.constexpr(1.0 / LOG2E.value)

#: Runtime ints whose values must not multiply compiled kernels (Triton would specialise 1 and
#: multiples of 16): the schedule's counts and the features' sizes.
_RUNTIME_INTS = ["batch", "capacity", "num_programs", "forced_splits", "min_chunk", "seqlen_new", "window_left",
                 "window_right", "cache_rows", "rotary_rows", "total_q"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def split_kernel(Q, K, V, Lens, Out, Lse, PartO, PartLse, KNew, VNew, BatchIdx, LeftPad, BlockTable, Cos, Sin, Alibi,
                 Tickets, KDescale, VDescale, Sinks, CuSeqlensQ, scale_log2, softcap_in, softcap_out,
                 batch, capacity, num_programs, forced_splits, min_chunk,
                 seqlen_new, window_left, window_right, cache_rows, rotary_rows, total_q,
                 stride_qb, stride_qi, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_ob, stride_oi, stride_oh, stride_nkb, stride_nkt, stride_nkh, stride_nvb, stride_nvt,
                 stride_nvh, stride_table, stride_alibi, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                 GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BATCH_PAD: tl.constexpr, CAN_SPLIT: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, OFFSETS_32: tl.constexpr, APPEND: tl.constexpr, ROTARY_DIM: tl.constexpr,
                 ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_ROW: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                 WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LEFTPAD: tl.constexpr,
                 BATCH_IDX: tl.constexpr, MERGE_IN_SPLIT: tl.constexpr, MERGE_STEP: tl.constexpr,
                 DEPENDENT_COMBINE: tl.constexpr, FP8: tl.constexpr, SINKS: tl.constexpr, RAGGED: tl.constexpr,
                 FP8_V_WORDS: tl.constexpr):
    if DEPENDENT_COMBINE:  # the combine may be scheduled once every program has started
        gdc_launch_dependents()
    pid = tl.program_id(0)
    head_k = tl.program_id(1)
    tile = tl.program_id(2)
    seq, split, num_splits, raw_len = locate(
        Lens, LeftPad, CuSeqlensQ, pid, batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new,
        window_left, total_q, SEQLEN_Q, APPEND, LEFTPAD, WINDOW_LEFT, BLOCK_N, BATCH_PAD, CAN_SPLIT, RAGGED)
    if seq < batch:
        # Ragged: the sequence's packed rows [q_first, q_first + q_len) of q and out (q_first 0 else).
        q_first, q_len, rows_valid = query_rows(CuSeqlensQ, seq, seq < batch, total_q, SEQLEN_Q, RAGGED)
        new_len = seqlen_new
        if RAGGED:
            new_len = q_len  # appending, the sequence's own rows of k/v
        # Out-of-range values are clamped (no stray access) and flagged with NaN rows.
        if APPEND:
            valid = (raw_len >= 0) & (raw_len <= capacity - new_len)
        else:
            valid = (raw_len >= 0) & (raw_len <= capacity)
        if RAGGED:
            valid = valid & rows_valid
        leftpad = 0
        if LEFTPAD:
            leftpad = tl.load(LeftPad + seq)
            valid = valid & (leftpad >= 0) & (leftpad <= raw_len)
        lo, hi = key_range(raw_len, leftpad, new_len, capacity, window_left, q_len, APPEND, LEFTPAD, WINDOW_LEFT)
        writable = True  # the cache row the appended tokens go to is this sequence's own
        # 64-bit head and row offsets: a cache can exceed 2^31 elements, and so can a strided view's
        # offsets (pages are addressed in 32 bits where OFFSETS_32 says they fit, ``cache_offsets``).
        if PAGE_SIZE > 0:
            table_row = BlockTable + seq * stride_table
            k_head = K + head_k.to(tl.int64) * stride_kh
            v_head = V + head_k.to(tl.int64) * stride_vh
        else:
            table_row = BlockTable
            cache_row = seq
            if BATCH_IDX:
                cache_row = tl.load(BatchIdx + seq)
                writable = (cache_row >= 0) & (cache_row < cache_rows)
                valid = valid & writable
                cache_row = tl.minimum(tl.maximum(cache_row, 0), cache_rows - 1)
            k_head = K + cache_row.to(tl.int64) * stride_kb + head_k.to(tl.int64) * stride_kh
            v_head = V + cache_row.to(tl.int64) * stride_vb + head_k.to(tl.int64) * stride_vh
        bad = tl.zeros([], tl.int32)  # a bad block id was used
        k_scale = 1.0
        v_scale = 1.0
        if FP8:  # the descales of (sequence, KV head)
            k_scale = tl.load(KDescale + seq * stride_kdb + head_k * stride_kdh)
            v_scale = tl.load(VDescale + seq * stride_vdb + head_k * stride_vdh)
            scale_log2 = scale_log2 * k_scale
            if SOFTCAP:
                softcap_in = softcap_in * k_scale
        k_new = KNew
        v_new = VNew
        new_from = hi
        if APPEND:
            # (ragged: stride_nkb is 0 and the rows start at q_first)
            k_new = KNew + seq.to(tl.int64) * stride_nkb + q_first * stride_nkt + head_k * stride_nkh
            v_new = VNew + seq.to(tl.int64) * stride_nvb + q_first * stride_nvt + head_k * stride_nvh
            new_from = raw_len
            # One writer per (sequence, KV head), none into another sequence's cache row (a bad batch
            # index); readers take the new tokens from k_new, so no program reads what it writes.
            if (tile == 0) & (split == 0) & writable:
                bad = append_tokens(k_head, v_head, table_row, cache_rows, stride_kb, stride_kt, stride_vb, stride_vt,
                                    k_new, v_new, stride_nkt, stride_nvt, Cos, Sin, rotary_rows,
                                    raw_len, new_len, capacity, k_scale, v_scale,
                                    PAGE_SIZE, ROTARY_DIM, ROTARY_INTERLEAVED, FP8, HEAD_DIM, HEAD_PAD, BLOCK_N)

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_live = rows < GROUP * q_len
        d = tl.arange(0, HEAD_PAD)
        q_ptrs = Q + seq * stride_qb + q_first * stride_qi + row_offsets(rows, head_k, stride_qi, stride_qh, GROUP,
                                                                         SEQLEN_Q)[:, None]
        q = tl.load(q_ptrs + d[None, :], mask=tile_mask(row_live, d, HEAD_DIM, HEAD_PAD), other=0.0)
        if ROTARY_DIM > 0:
            partner, column, sign, rotated = rotary_columns(ROTARY_DIM, ROTARY_INTERLEAVED, HEAD_PAD)
            rotating = row_live[:, None] & rotated[None, :]
            q_partner = tl.load(q_ptrs + partner[None, :], mask=rotating, other=0.0)
            positions = raw_len + rows * 0
            if ROTARY_PER_ROW:
                positions += rows // GROUP
            q = rotate(q, q_partner, positions, Cos, Sin, rotary_rows, column, sign, rotating, ROTARY_DIM).to(q.dtype)
        # The scores' factors: one number, or a (BLOCK_M, 1) column where q's rows were scaled into float16.
        row_scale_log2, row_softcap_in = scale_log2, softcap_in
        if FP8:
            if q.dtype != tl.float16:  # products in float16: fp8 pairs convert in one instruction
                q, row_factor = fp16_rows(q)
                row_scale_log2 = (scale_log2 * row_factor)[:, None]
                if SOFTCAP:
                    row_softcap_in = (softcap_in * row_factor)[:, None]
        row_pos = hi - q_len + rows // GROUP  # absolute position of each row's query
        slopes = 0.0
        if ALIBI == 1:
            slopes = tl.load(Alibi + head_k * GROUP + rows % GROUP, mask=row_live, other=0.0) * LOG2E
        elif ALIBI == 2:
            slopes = tl.load(Alibi + seq * stride_alibi + head_k * GROUP + rows % GROUP, mask=row_live,
                             other=0.0) * LOG2E

        # Blocks [block_lo, block_hi) of the split; keys [start, end) of them are read.
        blocks = tl.cdiv(hi, BLOCK_N)
        first = 0
        if LEFTPAD or WINDOW_LEFT:
            first = lo // BLOCK_N
            blocks -= first
        block_lo = (first + split * blocks // num_splits) * BLOCK_N
        block_hi = (first + (split + 1) * blocks // num_splits) * BLOCK_N
        start = block_lo
        if LEFTPAD or WINDOW_LEFT:
            start = tl.maximum(block_lo, lo)
        end = tl.minimum(block_hi, hi)
        if LEFTPAD:  # a left pad at the length leaves one block without keys: skip it
            block_hi = tl.where(start < end, block_hi, block_lo)
        if RAGGED:  # a row tile past the sequence's own rows reads no block
            block_hi = tl.where(tile * BLOCK_M < GROUP * q_len, block_hi, block_lo)
            end = tl.minimum(block_hi, end)
        # The main loop's blocks [main_lo, main_hi): cached keys every row sees (a column mask drops
        # those outside [start, end)); the others need per-row masks or appended tokens.
        main_lo = block_lo
        if WINDOW_LEFT:  # head: a row's window starts inside these blocks
            main_lo = tl.minimum(tl.cdiv(tl.maximum(start, hi - 1 - window_left), BLOCK_N) * BLOCK_N, block_hi)
        main_hi = block_hi
        if APPEND or WINDOW_RIGHT:  # tail: appended tokens, or a row's window ends inside these blocks
            whole_to = end
            if APPEND:
                whole_to = tl.minimum(whole_to, new_from)
            if WINDOW_RIGHT:
                whole_to = tl.minimum(whole_to, hi - q_len + window_right + 1)
            main_hi = tl.maximum(whole_to // BLOCK_N * BLOCK_N, main_lo)

        if PAGE_SIZE > 0:
            bad = bad | bad_block_ids(table_row, start, end, cache_rows, PAGE_SIZE)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        if FP8_V_WORDS:  # V as 16-bit words: the even and the odd head dims in two accumulators
            acc = (tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32), tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32))
        else:
            acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for block_start in range(main_lo, main_hi, BLOCK_N):
            acc, m, l = attend_block(
                acc, m, l, q, block_start, start, end, new_from, k_head, v_head, table_row, cache_rows,
                stride_kb, stride_kt, stride_vb, stride_vt, k_new, v_new, stride_nkt, stride_nvt, Cos, Sin,
                rotary_rows, row_pos, slopes, window_left, window_right, row_scale_log2, row_softcap_in, softcap_out,
                k_scale, v_scale, False, PAGE_SIZE, OFFSETS_32, APPEND, ROTARY_DIM, ROTARY_INTERLEAVED, WINDOW_LEFT,
                WINDOW_RIGHT, SOFTCAP, ALIBI, LEFTPAD, FP8, HEAD_DIM, HEAD_PAD, BLOCK_N, FP8_V_WORDS)
        if FP8_V_WORDS:  # dims 2j and 2j + 1 side by side
            acc = tl.reshape(tl.join(acc[0], acc[1]), [BLOCK_M, HEAD_PAD])
        if WINDOW_LEFT or WINDOW_RIGHT or APPEND:  # the head [block_lo, main_lo), then the tail [main_hi, block_hi)
            head_blocks = (main_lo - block_lo) // BLOCK_N
            # Not pipelined: a second pipeline's buffers and registers cost the main loop occupancy
            # (on the H200, 186 against 233 us for case 12 with seqlen_q = 4).
            for i in tl.range(0, head_blocks + (block_hi - main_hi) // BLOCK_N, num_stages=1):
                block_start = tl.where(i < head_blocks, block_lo + i * BLOCK_N, main_hi + (i - head_blocks) * BLOCK_N)
                acc, m, l = attend_block(
                    acc, m, l, q, block_start, start, end, new_from, k_head, v_head, table_row, cache_rows,
                    stride_kb, stride_kt, stride_vb, stride_vt, k_new, v_new, stride_nkt, stride_nvt, Cos, Sin,
                    rotary_rows, row_pos, slopes, window_left, window_right, row_scale_log2, row_softcap_in,
                    softcap_out, k_scale, v_scale, True, PAGE_SIZE, OFFSETS_32, APPEND, ROTARY_DIM, ROTARY_INTERLEAVED,
                    WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, LEFTPAD, FP8, HEAD_DIM, HEAD_PAD, BLOCK_N,
                    False)

        if SINKS:
            if num_splits == 1:  # the sink joins the denominator here; split, the merge adds it once
                acc, m, l = fold_sink(acc, m, l, Sinks, head_k, rows, row_live, GROUP)
        # Only l == 0 means "no key": a NaN in the data makes l NaN, and NaN must come out.
        empty = l == 0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
        if FP8:
            o = o * v_scale
        o = tl.where(valid & (bad == 0), o, float("nan"))
        lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
        stored = tile_mask(row_live, d, HEAD_DIM, HEAD_PAD)
        if num_splits == 1:
            store_output(Out, Lse, o, lse2, seq, head_k, rows, row_live, d, stride_ob, stride_oi, stride_oh, q_first,
                         total_q, GROUP, SEQLEN_Q, HEAD_DIM, HEAD_PAD, RAGGED)
        else:
            part = (pid * tl.num_programs(1) + head_k) * (GROUP * SEQLEN_Q) + rows
            tl.store(PartO + part[:, None] * HEAD_DIM + d[None, :], o, mask=stored)
            tl.store(PartLse + part, lse2, mask=row_live)
            if MERGE_IN_SPLIT:
                merge_if_last(Tickets, PartO, PartLse, Out, Lse, Sinks, seq, head_k, tile, pid - split, num_splits,
                              rows, row_live, d, stride_ob, stride_oi, stride_oh, q_first, total_q, GROUP, SEQLEN_Q,
                              HEAD_DIM, HEAD_PAD, BLOCK_M, MERGE_STEP, SINKS, RAGGED)


@triton.jit
def fold_sink(acc, m, l, Sinks, head_k, rows, row_live, GROUP: tl.constexpr):
    """The online softmax state (acc, m, l) with each row's sink logit (its query head's, read here,
    in base 2) in its denominator: a key of that score and value 0. A row whose max and sink are
    both -inf keeps l = 0 (no key)."""
    sink = tl.load(Sinks + head_k * GROUP + rows % GROUP, mask=row_live, other=float("-inf")) * LOG2E
    m_new = tl.maximum(m, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    return acc * alpha[:, None], m_new, l * alpha + tl.exp2(sink - m_safe)


@triton.jit
def store_output(Out, Lse, o, lse2, seq, head_k, rows, row_live, d, stride_ob, stride_oi, stride_oh, q_first, total_q,
                 GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                 RAGGED: tl.constexpr):
    """A row tile's output (its real rows and head dims) and its lse (base 2 in, natural log out;
    lse (B, Hq, Sq), ragged (Hq, total_q) with the sequence's rows from q_first). The grid's
    dimension 1 is the KV heads."""
    out_rows = seq * stride_ob + q_first * stride_oi + row_offsets(rows, head_k, stride_oi, stride_oh, GROUP, SEQLEN_Q)
    tl.store(Out + out_rows[:, None] + d[None, :], o.to(Out.dtype.element_ty),
             mask=tile_mask(row_live, d, HEAD_DIM, HEAD_PAD))
    if RAGGED:
        lse_rows = (head_k * GROUP + rows % GROUP) * total_q + q_first + rows // GROUP
    elif SEQLEN_Q == 1:
        lse_rows = seq * tl.num_programs(1) * GROUP + head_k * GROUP + rows
    else:
        lse_rows = (seq * tl.num_programs(1) * GROUP + head_k * GROUP + rows % GROUP) * SEQLEN_Q + rows // GROUP
    tl.store(Lse + lse_rows, lse2 * LN2, mask=row_live)


@triton.jit
def merge_if_last(Tickets, PartO, PartLse, Out, Lse, Sinks, seq, head_k, tile, first, num_splits, rows, row_live, d,
                  stride_ob, stride_oi, stride_oh, q_first, total_q, GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, MERGE_STEP: tl.constexpr,
                  SINKS: tl.constexpr, RAGGED: tl.constexpr):
    """Take a ticket for (sequence, KV head, row tile); the program that draws the last one merges
    the sequence's ``num_splits`` partials (programs ``first`` ...), MERGE_STEP at a time (unrolled,
    so the step's loads are in flight together and a step costs one memory latency, not MERGE_STEP),
    writes out/lse and resets the counter, so the next call (or a graph replay) starts from zero.
    The barrier orders every thread's partial stores before the ticket's release (acq_rel, GPU
    scope); the merger's loads skip L1 (``.cg``), which may hold lines read before the others'
    stores. A row no split saw a key of (windows) comes out 0 with lse -inf, as from the combine
    kernel, or NaN where a split flagged a bad value (as one split's rows do). SINKS: the merged
    state takes each row's sink once, after the partials (``fold_sink``)."""
    tl.debug_barrier()
    ticket_ptr = Tickets + (seq * tl.num_programs(1) + head_k) * tl.num_programs(2) + tile
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(ticket_ptr, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        weight = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        row_dims = tile_mask(row_live, d, HEAD_DIM, HEAD_PAD)
        for s0 in range(0, num_splits, MERGE_STEP):
            for j in tl.static_range(MERGE_STEP):  # independent loads: all of a step in flight at once
                live = tl.where(s0 + j < num_splits, row_live, False)
                part = ((first + s0 + j) * tl.num_programs(1) + head_k) * (GROUP * SEQLEN_Q) + rows
                part_lse = tl.load(PartLse + part, mask=live, other=float("-inf"), cache_modifier=".cg")
                part_o = tl.load(PartO + part[:, None] * HEAD_DIM + d[None, :], mask=live[:, None] & row_dims,
                                 other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, part_lse)  # a NaN partial still spoils w, hence the output
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                w = tl.exp2(part_lse - m_safe)
                alpha = tl.exp2(m - m_safe)
                acc = acc * alpha[:, None] + w[:, None] * part_o
                weight = weight * alpha + w
                m = m_new
        if SINKS:  # the sink joins the merged denominator once
            acc, m, weight = fold_sink(acc, m, weight, Sinks, head_k, rows, row_live, GROUP)
        empty = weight == 0  # acc is 0 there, or NaN when a split flagged a bad value: kept
        o = tl.where(empty[:, None], acc, acc / tl.where(empty, 1.0, weight)[:, None])
        lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, weight)))
        store_output(Out, Lse, o, lse2, seq, head_k, rows, row_live, d, stride_ob, stride_oi, stride_oh, q_first,
                     total_q, GROUP, SEQLEN_Q, HEAD_DIM, HEAD_PAD, RAGGED)


@triton.jit
def store_row(pointers, row, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Store the head dims ``d`` (a chunk of the padded head) of one output row, the real ones only."""
    if HEAD_PAD == HEAD_DIM:
        tl.store(pointers, row)
    else:
        tl.store(pointers, row, mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=_RUNTIME_INTS[:7] + ["total_q"])
def combine_kernel(Lens, LeftPad, Out, Lse, PartO, PartLse, Sinks, CuSeqlensQ,
                   batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new, window_left, total_q,
                   stride_ob, stride_oi, stride_oh,
                   GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, SPLITS_PER_STEP: tl.constexpr,
                   HEAD_CHUNK: tl.constexpr, APPEND: tl.constexpr, LEFTPAD: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                   EMPTY_ROWS: tl.constexpr, DEPENDENT_COMBINE: tl.constexpr, SINKS: tl.constexpr,
                   RAGGED: tl.constexpr):
    """Merge the partials of one (sequence, packed row h * Sq * G + r) if that sequence was split,
    HEAD_CHUNK of its head dims (the chunk ``program_id(2)``); grid (B, Hk * Sq * G, HEAD_PAD /
    HEAD_CHUNK). Partials are read SPLITS_PER_STEP at a time, all loads of a step in flight
    together, and merged with a running max so any number of splits works. Chunks of the head let
    one sequence's many partials load in one step over more programs. EMPTY_ROWS:
    a row may see no key in a split (windows with seqlen_q > 1), so a max of -inf is guarded.
    DEPENDENT_COMBINE: launched as a programmatic dependent launch; every program waits for the split
    kernel to complete (``gdc_wait``) after reading the lengths, which that kernel does not write, so
    the combine never completes before it (later launches wait on the combine alone). SINKS: the
    merge starts from the row's sink (a partial of lse = sink and output 0), so it counts once.
    RAGGED: rows past the sequence's own (``cu_seqlens_q``) are skipped; out and lse are packed."""
    seq = tl.program_id(0)
    row = tl.program_id(1)
    chunk = tl.program_id(2)
    offs, raw, splits, ends = split_counts(
        Lens, LeftPad, CuSeqlensQ, batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new,
        window_left, total_q, SEQLEN_Q, APPEND, LEFTPAD, WINDOW_LEFT, BLOCK_N, BATCH_PAD, RAGGED)
    num_splits = entry(offs, splits, seq)
    first = entry(offs, ends, seq) - num_splits
    head_k = row // (GROUP * SEQLEN_Q)
    r = row % (GROUP * SEQLEN_Q)  # the packed row i * GROUP + g of KV head head_k
    q_first, q_len, _ = query_rows(CuSeqlensQ, seq, seq < batch, total_q, SEQLEN_Q, RAGGED)
    merged = num_splits > 1
    if RAGGED:  # rows past the sequence's own
        merged = merged & (r // GROUP < q_len)
    if DEPENDENT_COMBINE:
        gdc_wait()
    if merged:
        offs_s = tl.arange(0, SPLITS_PER_STEP)
        d = chunk * HEAD_CHUNK + tl.arange(0, HEAD_CHUNK)
        m = float("-inf")
        weight = 0.0
        if SINKS:
            m = tl.load(Sinks + head_k * GROUP + r % GROUP) * LOG2E
            weight = tl.where(m == float("-inf"), 0.0, 1.0)
        acc = tl.zeros([HEAD_CHUNK], tl.float32)
        for step in range(0, num_splits, SPLITS_PER_STEP):
            live = step + offs_s < num_splits
            part = (first + step + offs_s) * tl.num_programs(1) + row
            part_lse = tl.load(PartLse + part, mask=live, other=float("-inf"))
            part_o = tl.load(PartO + part[:, None] * HEAD_DIM + d[None, :], mask=tile_mask(live, d, HEAD_DIM, HEAD_PAD),
                             other=0.0)
            m_new = tl.maximum(m, tl.max(part_lse, 0))  # a NaN partial still spoils w, hence the output
            m_safe = m_new
            if EMPTY_ROWS:
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.exp2(part_lse - m_safe)
            alpha = tl.exp2(m - m_safe)
            acc = acc * alpha + tl.sum(w[:, None] * part_o, 0)
            weight = weight * alpha + tl.sum(w, 0)
            m = m_new
        if EMPTY_ROWS:
            o = tl.where(weight == 0, acc, acc / tl.where(weight == 0, 1.0, weight))  # acc: 0, or NaN (a bad value)
            lse = tl.where(weight == 0, float("-inf"), (m + tl.log2(tl.where(weight == 0, 1.0, weight))) * LN2)
        else:
            o = acc / weight
            lse = (m + tl.log2(weight)) * LN2
        if RAGGED:  # out (total_q, Hq, D), lse (Hq, total_q): the sequence's rows from q_first
            out_row = (q_first + r // GROUP) * stride_oi + (head_k * GROUP + r % GROUP) * stride_oh
            store_row(Out + out_row + d, o.to(Out.dtype.element_ty), d, HEAD_DIM, HEAD_PAD)
            if chunk == 0:
                tl.store(Lse + (head_k * GROUP + r % GROUP) * total_q + q_first + r // GROUP, lse)
        elif SEQLEN_Q == 1:  # the row is the query head; lse (B, Hq, Sq), written by the first chunk
            store_row(Out + seq * stride_ob + row * stride_oh + d, o.to(Out.dtype.element_ty), d, HEAD_DIM, HEAD_PAD)
            if chunk == 0:
                tl.store(Lse + seq * tl.num_programs(1) + row, lse)
        else:
            out_row = row_offsets(r, head_k, stride_oi, stride_oh, GROUP, SEQLEN_Q)
            store_row(Out + seq * stride_ob + out_row + d, o.to(Out.dtype.element_ty), d, HEAD_DIM, HEAD_PAD)
            if chunk == 0:
                head = head_k * GROUP + r % GROUP
                tl.store(Lse + (seq * (tl.num_programs(1) // SEQLEN_Q) + head) * SEQLEN_Q + r // GROUP, lse)
