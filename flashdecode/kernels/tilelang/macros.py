"""The pieces the TileLang kernels are built from (``T.macro``): the device side of the planner's
work rule (``docs/design.md``, "The schedule"), the online-softmax step, and the loads and stores
both attention kernels make with all their threads.

Arguments named ``keys``, ``mask`` and ``source`` carry a feature's extra values (``features.py``);
None, the plain kernels' value, keeps the plain code.
"""
import tilelang.language as T

from .config import SCAN_WIDTH

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NAN = float("nan")


@T.macro
def sequence_blocks(seqlens, b, capacity, block_n):
    """KV blocks of sequence b, its length clamped to [0, capacity]."""
    return T.ceildiv(T.min(T.max(seqlens[b], 0), capacity), block_n)


@T.macro
def ranged_blocks(seqlens, b, capacity, block_n, keys):
    """KV blocks covering sequence b's keys [lo_b, hi_b) under ``keys``' rule (appended tokens, a
    left window, left pads)."""
    end = keys.key_end(seqlens[b], capacity)
    return T.ceildiv(end, block_n) - keys.first_block(end, b)


@T.macro
def balanced_chunk(seqlens, batch, capacity, programs, forced_splits, min_chunk, block_n, can_split, counts, keys):
    """Blocks per split when ``programs`` are balanced over the batch (1 if unused).

    The lengths are read SCAN_WIDTH at a time by all threads at once into ``counts`` (shared),
    then summed from there: one memory round trip per step instead of one per sequence."""
    chunk = T.alloc_var(T.int32, init=1)
    if can_split:
        if forced_splits <= 0:
            total = T.alloc_var(T.int32, init=0)
            for c in T.serial(T.ceildiv(batch, SCAN_WIDTH)):
                for t in T.Parallel(SCAN_WIDTH):
                    if keys is None:
                        counts[t] = T.if_then_else(c * SCAN_WIDTH + t < batch,
                                                   sequence_blocks(seqlens, c * SCAN_WIDTH + t, capacity, block_n), 0)
                    else:
                        counts[t] = T.if_then_else(c * SCAN_WIDTH + t < batch,
                                                   ranged_blocks(seqlens, c * SCAN_WIDTH + t, capacity, block_n, keys),
                                                   0)
                for t in T.serial(T.min(SCAN_WIDTH, batch - c * SCAN_WIDTH)):
                    total += counts[t]
            chunk = T.max(min_chunk, T.ceildiv(total, T.max(programs - batch, 1)))
    return chunk


@T.macro
def sequence_splits(nblk, chunk, forced_splits, can_split):
    """splits_b of a sequence with ``nblk`` blocks (1 when forced_splits <= 0 and not can_split)."""
    sp = T.max(1, T.min(forced_splits, nblk))
    if can_split:
        sp = T.if_then_else(forced_splits > 0, sp, T.max(1, T.ceildiv(nblk, chunk)))
    return sp


@T.macro
def load_splits(seqlens, batch, capacity, chunk, forced_splits, block_n, can_split, counts, step, keys):
    """counts[t] = splits_b of sequence b = step * SCAN_WIDTH + t (0 past the batch), all threads
    at once."""
    for t in T.Parallel(SCAN_WIDTH):
        if keys is None:
            counts[t] = T.if_then_else(
                step * SCAN_WIDTH + t < batch,
                sequence_splits(sequence_blocks(seqlens, step * SCAN_WIDTH + t, capacity, block_n), chunk,
                                forced_splits, can_split), 0)
        else:
            counts[t] = T.if_then_else(
                step * SCAN_WIDTH + t < batch,
                sequence_splits(ranged_blocks(seqlens, step * SCAN_WIDTH + t, capacity, block_n, keys), chunk,
                                forced_splits, can_split), 0)


def _softmax_state_macro(rows, block_n, head_dim, dtype):
    """Allocates the online-softmax state ``attend`` works on: scores, probabilities, output
    accumulator and the per-row max, sum, previous max, rescale factor and tile sum."""
    f32 = T.float32

    @T.macro
    def softmax_state():
        s_f = T.alloc_fragment((rows, block_n), f32)
        # PV reads P from registers when the q tile is one wgmma M tile (64 rows); a smaller
        # tile's warps split the scores by column, so P goes through shared memory.
        p_f = (T.alloc_fragment if rows >= 64 else T.alloc_shared)((rows, block_n), dtype)
        o_f = T.alloc_fragment((rows, head_dim), f32)
        m_f = T.alloc_fragment((rows,), f32)
        l_f = T.alloc_fragment((rows,), f32)
        m_prev = T.alloc_fragment((rows,), f32)
        alpha = T.alloc_fragment((rows,), f32)
        rsum = T.alloc_fragment((rows,), f32)
        return s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum

    return softmax_state


def _attend_macro(rows, block_n, head_dim, policy):
    """The online-softmax step of a q tile of ``rows`` rows over one K/V tile of ``block_n``
    tokens, as a macro for the kernels below."""
    f32 = T.float32

    @T.macro
    def attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale, n_valid, mask):
        """One online-softmax step over a K/V tile whose first ``n_valid`` tokens count; ``mask``
        (windows, softcap) also hides keys outside a row's window and transforms the scores."""
        T.clear(s_f)
        T.gemm(q_s, k_s, s_f, transpose_B=True, policy=policy)
        if mask is None:
            for i, j in T.Parallel(rows, block_n):
                s_f[i, j] = T.if_then_else(j < n_valid, s_f[i, j] * scale, -T.infinity(f32))
        else:
            for i, j in T.Parallel(rows, block_n):
                s_f[i, j] = T.if_then_else(mask.visible(i, j, n_valid), mask.score(s_f[i, j], scale),
                                           -T.infinity(f32))
        T.copy(m_f, m_prev)
        T.reduce_max(s_f, m_f, dim=1, clear=False)
        if mask is None:
            for i in T.Parallel(rows):
                alpha[i] = T.exp2(m_prev[i] - m_f[i])
            for i, j in T.Parallel(rows, block_n):
                s_f[i, j] = T.exp2(s_f[i, j] - m_f[i])
        else:
            for i in T.Parallel(rows):
                alpha[i] = T.exp2(m_prev[i] - mask.shift(m_f[i]))
            for i, j in T.Parallel(rows, block_n):
                s_f[i, j] = T.exp2(s_f[i, j] - mask.shift(m_f[i]))
        T.reduce_sum(s_f, rsum, dim=1)
        for i in T.Parallel(rows):
            l_f[i] = l_f[i] * alpha[i] + rsum[i]
        for i, d in T.Parallel(rows, head_dim):
            o_f[i, d] *= alpha[i]
        T.copy(s_f, p_f)  # p_f: a register fragment (64-row tile) or shared memory (smaller tiles)
        T.gemm(p_f, v_s, o_f, policy=policy)

    return attend


def _load_macros(rows, block_n, head_dim, features, dtype):
    """The loads both the split and the short-cache kernel make with all their threads: the q tile
    (the query rows of KV head h, zero rows below them) and a K/V tile of which only the rows
    before ``seqlen`` are read (the others are zero: p = 0 there, and 0 * a stale NaN past the end
    would be NaN). ``source`` (paged caches, appended tokens) says where each key lives; an fp8
    cache's elements are converted to q's dtype as they are read (``Features.widen``)."""
    f = features

    @T.macro
    def load_q(Q, q_s, b, h):
        for i, d in T.Parallel(rows, head_dim):
            q_s[i, d] = T.if_then_else(i < f.q_rows, Q[b, f.query(i), f.head(h, i), d], T.cast(0, dtype))

    @T.macro
    def load_tile(K, V, k_s, v_s, b, h, base, seqlen, source):
        if source is None:
            for j, d in T.Parallel(block_n, head_dim):
                k_s[j, d] = T.if_then_else(base + j < seqlen, f.widen(f.cache_at(K, b, base + j, h, d)),
                                           T.cast(0, dtype))
                v_s[j, d] = T.if_then_else(base + j < seqlen, f.widen(f.cache_at(V, b, base + j, h, d)),
                                           T.cast(0, dtype))
        else:  # one part per page of the tile (the whole tile unless it gathers pages)
            for offset, rows in source.parts(block_n):
                page = source.page(b, base + offset)
                for j, d in T.Parallel(rows, head_dim):
                    k_s[offset + j, d] = T.if_then_else(base + offset + j < seqlen,
                                                        source.key(K, b, page, base + offset, j, h, d), T.cast(0, dtype))
                    v_s[offset + j, d] = T.if_then_else(base + offset + j < seqlen,
                                                        source.value(V, b, page, base + offset, j, h, d),
                                                        T.cast(0, dtype))

    return load_q, load_tile


def _write_out_macro(rows, head_dim, features, dtype):
    """Writes a finished sequence's ``out`` and ``lse`` (natural log) for the query rows of KV head
    h: 0 and -inf for rows that saw no key, NaN rows for a bad length or block id (``bad``)."""
    f32 = T.float32
    f = features

    @T.macro
    def write_out(Out, Lse, o_f, l_f, m_f, b, h, bad):
        for i, d in T.Parallel(rows, head_dim):
            if i < f.q_rows:
                o = T.if_then_else(l_f[i] == 0, 0, o_f[i, d] / l_f[i])
                Out[b, f.query(i), f.head(h, i), d] = T.cast(T.if_then_else(bad, NAN, o), dtype)
        for i in T.Parallel(rows):
            if i < f.q_rows:
                if f.seqlen_q == 1:
                    Lse[b, f.head(h, i)] = T.if_then_else(
                        l_f[i] == 0, -T.infinity(f32), (T.log2(l_f[i]) + m_f[i]) * LN2)
                else:
                    Lse[b, f.head(h, i), f.query(i)] = T.if_then_else(
                        l_f[i] == 0, -T.infinity(f32), (T.log2(l_f[i]) + m_f[i]) * LN2)

    return write_out


def tile_macros(rows, block_n, head_dim, features, dtype):
    """What both attention kernels are built from, for a q tile of ``rows`` rows (the query rows
    of one KV head, zero-padded) and K/V tiles of ``block_n`` tokens: (softmax_state, attend,
    write_out, load_q, load_tile). A 64-row tile runs wgmma with whole rows per warp, a smaller
    one mma.sync with the warps splitting the columns."""
    if not 1 <= features.q_rows <= rows:
        raise ValueError(f"{features.q_rows} query rows (seqlen_q * group) do not fit a q tile of {rows} rows")
    policy = T.GemmWarpPolicy.FullRow if rows >= 64 else T.GemmWarpPolicy.FullCol
    return (_softmax_state_macro(rows, block_n, head_dim, dtype), _attend_macro(rows, block_n, head_dim, policy),
            _write_out_macro(rows, head_dim, features, dtype), *_load_macros(rows, block_n, head_dim, features, dtype))
