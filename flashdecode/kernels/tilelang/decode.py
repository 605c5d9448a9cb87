"""TileLang kernels for GQA KV-cache decode attention (one query token per sequence).

Three kernels, compiled once per specialisation (dtype, head_dim, group size G, KV heads,
tile parameters) and cached; batch size, cache capacity, workspace rows, the number of
split programs P, softmax_scale and forced_splits are runtime values, so new shapes and
lengths never recompile.

* Split kernel, grid (P, Hk).  Program (p, h) serves all G query heads of KV head h, so
  each K/V tile is read once per KV head.  The q tile is G rows zero-padded to 64 per
  consumer warpgroup, so both GEMMs are Hopper wgmma (QK^T from shared memory, PV with
  the probabilities kept in registers).  Each program replays the planner's work rule
  over ``cache_seqlens`` (``_chunk``/``_load_splits``, all threads reading the lengths at
  once) to find its sequence, split and block range.  Full blocks stream through
  ``T.Pipelined`` (TMA + mbarriers, warp-specialised producer/consumer on sm_90); of the
  last, partially filled block of a sequence only the valid rows are read, outside the
  pipeline, the others zero-filled and their scores masked, so stale cache contents (even
  NaN) past the end never reach the result.  Online softmax runs in
  float32 in base 2 (log2 e is folded into the scale).  Unsplit sequences write ``out``
  and ``lse`` (natural log; length 0 gives 0 and -inf), split ones write ``part_o`` and
  ``part_lse`` (base 2).
* Combine kernel, grid (B, Hq): one program per (sequence, query head) merges the partials of
  every sequence with > 1 split, a step of partials at a time.
* Short-cache kernel, grid (B, Hk), for unsplit caches of at most SHORT_CACHE_MAX_BLOCKS
  tiles: the split kernel's pipeline, producer warpgroup and schedule only add latency
  there, so one warpgroup loads q with the first tile's valid K/V rows at once, then runs
  a softmax step per tile, loading each next tile directly.

As in the Triton backend, a length outside [0, capacity] is clamped for the schedule and
the reads, and its row of ``out`` is set to NaN.

Warp specialisation stays on by default: the pipelined loop's trip count is dynamic (0,
1, 2, ... blocks), and for a dynamic count TileLang 0.1.15 emits the multi-dimensional
TMA path (``arrive_and_expect_tx``) with phase parity ``(i // stages) & 1``, correct for
every count (tilelang issue #2566, a hang, only hits loops statically known to run
once).  Its producer loop, though, runs on all four warps of the producer warpgroup, and
three of them only watch barriers that nothing makes them keep up with: one that lags two
phases waits forever.  The generated source is rewritten so that one warp runs that loop
(``one_warp_producer``, perf log 18).  The producer warpgroup then keeps 24 registers a thread and
hands the rest to the consumer (setmaxnreg, ``split_kernel_registers``; perf log 31).  TileLang's other lowering, a cp.async software pipeline without warp specialisation,
gave wrong results for these kernels on the H200 (docs/perf-log.md section 9), so it is not
offered.
"""

import contextlib
import functools
import math
import threading

import tilelang
import tilelang.language as T
import tvm_ffi

from ... import hardware, planner

__all__ = ["build_split_kernel", "build_combine_kernel", "build_short_cache_kernel", "kernels_for",
           "short_cache_kernel_for", "launchers_for", "takes_short_cache", "resident_programs_for", "run"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_NAN = float("nan")

#: Tuning knobs of the split kernel (benchmarks/sweep.py varies them; docs/perf-log.md has the
#: measurements).  Depth of the K/V pipeline:
NUM_STAGES = 2
#: Fewest rows of the q tile (the G query heads of a KV head, zero-padded): 64 is one wgmma M tile
#: per consumer warpgroup; 16 pads small groups less and runs mma.sync instead.
MIN_Q_ROWS = 64
#: Fewest rows of the short-cache kernel's q tile: its few softmax steps are all latency, and a
#: 16-row mma.sync tile beat the 64-row wgmma tile on every cache of one tile (perf log 15).
SHORT_CACHE_MIN_Q_ROWS = 16
#: Sequences whose lengths a program reads at once when it locates its work (``_chunk``,
#: ``_load_splits``): one parallel load per SCAN_WIDTH sequences, in shared memory.
SCAN_WIDTH = 256


#: Registers a thread of the split kernel's producer warpgroup keeps (setmaxnreg), the consumer
#: warpgroup taking the rest; 0 keeps the even split. Tuning knob: 24 measured 0.1-3% faster than
#: the even split on cases 6-14 in two runs, and removes ptxas's spills (perf log 31).
PRODUCER_REGISTERS = 24

#: Consumer threads of the split kernel: one warpgroup, whatever the q tile's rows (warp
#: specialisation adds a 128-thread TMA producer warpgroup).
CONSUMER_THREADS = 128


def q_tile_rows(group: int, min_rows: int) -> int:
    """Rows of the q tile: the group rounded up to a power of two, at least ``min_rows``."""
    return max(min_rows, 1 << (group - 1).bit_length())


def _freeze(target):
    """Dict targets become hashable so the builders can be lru-cached."""
    return tuple(sorted(target.items())) if isinstance(target, dict) else target


def _compile(func, target, compile_flags=None):
    target = dict(target) if isinstance(target, tuple) else target
    return tilelang.compile(func, target=target or "auto", execution_backend="tvm_ffi",
                            compile_flags=compile_flags)


#: Threads of the split kernel's producer warpgroup that run its TMA loop: its first warp
#: (``one_warp_producer``).
PRODUCER_LOOP_THREADS = 32
_PRODUCER_LOOP_MACRO = "FLASHDECODE_PRODUCER_LOOP_THREADS"
_PRODUCER_BRANCH = "if (((int)threadIdx.x) < 128) {"
_PRODUCER_LOOP = "for (int kb = "
_CUDA_POSTPROC = "tilelang_callback_cuda_postproc"
_SPLIT_KERNEL_NAME = "decode_split_kernel"


def one_warp_producer(code: str) -> str:
    """The split kernel's CUDA source with its producer loop run by one warp instead of four.

    TileLang 0.1.15 runs the warp-specialised producer loop (wait until a stage is free, then one
    elected thread issues its TMA loads) on all four warps of the producer warpgroup.  Warps 1-3
    only watch the "stage free" barriers and nothing waits for them, so one that falls two phases
    of a barrier behind sees the parity it waits for again and spins forever: the program never
    ends and the GPU hangs (perf log 16, 18).  Guarding the loop with ``threadIdx.x <
    FLASHDECODE_PRODUCER_LOOP_THREADS`` (defined by the compile flags) lets warps 1-3 finish at
    once, as CUTLASS and FlashAttention-3 do with their producer warps.  Raises ValueError unless
    the source has exactly one producer loop with TMA loads directly inside an open
    ``threadIdx.x < 128`` branch whose ``else`` is the consumer (matrix products): another TileLang
    may lay the kernel out otherwise, and the guard must never land on other code.
    """
    loop = code.find(_PRODUCER_LOOP)
    branch = code.rfind(_PRODUCER_BRANCH, 0, loop)
    consumer = code.find("} else {", loop)
    if not (loop >= 0 and code.count(_PRODUCER_LOOP) == 1 and branch >= 0 and consumer >= 0
            and _braces_open(code[branch:loop]) == 1 and "tma_load" in code[loop:consumer]
            and ("wgmma" in code[consumer:] or "mma_sync" in code[consumer:])):
        raise ValueError("the split kernel's source does not have the one producer TMA loop expected "
                         "(TileLang other than 0.1.15?): cannot restrict it to one warp")
    guard = f"if (((int)threadIdx.x) < {_PRODUCER_LOOP_MACRO}) "
    return code[:loop] + guard + code[loop:]


def _braces_open(text: str) -> int:
    """Braces opened and not closed in ``text``; -1 once more have closed than opened, or once the
    first opened block has closed (the code after it is outside)."""
    depth = 0
    for char in text:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth <= 0:
                return -1
    return depth


_postproc_lock = threading.RLock()
_postproc_installed = {"users": 0, "previous": None}  # guarded by _postproc_lock
_thread_rewrites = threading.local()  # .active: this thread's (rewrite, kernel name), innermost last


def _dispatch_postproc(code, target):
    """TileLang's CUDA post-processing hook while one of our compiles runs: the hook set before,
    then the rewrite of the innermost ``_cuda_postproc`` block of the compiling thread, if the
    source is that block's kernel. TileLang calls the hook on the compiling thread, so another
    thread's compile (ours or the user's) only gets the hook set before."""
    previous = _postproc_installed["previous"]
    code = previous(code, target) if previous is not None else code
    active = getattr(_thread_rewrites, "active", None)
    if active and active[-1][1] in code:
        code = active[-1][0](code)
    return code


@contextlib.contextmanager
def _cuda_postproc(rewrite, kernel_name: str):
    """Within the block, this thread's TileLang compiles of the kernel whose CUDA source names
    ``kernel_name`` are post-processed by ``rewrite`` (after any hook already set); the hook is set
    while any thread is inside such a block and restored after the last leaves (a hook another
    thread registers meanwhile is then replaced by the one from before)."""
    active = getattr(_thread_rewrites, "active", None)
    if active is None:
        active = _thread_rewrites.active = []
    with _postproc_lock:
        if _postproc_installed["users"] == 0:
            _postproc_installed["previous"] = tvm_ffi.get_global_func(_CUDA_POSTPROC, allow_missing=True)
            tvm_ffi.register_global_func(_CUDA_POSTPROC, f=_dispatch_postproc, override=True)
        _postproc_installed["users"] += 1
    active.append((rewrite, kernel_name))
    try:
        yield
    finally:
        active.pop()
        with _postproc_lock:
            _postproc_installed["users"] -= 1
            if _postproc_installed["users"] == 0:
                previous, _postproc_installed["previous"] = _postproc_installed["previous"], None
                if previous is not None:
                    tvm_ffi.register_global_func(_CUDA_POSTPROC, f=previous, override=True)
                else:
                    tvm_ffi.remove_global_func(_CUDA_POSTPROC)


#: Most split programs ptxas is asked to fit on one SM (``__launch_bounds__``).
MAX_RESIDENT_PROGRAMS = 4


def split_kernel_shared_bytes(head_dim, block_n, rows, num_stages):
    """Shared memory of one split program: the q tile, the pipelined K/V stages (the tail tiles
    reuse them), P for tiles under 64 rows, the lengths being scanned, and the 1 KiB the
    driver reserves per program."""
    q_tile = rows * head_dim * 2
    stages = num_stages * 2 * block_n * head_dim * 2
    probabilities = rows * block_n * 2 if rows < 64 else 0
    return q_tile + stages + probabilities + SCAN_WIDTH * 4 + 1024


def _consumer_registers(head_dim, block_n, rows):
    """Registers a consumer thread needs: output rows*D/threads and scores plus probabilities
    1.5*rows*block_n/threads values, plus ~16 for addressing."""
    return (rows * head_dim + 3 * rows * block_n // 2) // CONSUMER_THREADS + 16


def _programs_that_fit(registers, threads, shared_bytes, registers_per_sm, shared_memory_per_sm):
    """Programs of ``threads`` threads needing ``registers`` each and ``shared_bytes`` that fit on
    one SM at once, between 1 and MAX_RESIDENT_PROGRAMS."""
    by_registers = max((n for n in range(1, MAX_RESIDENT_PROGRAMS + 1)
                        if registers <= min(255, registers_per_sm // (n * threads))), default=1)
    return max(1, min(by_registers, shared_memory_per_sm // shared_bytes))


def resident_programs(head_dim, block_n, rows, num_stages, registers_per_sm, shared_memory_per_sm):
    """Split programs that fit on one SM at once: every program also launches the 128-thread TMA
    producer warpgroup, which is given the consumers' register count at launch (ptxas holds all of
    the kernel's code to that count, setmaxnreg or not)."""
    return _programs_that_fit(_consumer_registers(head_dim, block_n, rows), 2 * CONSUMER_THREADS,
                              split_kernel_shared_bytes(head_dim, block_n, rows, num_stages),
                              registers_per_sm, shared_memory_per_sm)


def split_kernel_registers(blocks_per_sm, registers_per_sm, producer_registers=None):
    """(producer, consumer) registers a thread of the split kernel's two warpgroups keep after
    setmaxnreg, or None to keep the even split: the producer warpgroup, one warp of which issues
    TMA loads, keeps ``producer_registers`` (default PRODUCER_REGISTERS) and the consumer takes what
    it gives up, within the program's launch share (at most 240)."""
    producer = PRODUCER_REGISTERS if producer_registers is None else producer_registers
    if not producer:
        return None
    launch = min(248, registers_per_sm // (blocks_per_sm * 2 * CONSUMER_THREADS) // 8 * 8)
    return producer, min(240, 2 * launch - producer)


def short_cache_resident_programs(head_dim, block_n, rows, registers_per_sm, shared_memory_per_sm):
    """Short-cache programs (one warpgroup; q, K and V tiles, P for tiles under 64 rows) that fit on
    one SM at once."""
    shared = (rows + 2 * block_n) * head_dim * 2 + (rows * block_n * 2 if rows < 64 else 0) + 1024
    return _programs_that_fit(_consumer_registers(head_dim, block_n, rows), CONSUMER_THREADS, shared,
                              registers_per_sm, shared_memory_per_sm)


def resident_programs_for(problem, profile) -> int:
    """Split programs of this call's kernel one SM holds at once, with the shipped knobs (the
    planner sizes a single sequence's grid to one wave of them)."""
    return _resident_programs_for(problem, profile, NUM_STAGES, MIN_Q_ROWS)


@functools.lru_cache(maxsize=1024)
def _resident_programs_for(problem, profile, num_stages, min_q_rows):
    block_n = planner.choose_block_n(problem, profile)
    return resident_programs(problem.headdim, block_n, q_tile_rows(problem.group, min_q_rows), num_stages,
                             profile.registers_per_multiprocessor, profile.shared_memory_per_multiprocessor)


@T.macro
def _blocks(seqlens, b, capacity, block_n):
    """KV blocks of sequence b, its length clamped to [0, capacity]."""
    return T.ceildiv(T.min(T.max(seqlens[b], 0), capacity), block_n)


@T.macro
def _chunk(seqlens, batch, capacity, programs, forced_splits, min_chunk, block_n, can_split, counts):
    """Blocks per split when ``programs`` are balanced over the batch (1 if unused).

    The lengths are read SCAN_WIDTH at a time by all threads at once into ``counts`` (shared),
    then summed from there: one memory round trip per step instead of one per sequence."""
    chunk = T.alloc_var(T.int32, init=1)
    if can_split:
        if forced_splits <= 0:
            total = T.alloc_var(T.int32, init=0)
            for c in T.serial(T.ceildiv(batch, SCAN_WIDTH)):
                for t in T.Parallel(SCAN_WIDTH):
                    counts[t] = T.if_then_else(c * SCAN_WIDTH + t < batch,
                                               _blocks(seqlens, c * SCAN_WIDTH + t, capacity, block_n), 0)
                for t in T.serial(T.min(SCAN_WIDTH, batch - c * SCAN_WIDTH)):
                    total += counts[t]
            chunk = T.max(min_chunk, T.ceildiv(total, T.max(programs - batch, 1)))
    return chunk


@T.macro
def _splits(nblk, chunk, forced_splits, can_split):
    """splits_b of a sequence with ``nblk`` blocks (1 when forced_splits <= 0 and not can_split)."""
    sp = T.max(1, T.min(forced_splits, nblk))
    if can_split:
        sp = T.if_then_else(forced_splits > 0, sp, T.max(1, T.ceildiv(nblk, chunk)))
    return sp


@T.macro
def _load_splits(seqlens, batch, capacity, chunk, forced_splits, block_n, can_split, counts, step):
    """counts[t] = splits_b of sequence b = step * SCAN_WIDTH + t (0 past the batch), all threads
    at once."""
    for t in T.Parallel(SCAN_WIDTH):
        counts[t] = T.if_then_else(
            step * SCAN_WIDTH + t < batch,
            _splits(_blocks(seqlens, step * SCAN_WIDTH + t, capacity, block_n), chunk, forced_splits,
                    can_split), 0)


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
    def attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale, n_valid):
        """One online-softmax step over a K/V tile whose first ``n_valid`` tokens count."""
        T.clear(s_f)
        T.gemm(q_s, k_s, s_f, transpose_B=True, policy=policy)
        for i, j in T.Parallel(rows, block_n):
            s_f[i, j] = T.if_then_else(j < n_valid, s_f[i, j] * scale, -T.infinity(f32))
        T.copy(m_f, m_prev)
        T.reduce_max(s_f, m_f, dim=1, clear=False)
        for i in T.Parallel(rows):
            alpha[i] = T.exp2(m_prev[i] - m_f[i])
        for i, j in T.Parallel(rows, block_n):
            s_f[i, j] = T.exp2(s_f[i, j] - m_f[i])
        T.reduce_sum(s_f, rsum, dim=1)
        for i in T.Parallel(rows):
            l_f[i] = l_f[i] * alpha[i] + rsum[i]
        for i, d in T.Parallel(rows, head_dim):
            o_f[i, d] *= alpha[i]
        T.copy(s_f, p_f)  # p_f: a register fragment (64-row tile) or shared memory (smaller tiles)
        T.gemm(p_f, v_s, o_f, policy=policy)

    return attend


def _load_macros(rows, block_n, head_dim, group, dtype):
    """The loads both the split and the short-cache kernel make with all their threads: the q tile
    (the G query heads of KV head h, zero rows below it) and a K/V tile of which only the rows
    before ``seqlen`` are read (the others are zero: p = 0 there, and 0 * a stale NaN past the end
    would be NaN)."""

    @T.macro
    def load_q(Q, q_s, b, h):
        for i, d in T.Parallel(rows, head_dim):
            q_s[i, d] = T.if_then_else(i < group, Q[b, 0, h * group + i, d], T.cast(0, dtype))

    @T.macro
    def load_tile(K, V, k_s, v_s, b, h, base, seqlen):
        for j, d in T.Parallel(block_n, head_dim):
            k_s[j, d] = T.if_then_else(base + j < seqlen, K[b, base + j, h, d], T.cast(0, dtype))
            v_s[j, d] = T.if_then_else(base + j < seqlen, V[b, base + j, h, d], T.cast(0, dtype))

    return load_q, load_tile


def _write_out_macro(rows, head_dim, group, dtype):
    """Writes a finished sequence's ``out`` and ``lse`` (natural log) for the G heads of KV head h:
    0 and -inf for no tokens, NaN rows for a length outside [0, capacity] (``bad``)."""
    f32 = T.float32

    @T.macro
    def write_out(Out, Lse, o_f, l_f, m_f, b, h, bad):
        for i, d in T.Parallel(rows, head_dim):
            if i < group:
                o = T.if_then_else(l_f[i] == 0, 0, o_f[i, d] / l_f[i])
                Out[b, 0, h * group + i, d] = T.cast(T.if_then_else(bad, _NAN, o), dtype)
        for i in T.Parallel(rows):
            if i < group:
                Lse[b, h * group + i] = T.if_then_else(
                    l_f[i] == 0, -T.infinity(f32), (T.log2(l_f[i]) + m_f[i]) * _LN2)

    return write_out


def build_split_kernel(dtype: str, head_dim: int, group: int, kv_heads: int, block_n: int,
                       num_stages: int, can_split: bool, blocks_per_sm: int, q_rows: int = 64,
                       register_split=None, target=None):
    """Compiled split kernel (cached): a q tile of ``q_rows`` rows, ``CONSUMER_THREADS`` consumer
    threads and a TMA producer warpgroup.  ``blocks_per_sm`` is the occupancy ptxas must allow
    (``__launch_bounds__``).  ``target`` defaults to the local GPU; pass e.g.
    {"kind": "cuda", "arch": "sm_90a"} to build without one.  ``register_split``: (producer,
    consumer) registers a thread after setmaxnreg, or None for an even split.

    Call: (q, k_cache, v_cache, cache_seqlens, out, lse, part_o, part_lse,
    programs, forced_splits, min_chunk, softmax_scale); grid (programs, kv_heads).
    """
    return _split_kernel(dtype, head_dim, group, kv_heads, block_n, num_stages, bool(can_split),
                         blocks_per_sm, q_rows, register_split and tuple(register_split), _freeze(target))


@functools.lru_cache(maxsize=None)
def _split_kernel(dtype, D, G, Hk, block_n, num_stages, can_split, blocks_per_sm, q_rows, register_split, target):
    # The macro is the guard's bound, and as a compile flag it is part of TileLang's cache key, so a
    # kernel built without the rewrite is never loaded from the cache for this one.
    with _cuda_postproc(one_warp_producer, _SPLIT_KERNEL_NAME):
        kernel = _compile(split_kernel_func(dtype, D, G, Hk, block_n, num_stages, can_split, blocks_per_sm, q_rows,
                                            register_split),
                          target, [f"-D{_PRODUCER_LOOP_MACRO}={PRODUCER_LOOP_THREADS}"])
    if _PRODUCER_LOOP_MACRO not in kernel.get_kernel_source():
        raise RuntimeError("the split kernel was built without its one-warp producer loop")
    return kernel


def _tile_macros(rows, block_n, head_dim, group, dtype):
    """What both attention kernels are built from, for a q tile of ``rows`` rows (the group's G
    query heads, zero-padded) and K/V tiles of ``block_n`` tokens: (softmax_state, attend,
    write_out, load_q, load_tile). A 64-row tile runs wgmma with whole rows per warp, a smaller
    one mma.sync with the warps splitting the columns."""
    if not 1 <= group <= rows:
        raise ValueError(f"group size {group} does not fit a q tile of {rows} rows")
    policy = T.GemmWarpPolicy.FullRow if rows >= 64 else T.GemmWarpPolicy.FullCol
    return (_softmax_state_macro(rows, block_n, head_dim, dtype), _attend_macro(rows, block_n, head_dim, policy),
            _write_out_macro(rows, head_dim, group, dtype), *_load_macros(rows, block_n, head_dim, group, dtype))


def split_kernel_func(dtype, D, G, Hk, block_n, num_stages, can_split, blocks_per_sm, q_rows, register_split=None):
    """The split kernel as a TileLang prim_func, before compilation (``build_split_kernel``)."""
    Hq = Hk * G
    rows, threads = q_rows, CONSUMER_THREADS
    softmax_state, attend, write_out, load_q, load_tile = _tile_macros(rows, block_n, D, G, dtype)
    shared_registers = blocks_per_sm > 1
    B, S, W = T.dynamic("batch, capacity, workspace_rows")
    f32 = T.float32

    @T.prim_func
    def decode_split(
        Q: T.Tensor((B, 1, Hq, D), dtype),
        K: T.Tensor((B, S, Hk, D), dtype),
        V: T.Tensor((B, S, Hk, D), dtype),
        seqlens: T.Tensor((B,), T.int32),
        Out: T.Tensor((B, 1, Hq, D), dtype),
        Lse: T.Tensor((B, Hq), f32),
        PartO: T.Tensor((W, Hq, D), f32),
        PartLse: T.Tensor((W, Hq), f32),
        programs: T.int32,
        forced_splits: T.int32,
        min_chunk: T.int32,
        softmax_scale: f32,
    ):
        with T.Kernel(programs, Hk, threads=threads) as (pid, h):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            if register_split is not None:  # the producer keeps few registers, the consumer the rest
                T.annotate_producer_reg_dealloc(register_split[0])
                T.annotate_consumer_reg_alloc(register_split[1])
            elif shared_registers:
                T.no_set_max_nreg()  # two programs per SM: keep the even register split
            q_s = T.alloc_shared((rows, D), dtype)
            k_s = T.alloc_shared((block_n, D), dtype)
            v_s = T.alloc_shared((block_n, D), dtype)
            k_tail = T.alloc_shared((block_n, D), dtype)  # shares memory with k_s/v_s once
            v_tail = T.alloc_shared((block_n, D), dtype)  # the pipelined loop is done
            s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum = softmax_state()
            counts = T.alloc_shared((SCAN_WIDTH,), T.int32)

            # This program's (sequence, split); seq stays -1 when it has no work.
            seq = T.alloc_var(T.int32, init=-1)
            split = T.alloc_var(T.int32, init=0)
            nsplit = T.alloc_var(T.int32, init=1)
            if can_split or forced_splits > 0:
                chunk = _chunk(seqlens, B, S, programs, forced_splits, min_chunk, block_n, can_split, counts)
                first = T.alloc_var(T.int32, init=0)
                for c in T.serial(T.ceildiv(B, SCAN_WIDTH)):
                    _load_splits(seqlens, B, S, chunk, forced_splits, block_n, can_split, counts, c)
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
            seqlen = T.min(T.max(raw_len, 0), S)
            nblk = T.ceildiv(seqlen, block_n)
            blk_lo = T.cast(T.cast(split, T.int64) * nblk // nsplit, T.int32)
            blk_hi = T.cast(T.cast(split + 1, T.int64) * nblk // nsplit, T.int32)
            full_hi = T.min(blk_hi, seqlen // block_n)  # blocks before it hold only valid tokens
            scale = softmax_scale * _LOG2E

            load_q(Q, q_s, b, h)
            T.fill(o_f, 0)
            T.fill(l_f, 0)
            T.fill(m_f, -T.infinity(f32))

            for kb in T.Pipelined(blk_lo, full_hi, num_stages=num_stages):
                T.copy(K[b, kb * block_n:(kb + 1) * block_n, h, :], k_s)
                T.copy(V[b, kb * block_n:(kb + 1) * block_n, h, :], v_s)
                attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale, block_n)

            if full_hi < blk_hi:  # the sequence's last block, partially filled: only its valid rows
                base = full_hi * block_n
                load_tile(K, V, k_tail, v_tail, b, h, base, seqlen)
                attend(q_s, k_tail, v_tail, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, scale,
                       seqlen - base)

            if seq >= 0:
                if nsplit == 1:
                    write_out(Out, Lse, o_f, l_f, m_f, b, h, raw_len != seqlen)
                else:
                    for i, d in T.Parallel(rows, D):
                        if i < G:
                            PartO[pid, h * G + i, d] = o_f[i, d] / l_f[i]
                    for i in T.Parallel(rows):
                        if i < G:
                            PartLse[pid, h * G + i] = T.log2(l_f[i]) + m_f[i]

    return decode_split


def build_short_cache_kernel(dtype: str, head_dim: int, group: int, kv_heads: int, block_n: int,
                             blocks_per_sm: int, q_rows: int = 64, one_tile: bool = False, target=None):
    """Compiled kernel for short unsplit caches (``takes_short_cache``), cached.

    Grid (B, Hk), one warpgroup, no pipeline and no split (a q tile under 64 rows runs mma.sync,
    64 rows wgmma): the program loads q and the first tile's valid rows of K and V at once (the
    rest zero-filled), runs an online-softmax step per tile, loading each next tile after the step
    before, and writes out/lse. Without the split kernel's TMA pipeline, producer warpgroup and
    schedule, it is a short chain of memory round trips and fits 4 programs per SM; tiny caches are
    latency-bound, and a few tiles still beat the pipeline (perf log 21). ``one_tile``: the cache
    is at most one tile (``seqlen_cache <= block_n``), so the kernel has no loop, which measured
    ~0.5 us faster on cases 1-3 than the loop running once; only for such caches (it reads one
    tile whatever the capacity).

    ``blocks_per_sm``: the occupancy ptxas must allow (``short_cache_resident_programs``).
    Call: (q, k_cache, v_cache, cache_seqlens, out, lse, softmax_scale).
    """
    return _short_cache_kernel(dtype, head_dim, group, kv_heads, block_n, blocks_per_sm, q_rows, bool(one_tile),
                               _freeze(target))


@functools.lru_cache(maxsize=None)
def _short_cache_kernel(dtype, D, G, Hk, block_n, blocks_per_sm, rows, one_tile, target):
    Hq = Hk * G
    softmax_state, attend, write_out, load_q, load_tile = _tile_macros(rows, block_n, D, G, dtype)
    B, S = T.dynamic("batch, capacity")
    f32 = T.float32

    @T.prim_func
    def decode_short_cache(
        Q: T.Tensor((B, 1, Hq, D), dtype),
        K: T.Tensor((B, S, Hk, D), dtype),
        V: T.Tensor((B, S, Hk, D), dtype),
        seqlens: T.Tensor((B,), T.int32),
        Out: T.Tensor((B, 1, Hq, D), dtype),
        Lse: T.Tensor((B, Hq), f32),
        softmax_scale: f32,
    ):
        with T.Kernel(B, Hk, threads=CONSUMER_THREADS) as (b, h):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            q_s = T.alloc_shared((rows, D), dtype)
            k_s = T.alloc_shared((block_n, D), dtype)
            v_s = T.alloc_shared((block_n, D), dtype)
            s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum = softmax_state()

            raw_len = seqlens[b]
            seqlen = T.min(T.max(raw_len, 0), S)
            load_q(Q, q_s, b, h)
            if one_tile:
                load_tile(K, V, k_s, v_s, b, h, 0, seqlen)
            T.fill(o_f, 0)
            T.fill(l_f, 0)
            T.fill(m_f, -T.infinity(f32))
            if one_tile:
                if seqlen > 0:
                    attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, softmax_scale * _LOG2E,
                           seqlen)
            else:
                for t in T.serial(T.ceildiv(seqlen, block_n)):
                    load_tile(K, V, k_s, v_s, b, h, t * block_n, seqlen)
                    attend(q_s, k_s, v_s, s_f, p_f, o_f, m_f, l_f, m_prev, alpha, rsum, softmax_scale * _LOG2E,
                           seqlen - t * block_n)
            write_out(Out, Lse, o_f, l_f, m_f, b, h, raw_len != seqlen)

    return _compile(decode_short_cache, target)


def build_combine_kernel(dtype: str, head_dim: int, group: int, kv_heads: int, block_n: int,
                         can_split: bool, splits_per_step: int = 16, target=None):
    """Compiled combine kernel (cached), grid (B, Hq), one thread per head-dim element.

    Call: (cache_seqlens, part_o, part_lse, out, lse, capacity, programs, forced_splits, min_chunk).
    """
    return _combine_kernel(dtype, head_dim, group, kv_heads, block_n, bool(can_split), splits_per_step,
                           _freeze(target))


@functools.lru_cache(maxsize=None)
def _combine_kernel(dtype, D, G, Hk, block_n, can_split, step, target):
    Hq = Hk * G
    B, W = T.dynamic("batch, workspace_rows")
    f32 = T.float32

    @T.prim_func
    def decode_combine(
        seqlens: T.Tensor((B,), T.int32),
        PartO: T.Tensor((W, Hq, D), f32),
        PartLse: T.Tensor((W, Hq), f32),
        Out: T.Tensor((B, 1, Hq, D), dtype),
        Lse: T.Tensor((B, Hq), f32),
        capacity: T.int32,
        programs: T.int32,
        forced_splits: T.int32,
        min_chunk: T.int32,
    ):
        with T.Kernel(B, Hq, threads=D) as (bid, hq):
            d = T.get_thread_binding()
            part_lse = T.alloc_local((step,), f32)
            part_o = T.alloc_local((step,), f32)
            m = T.alloc_var(f32, init=-T.infinity(f32))
            m_new = T.alloc_var(f32)
            w_sum = T.alloc_var(f32, init=0)
            acc = T.alloc_var(f32, init=0)

            counts = T.alloc_shared((SCAN_WIDTH,), T.int32)
            chunk = _chunk(seqlens, B, capacity, programs, forced_splits, min_chunk, block_n, can_split, counts)
            first = T.alloc_var(T.int32, init=0)  # partial rows before this sequence's
            nsplit = T.alloc_var(T.int32, init=0)
            for c in T.serial(bid // SCAN_WIDTH + 1):
                _load_splits(seqlens, B, capacity, chunk, forced_splits, block_n, can_split, counts, c)
                for t in T.serial(T.min(SCAN_WIDTH, bid - c * SCAN_WIDTH)):
                    first += counts[t]
                if c == bid // SCAN_WIDTH:
                    nsplit = counts[bid % SCAN_WIDTH]

            if nsplit > 1:
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
                    w_sum = w_sum * T.exp2(m - m_new)
                    acc = acc * T.exp2(m - m_new)
                    for s in T.unroll(step):
                        w_sum = w_sum + T.exp2(part_lse[s] - m_new)
                        acc = acc + T.exp2(part_lse[s] - m_new) * part_o[s]
                    m = m_new
                bad = seqlens[bid] > capacity  # (a negative length never splits)
                Out[bid, 0, hq, d] = T.cast(T.if_then_else(bad, _NAN, acc / w_sum), dtype)
                if d == 0:
                    Lse[bid, hq] = (m + T.log2(w_sum)) * _LN2

    return _compile(decode_combine, target)


def device_target() -> dict:
    """The current CUDA device as an explicit TileLang target, e.g. {"kind": "cuda", "arch": "sm_90a"}.

    Explicit rather than "auto" so that a kernel built for it on a machine without the GPU (CI,
    ``benchmarks/prebuild_tilelang_cache.py``) has the same TileLang cache key as one built here.
    """
    import torch
    from tilelang.contrib import nvcc

    return {"kind": "cuda", "arch": f"sm_{nvcc.get_target_arch(torch.cuda.get_device_capability())}"}


@functools.lru_cache(maxsize=None)
def kernels_for(dtype: str, head_dim: int, group: int, kv_heads: int, block_n: int, can_split: bool,
                registers_per_sm: int, shared_memory_per_sm: int, num_stages: int, min_q_rows: int,
                producer_registers: int, target=None):
    """(split launcher, combine launcher or None) for one specialisation, built once.

    ``target``: a frozen target (``_freeze``); None means the current device's."""
    target = target if target is not None else _freeze(device_target())
    rows = q_tile_rows(group, min_q_rows)
    blocks_per_sm = resident_programs(head_dim, block_n, rows, num_stages, registers_per_sm,
                                      shared_memory_per_sm)
    split = build_split_kernel(dtype, head_dim, group, kv_heads, block_n, num_stages, can_split, blocks_per_sm,
                               rows, split_kernel_registers(blocks_per_sm, registers_per_sm, producer_registers), target=target)
    combine = (build_combine_kernel(dtype, head_dim, group, kv_heads, block_n, can_split, target=target)
               if can_split else None)
    return _launcher(split), combine and _launcher(combine)


@functools.lru_cache(maxsize=None)
def short_cache_kernel_for(dtype: str, head_dim: int, group: int, kv_heads: int, block_n: int,
                           registers_per_sm: int, shared_memory_per_sm: int, min_q_rows: int, one_tile: bool,
                           target=None):
    """The short-cache launcher for one specialisation, built once (``target`` as in kernels_for)."""
    target = target if target is not None else _freeze(device_target())
    rows = q_tile_rows(group, min_q_rows)
    blocks_per_sm = short_cache_resident_programs(head_dim, block_n, rows, registers_per_sm, shared_memory_per_sm)
    return _launcher(build_short_cache_kernel(dtype, head_dim, group, kv_heads, block_n, blocks_per_sm, rows,
                                              one_tile, target=target))


#: Most tiles of an unsplit cache the short-cache kernel takes; longer ones go to the split kernel's
#: pipeline. Measured (perf log 21): 3 tiles (case 5) 16% faster there, 6 tiles (case 6) 9% slower.
SHORT_CACHE_MAX_BLOCKS = 3


def takes_short_cache(problem, plan) -> bool:
    """Whether ``run`` takes the short-cache kernel: nothing splits and the cache has at most
    SHORT_CACHE_MAX_BLOCKS tiles (a forced split is capped to one for a one-tile cache)."""
    return not plan.can_split and -(-problem.seqlen_cache // plan.block_n) <= SHORT_CACHE_MAX_BLOCKS


def launchers_for(problem, plan, profile, target=None):
    """The launchers ``run`` uses for this call with the current knobs: (short-cache launcher, None)
    where ``takes_short_cache``, else (split launcher, combine launcher or None). ``target`` as in
    ``kernels_for``."""
    shape = (problem.dtype, problem.headdim, problem.group, problem.nheads_k, plan.block_n)
    registers, shared = profile.registers_per_multiprocessor, profile.shared_memory_per_multiprocessor
    if takes_short_cache(problem, plan):
        one_tile = problem.seqlen_cache <= plan.block_n
        return short_cache_kernel_for(*shape, registers, shared, SHORT_CACHE_MIN_Q_ROWS, one_tile, target), None
    return kernels_for(*shape, plan.can_split, registers, shared, NUM_STAGES, MIN_Q_ROWS, PRODUCER_REGISTERS, target)


def _launcher(kernel):
    """The compiled entry function behind a TileLang kernel.

    Calling it directly skips the tvm-ffi adapter's per-call Python work (rebuilding the argument
    list, looking the entry function up by name: ~8 us a call on the H200 machine's CPU, perf log
    section 5); the arguments are the same, and TVM-FFI still takes the current stream from torch.
    Falls back to the kernel object where TileLang lays this out differently.
    """
    try:
        executable = kernel.adapter._get_executable()
        module = executable.jit() if hasattr(executable, "jit") else executable
        return module.main
    except AttributeError:
        return kernel


def run(plan, problem, q, k_cache, v_cache, cache_seqlens, out, lse, part_o, part_lse, softmax_scale):
    """Launch the short-cache kernel where ``takes_short_cache``, else the split kernel, then the
    combine kernel when the plan may split.

    q, out: (B, 1, Hq, D) contiguous; k_cache, v_cache: (B, S, Hk, D) contiguous; lse: (B, Hq) fp32;
    part_o (P, Hq, D) and part_lse (P, Hq) fp32, 16-byte aligned (empty when nothing splits).
    """
    if problem.seqlen_cache == 0:  # no tokens anywhere (and no valid TMA descriptor for an empty cache)
        out.zero_().masked_fill_((cache_seqlens != 0)[:, None, None, None], math.nan)
        lse.fill_(-math.inf)
        return
    launch, combine = launchers_for(problem, plan, hardware.profile_for(q.device))
    if takes_short_cache(problem, plan):
        launch(q, k_cache, v_cache, cache_seqlens, out, lse, softmax_scale)
        return
    launch(q, k_cache, v_cache, cache_seqlens, out, lse, part_o, part_lse,
           plan.programs_per_head, plan.forced_splits, plan.min_chunk, softmax_scale)
    if combine is not None:
        combine(cache_seqlens, part_o, part_lse, out, lse, problem.seqlen_cache, plan.programs_per_head,
                plan.forced_splits, plan.min_chunk)
