"""The planner's device-side rule (``flashdecode.planner``, module docstring, step 2) as Triton code.

Every program of the split and combine kernels evaluates it from the real lengths: sequence b's
keys are ``[lo_b, hi_b)``, its ``nblk_b`` blocks of ``BLOCK_N`` keys start at block ``lo_b //
BLOCK_N``, and the plan's P programs per KV head are dealt out to sequences as
``splits_per_sequence`` deals them (``planner.work_list`` is the same rule in Python).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def query_rows(CuSeqlensQ, seq, live, total_q, SEQLEN_Q: tl.constexpr, RAGGED: tl.constexpr):
    """(first packed row, query rows, whether cu_seqlens_q's entries are valid) of sequence ``seq``
    (elementwise where ``live``): ragged, from ``cu_seqlens_q[seq]`` and ``[seq + 1]``, clamped so
    the rows lie in [0, total_q) and number at most SEQLEN_Q (max_seqlen_q); else (0, SEQLEN_Q, True)."""
    if RAGGED:
        first = tl.load(CuSeqlensQ + seq, mask=live, other=0)
        last = tl.load(CuSeqlensQ + seq + 1, mask=live, other=0)
        valid = (first >= 0) & (last >= first) & (last - first <= SEQLEN_Q) & (last <= total_q)
        rows = tl.minimum(tl.minimum(tl.maximum(last - first, 0), SEQLEN_Q), total_q)
        first = tl.minimum(tl.maximum(first, 0), total_q - rows)
    else:
        first = 0
        rows = SEQLEN_Q
        valid = live
    return first, rows, valid


@triton.jit
def key_range(raw_len, leftpad, seqlen_new, capacity, window_left, seqlen_q,
              APPEND: tl.constexpr, LEFTPAD: tl.constexpr, WINDOW_LEFT: tl.constexpr):
    """(lo, hi) of ``planner.key_range``, elementwise: hi = cache_seqlens + seqlen_new clamped to
    [0, capacity]; lo = max(leftpad, hi - seqlen_q - window_left), clamped to [0, hi]; the scalar 0
    without a left pad or window. Ragged, ``seqlen_q`` is the sequence's rows (and ``seqlen_new``
    too where it appends)."""
    if APPEND:
        hi = tl.minimum(tl.maximum(raw_len + seqlen_new, 0), capacity)
    else:
        hi = tl.minimum(tl.maximum(raw_len, 0), capacity)
    lo = 0
    if LEFTPAD:
        lo = tl.maximum(leftpad, 0)
    if WINDOW_LEFT:
        lo = tl.maximum(lo, hi - seqlen_q - window_left)
    if LEFTPAD or WINDOW_LEFT:
        lo = tl.minimum(lo, hi)
    return lo, hi


@triton.jit
def split_counts(Lens, LeftPad, CuSeqlensQ, batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new,
                 window_left, total_q, SEQLEN_Q: tl.constexpr, APPEND: tl.constexpr, LEFTPAD: tl.constexpr,
                 WINDOW_LEFT: tl.constexpr, BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, RAGGED: tl.constexpr):
    """For every sequence (vectors over ``BATCH_PAD``): (offsets, raw lengths, splits, their cumsum)."""
    offs = tl.arange(0, BATCH_PAD)
    live = offs < batch
    raw = tl.load(Lens + offs, mask=live, other=0)
    leftpad = 0
    if LEFTPAD:
        leftpad = tl.load(LeftPad + offs, mask=live, other=0)
    _, rows, _ = query_rows(CuSeqlensQ, offs, live, total_q, SEQLEN_Q, RAGGED)
    new = seqlen_new
    if RAGGED:
        new = rows
    lo, hi = key_range(raw, leftpad, new, capacity, window_left, rows, APPEND, LEFTPAD, WINDOW_LEFT)
    blocks = tl.cdiv(hi, BLOCK_N)
    if LEFTPAD or WINDOW_LEFT:
        blocks -= lo // BLOCK_N
    chunk = tl.maximum(tl.cdiv(tl.sum(blocks, 0), tl.maximum(num_programs - batch, 1)), min_chunk)
    splits = tl.where(forced_splits > 0, tl.minimum(blocks, forced_splits), tl.cdiv(blocks, chunk))
    splits = tl.where(live, tl.maximum(splits, 1), 0)
    return offs, raw, splits, tl.cumsum(splits, 0)


@triton.jit
def entry(offs, values, index):
    """values[index] of a vector indexed by offs."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


@triton.jit
def locate(Lens, LeftPad, CuSeqlensQ, pid, batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new,
           window_left, total_q, SEQLEN_Q: tl.constexpr, APPEND: tl.constexpr, LEFTPAD: tl.constexpr,
           WINDOW_LEFT: tl.constexpr, BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, CAN_SPLIT: tl.constexpr,
           RAGGED: tl.constexpr):
    """Program pid's (sequence, split, splits of that sequence, raw length); sequence >= batch for
    programs without work."""
    if CAN_SPLIT:
        offs, raw, splits, ends = split_counts(
            Lens, LeftPad, CuSeqlensQ, batch, capacity, num_programs, forced_splits, min_chunk, seqlen_new,
            window_left, total_q, SEQLEN_Q, APPEND, LEFTPAD, WINDOW_LEFT, BLOCK_N, BATCH_PAD, RAGGED)
        seq = tl.sum((ends <= pid).to(tl.int32), 0)
        num_splits = entry(offs, splits, seq)
        split = pid - (entry(offs, ends, seq) - num_splits)
        raw_len = entry(offs, raw, seq)
    else:
        seq = pid
        split = 0
        num_splits = 1
        raw_len = tl.load(Lens + tl.minimum(pid, batch - 1))
    return seq, split, num_splits, raw_len
