"""Split-KV GQA decode in Triton: a split kernel over the plan and a combine kernel.

Grid (P, Hk): program (p, h) finds its sequence and KV block range from ``cache_seqlens`` with the
planner's rule (``flashdecode.planner``), loads the G query heads of KV head h as one (G, D) tile,
and streams its K/V blocks once, with an online softmax in base 2 (log2(e) folded into the scale)
and float32 accumulators. A sequence served by one program writes ``out``/``lse`` directly; the
others write float32 partials that ``_combine_kernel`` merges. Runs on CUDA, and on CPU tensors
under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import contextlib
import math
import re

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

LN2 = tl.constexpr(math.log(2.0))
LOG2E = 1.0 / math.log(2.0)
#: Partials the combine kernel loads at once (per query head): 16 for a batch, 64 for one sequence,
#: measured on the H200 (perf log 27): against 16, a step of 64 takes 0.5-3.2 us off cases 10, 13
#: and 14 (one sequence of ~70-100 splits) and adds 0.2-2.7 us to the batched cases 7-9, 11, 12.
COMBINE_SPLITS_PER_STEP = 16
COMBINE_SPLITS_PER_STEP_ONE_SEQUENCE = 64


def combine_splits_per_step(batch: int) -> int:
    """Partials the combine kernel loads at once for a batch of ``batch`` sequences."""
    return COMBINE_SPLITS_PER_STEP_ONE_SEQUENCE if batch == 1 else COMBINE_SPLITS_PER_STEP


#: Split programs one H200 SM holds at once, as ncu reported for the benchmark's kernels (head dim
#: 128: 38 KB of shared memory, 107 registers x 128 threads; docs/profiles/case12-triton); head dim
#: 256 doubles the tiles and runs 8 warps: half as many.
RESIDENT_PROGRAMS = {64: 4, 128: 4, 256: 2}


def resident_programs_for(problem, profile) -> int:
    """Split programs one SM holds at once (measured for the H200, see RESIDENT_PROGRAMS)."""
    return RESIDENT_PROGRAMS[problem.headdim]


@triton.jit
def _split_counts(Lens, batch, capacity, num_programs, forced_splits, min_chunk,
                  BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr):
    """The planner's device-side rule for all sequences: (offsets, raw lengths, splits, cumsum)."""
    offs = tl.arange(0, BATCH_PAD)
    raw = tl.load(Lens + offs, mask=offs < batch, other=0)
    blocks = tl.cdiv(tl.minimum(tl.maximum(raw, 0), capacity), BLOCK_N)
    chunk = tl.maximum(tl.cdiv(tl.sum(blocks, 0), tl.maximum(num_programs - batch, 1)), min_chunk)
    splits = tl.where(forced_splits > 0, tl.minimum(blocks, forced_splits), tl.cdiv(blocks, chunk))
    splits = tl.where(offs < batch, tl.maximum(splits, 1), 0)
    return offs, raw, splits, tl.cumsum(splits, 0)


@triton.jit
def _entry(offs, values, index):
    """values[index] of a vector indexed by offs."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


@triton.jit
def _locate(Lens, pid, batch, capacity, num_programs, forced_splits, min_chunk,
            BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, CAN_SPLIT: tl.constexpr):
    """Program pid's (sequence, split, splits of that sequence, raw length)."""
    if CAN_SPLIT:
        offs, raw, splits, ends = _split_counts(
            Lens, batch, capacity, num_programs, forced_splits, min_chunk, BLOCK_N, BATCH_PAD)
        seq = tl.sum((ends <= pid).to(tl.int32), 0)
        num_splits = _entry(offs, splits, seq)
        split = pid - (_entry(offs, ends, seq) - num_splits)
        raw_len = _entry(offs, raw, seq)
    else:
        seq = pid
        split = 0
        num_splits = 1
        raw_len = tl.load(Lens + tl.minimum(pid, batch - 1))
    return seq, split, num_splits, raw_len


@triton.jit(do_not_specialize=["batch", "capacity", "num_programs", "forced_splits", "min_chunk"])
def _split_kernel(Q, K, V, Lens, Out, Lse, PartO, PartLse,
                  scale_log2, batch, capacity, num_programs, forced_splits, min_chunk, nheads,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                  stride_vb, stride_vt, stride_vh, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, CAN_SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    head_k = tl.program_id(1)
    seq, split, num_splits, raw_len = _locate(
        Lens, pid, batch, capacity, num_programs, forced_splits, min_chunk, BLOCK_N, BATCH_PAD, CAN_SPLIT)
    if seq < batch:
        # Out-of-range lengths are clamped (no stray reads) and flagged with NaN outputs.
        length = tl.minimum(tl.maximum(raw_len, 0), capacity)
        valid = (raw_len >= 0) & (raw_len <= capacity)
        blocks = tl.cdiv(length, BLOCK_N)
        start = (split * blocks // num_splits) * BLOCK_N
        end = tl.minimum(((split + 1) * blocks // num_splits) * BLOCK_N, length)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        heads = head_k * GROUP + offs_g
        q_ptrs = Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=offs_g[:, None] < GROUP, other=0.0)
        # 64-bit offsets: a cache can exceed 2^31 elements, and so can a strided view's offsets.
        k_base = K + seq.to(tl.int64) * stride_kb + head_k.to(tl.int64) * stride_kh
        v_base = V + seq.to(tl.int64) * stride_vb + head_k.to(tl.int64) * stride_vh

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for block_start in range(start, end, BLOCK_N):
            tokens = block_start + offs_n
            in_range = tokens < end
            k = tl.load(k_base + tokens.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                        mask=in_range[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            scores = tl.where(in_range[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_base + tokens.to(tl.int64)[:, None] * stride_vt + offs_d[None, :],
                        mask=in_range[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        # Only l == 0 means "no tokens": a NaN in the data makes l NaN, and NaN must come out.
        empty = l == 0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
        lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l)))
        head_mask = offs_g < GROUP
        if num_splits == 1:
            o = tl.where(valid, o, float("nan"))
            out_ptrs = Out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=head_mask[:, None])
            tl.store(Lse + seq * nheads + heads, lse2 * LN2, mask=head_mask)
        else:
            part = pid * nheads + heads
            tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_mask[:, None])
            tl.store(PartLse + part, lse2, mask=head_mask)


@triton.jit(do_not_specialize=["batch", "capacity", "num_programs", "forced_splits", "min_chunk"])
def _combine_kernel(Lens, Out, Lse, PartO, PartLse,
                    batch, capacity, num_programs, forced_splits, min_chunk, nheads,
                    stride_ob, stride_oh,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr,
                    SPLITS_PER_STEP: tl.constexpr):
    """Merge the partials of one (sequence, query head) if that sequence was split; grid (B, Hq).

    Partials are read SPLITS_PER_STEP at a time, all loads of a step in flight together, and merged
    with a running max so any number of splits works."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs, raw, splits, ends = _split_counts(
        Lens, batch, capacity, num_programs, forced_splits, min_chunk, BLOCK_N, BATCH_PAD)
    num_splits = _entry(offs, splits, seq)
    first = _entry(offs, ends, seq) - num_splits
    raw_len = _entry(offs, raw, seq)
    if num_splits > 1:
        offs_s = tl.arange(0, SPLITS_PER_STEP)
        offs_d = tl.arange(0, HEAD_DIM)
        m = float("-inf")
        weight = 0.0
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for step in range(0, num_splits, SPLITS_PER_STEP):
            live = step + offs_s < num_splits
            part = (first + step + offs_s) * nheads + head
            part_lse = tl.load(PartLse + part, mask=live, other=float("-inf"))
            part_o = tl.load(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m, tl.max(part_lse, 0))  # a NaN partial still spoils w, hence the output
            w = tl.exp2(part_lse - m_new)
            alpha = tl.exp2(m - m_new)
            acc = acc * alpha + tl.sum(w[:, None] * part_o, 0)
            weight = weight * alpha + tl.sum(w, 0)
            m = m_new
        valid = (raw_len >= 0) & (raw_len <= capacity)
        o = tl.where(valid, acc / weight, float("nan"))
        tl.store(Out + seq * stride_ob + head * stride_oh + offs_d, o.to(Out.dtype.element_ty))
        tl.store(Lse + seq * nheads + head, (m + tl.log2(weight)) * LN2)


def run(plan, problem, q, k_cache, v_cache, seqlens, out, lse, part_o, part_lse, softmax_scale):
    """Launch the split kernel (and the combine kernel when the plan may split) on q's device.

    q, out: (B, 1, Hq, D); lse: (B, Hq) fp32; part_o: (P, Hq, D) fp32; part_lse: (P, Hq) fp32.
    """
    with _on_device(q.device):
        _launch(plan, problem, q, k_cache, v_cache, seqlens, out, lse, part_o, part_lse, softmax_scale)


def _on_device(device):
    """Triton launches on the current CUDA device: make it q's when it is not (no-op otherwise)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _launch(plan, problem, q, k_cache, v_cache, seqlens, out, lse, part_o, part_lse, softmax_scale):
    group = problem.group
    group_pad = max(16, triton.next_power_of_2(group))
    batch_pad = max(16, triton.next_power_of_2(problem.batch))
    num_warps = 4 if problem.headdim <= 128 else 8
    args = (problem.batch, problem.seqlen_cache, plan.programs_per_head, plan.forced_splits, plan.min_chunk)
    _launch_kernel(_split_kernel, plan.grid(problem), (q, k_cache, v_cache, seqlens, out, lse, part_o, part_lse), (
        softmax_scale * LOG2E, *args, problem.nheads,
        q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(2)),
        dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=problem.headdim, BLOCK_N=plan.block_n,
             BATCH_PAD=batch_pad, CAN_SPLIT=plan.can_split), dict(num_warps=num_warps, num_stages=2))
    if plan.needs_combine:
        _launch_kernel(_combine_kernel, (problem.batch, problem.nheads), (seqlens, out, lse, part_o, part_lse),
                       (*args, problem.nheads, out.stride(0), out.stride(2)),
                       dict(HEAD_DIM=problem.headdim, BLOCK_N=plan.block_n, BATCH_PAD=batch_pad,
                            SPLITS_PER_STEP=combine_splits_per_step(problem.batch)), dict(num_warps=4))


#: Compiled kernels by ``_specialization`` of a call: the direct launch path (``_launch_kernel``),
#: emptied when it holds MAX_COMPILED (each new capacity or batch power of two adds one).
_COMPILED: dict = {}
MAX_COMPILED = 4096
#: Triton versions whose ``JITFunction.run`` hands the compiled kernel's launcher every bound
#: argument, constexprs included, in signature order (read in 3.6, run on the H200, and 3.9): the
#: direct path passes them the same way, and older Triton keeps its own path.
DIRECT_LAUNCH_FROM_TRITON = (3, 6)
_DIRECT_LAUNCH = tuple(map(int, re.match(r"(\d+)\.(\d+)", triton.__version__).groups())) >= DIRECT_LAUNCH_FROM_TRITON
_SIGNATURES: dict = {}  # (id of a module-level kernel, tensor count, constexpr names) -> unspecialised flags


def _unspecialized(jit_fn, tensor_count: int, constexpr_names: tuple) -> tuple:
    """Whether each scalar argument (those after the first ``tensor_count``) is do_not_specialize,
    checked once per kernel: the constexprs must be its last parameters, in this order, since the
    direct path passes them by position. Keyed by id: hashing a JITFunction costs ~0.5 us, and the
    kernels live as long as the module."""
    key = (id(jit_fn), tensor_count, constexpr_names)
    flags = _SIGNATURES.get(key)
    if flags is None:
        names = jit_fn.arg_names
        if tuple(names[len(names) - len(constexpr_names):]) != constexpr_names:
            raise TypeError(f"{jit_fn.__name__}: constexprs {constexpr_names} are not its last parameters")
        skip = jit_fn.do_not_specialize
        flags = _SIGNATURES[key] = tuple(i in skip or name in skip for i, name in enumerate(names)
                                         if tensor_count <= i < len(names) - len(constexpr_names))
    return flags


def _specialization(jit_fn, tensors, scalars, constexprs, options, device_index):
    """Everything Triton's choice of compiled kernel depends on, at least as finely as Triton's own
    key: the kernel, device, constexprs and options, every tensor's dtype and 16-byte alignment,
    the exact value of every scalar argument (floats included, though Triton does not specialize
    them), except that of the ints marked do_not_specialize, whose 32- or 64-bit type Triton still
    tells apart. Triton's runtime knobs (debug, instrumentation) are taken as fixed for the process."""
    alignment = 0
    for tensor in tensors:
        alignment = alignment << 1 | (tensor.data_ptr() % 16 == 0)
    flags = _unspecialized(jit_fn, len(tensors), tuple(constexprs))
    values = tuple(-2**31 <= value < 2**31 if skip else value for skip, value in zip(flags, scalars))
    return (id(jit_fn), device_index, tuple(t.dtype for t in tensors), alignment, values, tuple(constexprs.values()),
            tuple(options.items()))


def _launch_kernel(jit_fn, grid, tensors, scalars, constexprs, options):
    """``jit_fn[grid](*tensors, *scalars, **constexprs, **options)`` (the kernel's arguments: its
    tensors first, then its scalars), after the first call of a specialisation through the compiled
    kernel directly: Triton's ``JITFunction.run`` binds and specialises every argument on every
    call (case 3's launch: 54 us of host time through it on the H200 machine, 24 us this way; perf
    log 22). The compiled kernel is looked up by ``_specialization``, which is at least as fine as
    Triton's own key, so the kernel launched is the one Triton would pick. Triton's path stays for
    CPU tensors, the interpreter (``TRITON_INTERPRET=1``, whatever the tensors) and Triton older
    than DIRECT_LAUNCH_FROM_TRITON. Our kernels have no pre-run hooks and no mutable globals, the
    two things ``JITFunction.run`` checks that this path does not."""
    device = tensors[0].device
    if device.type != "cuda" or not _DIRECT_LAUNCH or not isinstance(jit_fn, JITFunction):
        jit_fn[grid](*tensors, *scalars, **constexprs, **options)
        return
    key = _specialization(jit_fn, tensors, scalars, constexprs, options, device.index)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = jit_fn[grid](*tensors, *scalars, **constexprs, **options)
        if callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function"):
            if len(_COMPILED) >= MAX_COMPILED:
                _COMPILED.clear()
            _COMPILED[key] = compiled
        return
    launch = compiled[tuple(grid) + (1,) * (3 - len(grid))]  # the compiled kernel takes 3 dimensions
    launch(*tensors, *scalars, *constexprs.values(), stream=torch._C._cuda_getCurrentRawStream(device.index))
