"""The three TileLang kernels as prim_funcs, before compilation (``build.py`` compiles them).

* Split kernel, grid (P, Hk). Program (p, h) serves every query row of KV head h, so each K/V tile
  is read once per KV head; the q tile's rows are zero-padded to ``block_m``. Each program replays
  the planner's work rule over ``cache_seqlens`` to find its sequence, split and block range. Full
  blocks stream through ``T.Pipelined`` (TMA + mbarriers, a warp-specialised producer/consumer
  pair on sm_90); of a sequence's last, partially filled block only the valid rows are read, after
  the pipeline, the others zero-filled and masked, so stale cache contents (even NaN) past the end
  never reach the result. Online softmax runs in float32 in base 2 (log2 e folded into the scale).
  Unsplit sequences write ``out`` and ``lse`` (natural log; no keys gives 0 and -inf), split ones
  write ``part_o`` and ``part_lse`` (base 2).
* Combine kernel, grid (B, Hq): one program per (sequence, query head) merges the partials of
  every sequence with more than one split, ``step`` partials at a time.
* Short-cache kernel, grid (B, Hk): one warpgroup loads q with the first tile's valid K/V rows at
  once, then runs a softmax step per tile, loading each next tile directly (no pipeline, producer
  or schedule: for caches of a few tiles they only add latency).

A length outside [0, capacity] is clamped for the schedule and the reads, and its rows of ``out``
are NaN (``docs/design.md``, "Semantics").

Each kernel serves paged KV, appended k/v, seqlen_q > 1, windows, softcap, sinks, fp8 caches, left
pads and heads-first caches as compile-time gates (``features.py``): a feature off adds no parameter
and no code, so the plain kernels' CUDA is what it was before the features existed. Keys [lo_b, hi_b)
follow ``docs/design.md`` ("Semantics") and the planner's work rule with key ranges.
"""
import tilelang.language as T

from .config import CONSUMER_THREADS, SCAN_WIDTH
from .features import (Features, bad_pages, descale_output, fold_sink, partial_lse, partial_value,
                       write_appended)
from .macros import LN2, LOG2E, NAN, balanced_chunk, load_splits, tile_macros

#: The split kernel's name in its CUDA source (``patches.py`` rewrites only that kernel).
SPLIT_KERNEL_NAME = "decode_split_kernel"


def split_kernel(shape, config, can_split: bool, blocks_per_sm: int, register_split=None):
    """The split kernel for ``shape`` (:class:`~.config.KernelShape`) and ``config``
    (:class:`~.config.SplitConfig`). ``can_split`` False: one program per sequence, never partials.
    ``blocks_per_sm``: the occupancy ptxas must allow (``__launch_bounds__``); ``register_split``:
    (producer, consumer) registers after setmaxnreg, or None for the even split.

    Call: (q, k_cache, v_cache, cache_seqlens, out, lse, part_o, part_lse, programs, forced_splits,
    min_chunk, softmax_scale, then the features' block_table, k, v, softcap, window_left,
    window_right, the fp8 descales (k's and v's flat views, then their (batch, head) strides), sinks,
    cache_leftpad where used); grid (programs, nheads_k). A heads-first cache comes as its contiguous
    (batch, nheads_k, capacity, headdim) view. An fp8 cache's tiles are pipelined as they are stored
    (1 byte an element) and converted to q's dtype in shared memory before the matrix products."""
    dtype, D, G, Hk = shape.dtype, shape.headdim, shape.group, shape.nheads_k
    block_n, num_stages = config.block_n, config.num_stages
    Hq, Sq, R = Hk * G, shape.seqlen_q, shape.q_rows
    rows, threads = config.block_m, CONSUMER_THREADS
    f = Features(shape, block_n)
    softmax_state, attend, write_out, load_q, load_tile = tile_macros(rows, block_n, D, f, dtype)
    shared_registers = blocks_per_sm > 1
    B, S, W = T.dynamic("batch, capacity, workspace_rows")
    capacity = f.capacity(S)
    f32 = T.float32

    @T.macro
    def finish(Out, Lse, PartO, PartLse, Sinks, o_f, l_f, m_f, alpha, pid, b, h, nsplit, bad, bad_page):
        """out and lse of an unsplit sequence (its rows' sinks folded in), else this split's
        partials (the combine adds the sinks)."""
        if nsplit == 1:
            if f.sinks is not None:
                fold_sink(f, Sinks, h, o_f, l_f, m_f, alpha, rows, D)
            write_out(Out, Lse, o_f, l_f, m_f, b, h, bad)
        else:
            for i, d in T.Parallel(rows, D):
                if i < R:
                    PartO[pid, h * R + i, d] = partial_value(f, o_f[i, d], l_f[i], bad_page)
            for i in T.Parallel(rows):
                if i < R:
                    PartLse[pid, h * R + i] = partial_lse(f, l_f[i], m_f[i], bad_page)

    @T.prim_func
    def decode_split(
        Q: T.Tensor((B, Sq, Hq, D), dtype),
        K: f.cache(B, S, Hk, D),
        V: f.cache(B, S, Hk, D),
        seqlens: T.Tensor((B,), T.int32),
        Out: T.Tensor((B, Sq, Hq, D), dtype),
        Lse: f.lse(B, Hq),
        PartO: T.Tensor((W, Hk * R, D), f32),
        PartLse: T.Tensor((W, Hk * R), f32),
        programs: T.int32,
        forced_splits: T.int32,
        min_chunk: T.int32,
        softmax_scale: f32,
        BlockTable: f.block_table(B),
        KNew: f.new(B, Hk, D, dtype),
        VNew: f.new(B, Hk, D, dtype),
        softcap: f.softcap,
        window_left: f.window_left,
        window_right: f.window_right,
        KDescale: f.descale_view(0),
        VDescale: f.descale_view(1),
        k_descale_stride_b: f.descale_strides[0],
        k_descale_stride_h: f.descale_strides[1],
        v_descale_stride_b: f.descale_strides[2],
        v_descale_stride_h: f.descale_strides[3],
        Sinks: f.sinks,
        LeftPad: f.leftpads(B),
    ):
        with T.Kernel(programs, Hk, threads=threads) as (pid, h):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            if register_split is not None:  # the producer keeps few registers, the consumer the rest
                T.annotate_producer_reg_dealloc(register_split[0])
                T.annotate_consumer_reg_alloc(register_split[1])
            elif shared_registers:
                T.no_set_max_nreg()  # two programs per SM: keep the even register split
            q_s = T.alloc_shared((rows, D), dtype)
            k_s = T.alloc_shared((block_n, D), f.cache_dtype)
            v_s = T.alloc_shared((block_n, D), f.cache_dtype)
            k_tail = T.alloc_shared((block_n, D), dtype)  # shares memory with k_s/v_s once
            v_tail = T.alloc_shared((block_n, D), dtype)  # the pipelined loop is done
            if f.fp8:  # the pipelined fp8 tiles in q's dtype: a matrix product takes one type
                k_wide = T.alloc_shared((block_n, D), dtype)
                v_wide = T.alloc_shared((block_n, D), dtype)
            s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum = softmax_state()
            counts = T.alloc_shared((SCAN_WIDTH,), T.int32)

            # This program's (sequence, split); seq stays -1 when it has no work.
            seq = T.alloc_var(T.int32, init=-1)
            split = T.alloc_var(T.int32, init=0)
            nsplit = T.alloc_var(T.int32, init=1)
            if can_split or forced_splits > 0:
                chunk = balanced_chunk(seqlens, B, capacity, programs, forced_splits, min_chunk, block_n, can_split,
                                       counts, f.key_rule(LeftPad))
                first = T.alloc_var(T.int32, init=0)
                for c in T.serial(T.ceildiv(B, SCAN_WIDTH)):
                    load_splits(seqlens, B, capacity, chunk, forced_splits, block_n, can_split, counts, c,
                                f.key_rule(LeftPad))
                    for t in T.serial(T.min(SCAN_WIDTH, B - c * SCAN_WIDTH)):
                        if first <= pid and pid < first + counts[t]:
                            seq = c * SCAN_WIDTH + t
                            split = pid - first
                            nsplit = counts[t]
                        first += counts[t]
            elif pid < B:
                seq = pid

            b = T.max(seq, 0)
            raw_len = T.if_then_else(seq >= 0, seqlens[b], 0)
            seqlen = f.key_end(raw_len, capacity, seq >= 0)  # hi_b; the blocks start at lo_b // block_n
            leftpad = f.read_leftpad(LeftPad, b)
            start = f.start_of(seqlen, leftpad)  # lo_b where a left pad moves it
            nblk = T.ceildiv(seqlen, block_n) - f.first_block(seqlen, leftpad)
            blk_lo = f.first_block(seqlen, leftpad) + T.cast(T.cast(split, T.int64) * nblk // nsplit, T.int32)
            blk_hi = f.first_block(seqlen, leftpad) + T.cast(T.cast(split + 1, T.int64) * nblk // nsplit, T.int32)
            full_hi = f.pipeline_end(blk_lo, T.min(blk_hi, f.cached_end(raw_len, seqlen) // block_n))  # only valid keys
            descales = f.descales(KDescale, VDescale, b, h)
            scale = f.score_scale(softmax_scale * LOG2E, descales)

            load_q(Q, q_s, b, h)
            T.fill(o_f, 0)
            T.fill(l_f, 0)
            T.fill(m_f, -T.infinity(f32))
            if f.paged:  # the block ids this program reads, and for split 0 those its appended tokens go to
                bad_page = T.max(
                    bad_pages(BlockTable, b, blk_lo * block_n // f.page_size,
                              T.ceildiv(T.min(blk_hi * block_n, seqlen), f.page_size), f.num_pages, counts),
                    bad_pages(BlockTable, b, *f.appended_pages(raw_len, capacity, T.And(seq >= 0, split == 0)),
                              f.num_pages, counts))

            for kb in T.Pipelined(blk_lo, full_hi, num_stages=num_stages):
                if f.pages_per_tile == 1:
                    T.copy(f.tile(K, BlockTable, b, kb, h), k_s)
                    T.copy(f.tile(V, BlockTable, b, kb, h), v_s)
                else:  # pages smaller than a tile: one TMA load per page and column chunk
                    for source, destination in f.tile_parts(K, BlockTable, b, kb, h, k_s):
                        T.copy(source, destination)
                    for source, destination in f.tile_parts(V, BlockTable, b, kb, h, v_s):
                        T.copy(source, destination)
                if f.fp8:
                    T.copy(k_s, k_wide)
                    T.copy(v_s, v_wide)
                    attend(q_s, k_wide, v_wide, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale, block_n,
                           f.mask(kb * block_n, seqlen, start))
                else:
                    attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale, block_n,
                           f.mask(kb * block_n, seqlen, start))

            if f.append:  # the tiles holding appended tokens, read from k/v
                # Locals, not expressions: inlined into every element's index, these bounds made
                # the compile 88 s (split) and 20+ min (windows and append) instead of ~20 s.
                tail_lo = T.alloc_var(T.int32)
                tail_lo = T.max(full_hi, blk_lo)
                keys = T.alloc_var(T.int32)
                keys = seqlen
                cached = T.alloc_var(T.int32)
                cached = f.cached_end(raw_len, seqlen)
                for t in T.serial(blk_hi - tail_lo):
                    base = (tail_lo + t) * block_n
                    load_tile(K, V, k_tail, v_tail, b, h, base, keys,
                              f.source(KNew, VNew, BlockTable, cached, descales))
                    attend(q_s, k_tail, v_tail, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale,
                           keys - base, f.mask(base, keys, start))
            elif full_hi < blk_hi:  # the sequence's last block, partially filled: only its valid rows
                base = full_hi * block_n
                load_tile(K, V, k_tail, v_tail, b, h, base, seqlen, f.source(KNew, VNew, BlockTable, seqlen))
                attend(q_s, k_tail, v_tail, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale,
                       seqlen - base, f.mask(base, seqlen, start))

            if f.fp8:
                descale_output(o_f, descales[1], rows, D)
            if seq >= 0:
                if f.paged:
                    finish(Out, Lse, PartO, PartLse, Sinks, o_f, l_f, m_f, alpha, pid, b, h, nsplit,
                           T.Or(f.bad_length(raw_len, seqlen, leftpad), bad_page > 0), bad_page)
                else:
                    finish(Out, Lse, PartO, PartLse, Sinks, o_f, l_f, m_f, alpha, pid, b, h, nsplit,
                           f.bad_length(raw_len, seqlen, leftpad), None)
                if f.append:
                    if split == 0:
                        write_appended(f, K, V, KNew, VNew, BlockTable, b, h, raw_len, capacity, D, descales)

    return decode_split


def short_cache_kernel(shape, config, blocks_per_sm: int):
    """The short-cache kernel for ``shape`` and ``config`` (:class:`~.config.ShortCacheConfig`):
    grid (B, Hk), one warpgroup, ``blocks_per_sm`` the occupancy ptxas must allow.

    Call: (q, k_cache, v_cache, cache_seqlens, out, lse, softmax_scale, then the features'
    block_table, k, v, softcap, window_left, window_right, the fp8 descales, sinks, cache_leftpad where
    used). An fp8 cache is converted to q's dtype as each tile is loaded."""
    dtype, D, G, Hk = shape.dtype, shape.headdim, shape.group, shape.nheads_k
    block_n, rows, one_tile = config.block_n, config.block_m, config.one_tile
    Hq, Sq = Hk * G, shape.seqlen_q
    f = Features(shape, block_n)
    softmax_state, attend, write_out, load_q, load_tile = tile_macros(rows, block_n, D, f, dtype)
    B, S = T.dynamic("batch, capacity")
    capacity = f.capacity(S)
    f32 = T.float32

    @T.prim_func
    def decode_short_cache(
        Q: T.Tensor((B, Sq, Hq, D), dtype),
        K: f.cache(B, S, Hk, D),
        V: f.cache(B, S, Hk, D),
        seqlens: T.Tensor((B,), T.int32),
        Out: T.Tensor((B, Sq, Hq, D), dtype),
        Lse: f.lse(B, Hq),
        softmax_scale: f32,
        BlockTable: f.block_table(B),
        KNew: f.new(B, Hk, D, dtype),
        VNew: f.new(B, Hk, D, dtype),
        softcap: f.softcap,
        window_left: f.window_left,
        window_right: f.window_right,
        KDescale: f.descale_view(0),
        VDescale: f.descale_view(1),
        k_descale_stride_b: f.descale_strides[0],
        k_descale_stride_h: f.descale_strides[1],
        v_descale_stride_b: f.descale_strides[2],
        v_descale_stride_h: f.descale_strides[3],
        Sinks: f.sinks,
        LeftPad: f.leftpads(B),
    ):
        with T.Kernel(B, Hk, threads=CONSUMER_THREADS) as (b, h):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            q_s = T.alloc_shared((rows, D), dtype)
            k_s = T.alloc_shared((block_n, D), dtype)
            v_s = T.alloc_shared((block_n, D), dtype)
            s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum = softmax_state()

            raw_len = seqlens[b]
            seqlen = f.key_end(raw_len, capacity)
            leftpad = f.read_leftpad(LeftPad, b)
            start = f.start_of(seqlen, leftpad)
            descales = f.descales(KDescale, VDescale, b, h)
            source = f.source(KNew, VNew, BlockTable, f.cached_end(raw_len, seqlen), descales)
            if f.paged:
                flags = T.alloc_shared((SCAN_WIDTH,), T.int32)
                bad_page = T.max(
                    bad_pages(BlockTable, b, f.first_block(seqlen, leftpad) * block_n // f.page_size,
                              T.ceildiv(seqlen, f.page_size), f.num_pages, flags),
                    bad_pages(BlockTable, b, *f.appended_pages(raw_len, capacity, True), f.num_pages, flags))
            load_q(Q, q_s, b, h)
            if one_tile:
                load_tile(K, V, k_s, v_s, b, h, 0, seqlen, source)
            T.fill(o_f, 0)
            T.fill(l_f, 0)
            T.fill(m_f, -T.infinity(f32))
            if one_tile:
                if seqlen > 0:
                    attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum,
                           f.score_scale(softmax_scale * LOG2E, descales), seqlen, f.mask(0, seqlen, start))
            else:
                for t in T.serial(T.ceildiv(seqlen, block_n) - f.first_block(seqlen, leftpad)):
                    load_tile(K, V, k_s, v_s, b, h, (f.first_block(seqlen, leftpad) + t) * block_n, seqlen, source)
                    attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum,
                           f.score_scale(softmax_scale * LOG2E, descales),
                           seqlen - (f.first_block(seqlen, leftpad) + t) * block_n,
                           f.mask((f.first_block(seqlen, leftpad) + t) * block_n, seqlen, start))
            if f.fp8:
                descale_output(o_f, descales[1], rows, D)
            if f.sinks is not None:
                fold_sink(f, Sinks, h, o_f, l_f, m_f, alpha, rows, D)
            if f.paged:
                write_out(Out, Lse, o_f, l_f, m_f, b, h, T.Or(f.bad_length(raw_len, seqlen, leftpad), bad_page > 0))
            else:
                write_out(Out, Lse, o_f, l_f, m_f, b, h, f.bad_length(raw_len, seqlen, leftpad))
            if f.append:
                write_appended(f, K, V, KNew, VNew, BlockTable, b, h, raw_len, capacity, D, descales)

    return decode_short_cache


def combine_kernel(shape, config, block_n: int):
    """The combine kernel for ``shape``, ``config`` (:class:`~.config.CombineConfig`) and the split
    kernel's ``block_n`` (it replays the same work rule): grid (B, Hk * seqlen_q * group), one
    program per partial row (a query head when seqlen_q is 1), one thread per head-dim element.

    Call: (cache_seqlens, part_o, part_lse, out, lse, capacity, programs, forced_splits, min_chunk,
    then seqlen_new, window_left, sinks and cache_leftpad where used). With sinks the merge starts from the row's
    sink: a partial of lse = sink and output 0, so it counts once."""
    dtype, D, G, Hk, step = shape.dtype, shape.headdim, shape.group, shape.nheads_k, config.step
    Hq, Sq, R = Hk * G, shape.seqlen_q, shape.q_rows
    f = Features(shape, block_n)
    can_split = True
    B, W = T.dynamic("batch, workspace_rows")
    f32 = T.float32

    @T.prim_func
    def decode_combine(
        seqlens: T.Tensor((B,), T.int32),
        PartO: T.Tensor((W, Hk * R, D), f32),
        PartLse: T.Tensor((W, Hk * R), f32),
        Out: T.Tensor((B, Sq, Hq, D), dtype),
        Lse: f.lse(B, Hq),
        capacity: T.int32,
        programs: T.int32,
        forced_splits: T.int32,
        min_chunk: T.int32,
        new_tokens: f.new_tokens if f.append else None,
        window_left: f.window_left,
        Sinks: f.sinks,
        LeftPad: f.leftpads(B),
    ):
        with T.Kernel(B, Hk * R, threads=D) as (bid, hq):
            d = T.get_thread_binding()
            part_lse = T.alloc_local((step,), f32)
            part_o = T.alloc_local((step,), f32)
            m = T.alloc_var(f32, init=-T.infinity(f32))
            m_new = T.alloc_var(f32)
            w_sum = T.alloc_var(f32, init=0)
            acc = T.alloc_var(f32, init=0)

            counts = T.alloc_shared((SCAN_WIDTH,), T.int32)
            chunk = balanced_chunk(seqlens, B, capacity, programs, forced_splits, min_chunk, block_n, can_split,
                                   counts, f.key_rule(LeftPad))
            first = T.alloc_var(T.int32, init=0)  # partial rows before this sequence's
            nsplit = T.alloc_var(T.int32, init=0)
            for c in T.serial(bid // SCAN_WIDTH + 1):
                load_splits(seqlens, B, capacity, chunk, forced_splits, block_n, can_split, counts, c,
                            f.key_rule(LeftPad))
                for t in T.serial(T.min(SCAN_WIDTH, bid - c * SCAN_WIDTH)):
                    first += counts[t]
                if c == bid // SCAN_WIDTH:
                    nsplit = counts[bid % SCAN_WIDTH]

            if nsplit > 1:
                if f.sinks is not None:  # the partial row hq is row hq % R of KV head hq // R
                    m = f.sink(Sinks, hq // R, hq % R)
                    w_sum = T.if_then_else(m == -T.infinity(f32), 0, 1)
                # A step's partials are all loaded before any is used, so their loads overlap.
                for c in T.serial(T.ceildiv(nsplit, step)):
                    for s in T.unroll(step):
                        live = c * step + s < nsplit
                        row = T.min(first + c * step + s, W - 1)
                        part_lse[s] = T.if_then_else(live, PartLse[row, hq], -T.infinity(f32))
                        part_o[s] = T.if_then_else(live, PartO[row, hq, d], 0)
                    m_new = m
                    for s in T.unroll(step):
                        m_new = T.max(m_new, part_lse[s])
                    w_sum = w_sum * T.exp2(m - f.combine_shift(m_new))
                    acc = acc * T.exp2(m - f.combine_shift(m_new))
                    for s in T.unroll(step):
                        w_sum = w_sum + T.exp2(part_lse[s] - f.combine_shift(m_new))
                        acc = acc + T.exp2(part_lse[s] - f.combine_shift(m_new)) * part_o[s]
                    m = m_new
                bad = f.combined_bad_length(seqlens[bid], capacity, f.leftpad_of(LeftPad, bid))
                if Sq == 1:
                    Out[bid, 0, hq, d] = T.cast(T.if_then_else(bad, NAN, f.combined(acc, w_sum, m)), dtype)
                    if d == 0:
                        Lse[bid, hq] = (m + T.log2(w_sum)) * LN2
                else:
                    Out[bid, hq % R // G, hq // R * G + hq % G, d] = T.cast(
                        T.if_then_else(bad, NAN, f.combined(acc, w_sum, m)), dtype)
                    if d == 0:
                        Lse[bid, hq // R * G + hq % G, hq % R // G] = (m + T.log2(w_sum)) * LN2

    return decode_combine
