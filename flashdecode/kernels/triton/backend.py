"""The Triton backend: its tile config, its answers to the planner, and the launch of a plan.

Runs on CUDA devices, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported). Every feature of ``docs/design.md`` ("Semantics") is a constexpr of
the kernels (``kernels``), so a plain decode compiles none of their code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import triton
from triton.runtime.jit import JITFunction

from ...hardware import HardwareProfile
from ...planner import SINGLE_PASS, SPLIT
from ...problem import Problem
from ..base import Backend, LaunchArgs
from .kernels import combine_kernel, split_kernel
from .launch import DEPENDENT_LAUNCH_UNAVAILABLE, REGISTER_CEILING, Launcher
from .workarounds import interpreter_limitation, steer

LOG2E = 1.0 / math.log(2.0)
#: Query rows of one program at most; more rows take more row tiles (programs).
MAX_BLOCK_M = 64
#: Partials the combine kernel loads at once: 16 for a batch, 128 for one sequence, whose programs
#: merge 32 head dims each (a batch's the whole head): one sequence's 50-400 splits load in 1-4 steps
#: over 4x the programs (docs/tuning.md).
COMBINE_STEP_BATCH, COMBINE_STEP_ONE_SEQUENCE, COMBINE_DIMS_ONE_SEQUENCE = 16, 128, 32
#: fp32 output values a thread holds at most: past it the default config doubles its warps (head dim
#: 256 with 64 query rows: 8 warps; every measured tile of ``triton_tiles`` stays within it).
MAX_OUTPUT_PER_THREAD = 64
#: Launch specs a backend keeps (one per (problem, plan) in use); past it the table starts again.
MAX_SPECS = 1024
INTERPRETED = not isinstance(split_kernel, JITFunction)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tile config of the split kernel and of the combine (a split kernel that merges loads
    ``merge_step_for(block_m)`` partials at once)."""

    block_n: int  # keys per KV block
    block_m: int  # packed query rows per program: the grid has ceil(seqlen_q * group / block_m) row tiles
    num_warps: int
    num_stages: int  # software pipeline depth of the main loop's K/V loads
    combine_step: int  # partials the combine kernel loads at once
    #: Registers a thread may use: a kernel the compiler gives more is compiled again with this cap
    #: (Triton's ``maxnreg``, ``launch.register_options``); None: the compiler's choice.
    max_registers: int | None = None
    #: Head dims one combine program merges (a power of two; None: the whole padded head): smaller
    #: chunks spread a row's partials over more programs.
    combine_dims: int | None = None
    #: fp8 caches: V read as 16-bit words (``attend.fp8_pair_to_f16``), not byte by byte; even head
    #: dims only, needs sm_89's fp8 conversions (``Tuning.triton_fp8_v_words``).
    fp8_v_words: bool = False


def shared_bytes(config: TritonConfig, headdim: int, element_bytes: int, profile: HardwareProfile,
                 cache_element_bytes: int | None = None) -> int:
    """Shared memory one split program needs, as Triton lays it out: stages - 1 buffered K and V
    tiles (of ``cache_element_bytes``, 1 for fp8; default ``element_bytes``), the q tile, the
    driver's reserve (padded ``headdim``)."""
    kv_bytes = element_bytes if cache_element_bytes is None else cache_element_bytes
    kv_tiles = (config.num_stages - 1) * 2 * config.block_n * kv_bytes
    return (kv_tiles + config.block_m * element_bytes) * headdim + profile.driver_reserved_shared_per_program


def by_headdim(table: tuple, headdim: int) -> int:
    """The value of a (head dim, value) table's first row at or above a padded head dim (its last
    row's past them)."""
    return next((value for dim, value in table if dim >= headdim), table[-1][1])


def resident_by_headdim(headdim: int, profile: HardwareProfile, paged: bool = False) -> int:
    """The profile's ``triton_resident_programs`` entry for a padded head dim
    (``triton_paged_resident_programs``'s for a paged cache, where the tuning has that table)."""
    tuning = profile.tuning
    table = (paged and tuning.triton_paged_resident_programs) or tuning.triton_resident_programs
    return by_headdim(table, headdim)


#: Programs of at most this many KV blocks are mostly their head and tail (``split_32_row_resident``:
#: case 6's programs of 2 blocks gained at 3 an SM, case 8's of 11 with 4 query tokens lost).
SHORT_PROGRAM_BLOCKS = 4


def split_32_row_resident(problem: Problem, kernel: str, config: TritonConfig, profile: HardwareProfile,
                          programs: int, blocks: int) -> int | None:
    """The programs an SM ``triton_split_32_row_resident_programs`` gives the split kernel's 32-row
    tile over several query tokens (contiguous 16-bit caches, where measured), where below the
    tables' count, else None. Such a tile spills under the tables' cap. Fewer programs an SM pay
    where a grid of ``programs`` working programs fits one wave at that count, where it fills two
    or more (the spills then cost more than a fourth program gains), or where a batch's programs
    stream at most ``SHORT_PROGRAM_BLOCKS`` (their spilled head and tail outweigh the loop; one
    sequence's grid is sized in whole waves of the tables' count). Between one and two waves of
    longer programs the fourth program an SM wins (docs/tuning.md, iterations 56)."""
    table = profile.tuning.triton_split_32_row_resident_programs
    if not (table and kernel == SPLIT and problem.seqlen_q > 1 and problem.cache_dtype is None
            and not problem.paged and config.block_m == 32):
        return None
    headdim = padded_headdim(problem.headdim)
    resident = by_headdim(table, headdim)
    if resident >= resident_by_headdim(headdim, profile):
        return None
    wave = resident * profile.multiprocessors
    short = problem.batch > 1 and blocks <= SHORT_PROGRAM_BLOCKS
    return resident if programs <= wave or programs >= 2 * wave or short else None


def register_cap(config: TritonConfig, headdim: int, profile: HardwareProfile, paged: bool = False,
                 resident: int | None = None) -> int | None:
    """Registers a thread may use so that ``resident_by_headdim`` programs fit a multiprocessor (or
    ``resident``, ``split_32_row_resident``'s fewer); None where no cap is needed (the
    compiler's limit already lets them fit), where the fp32 output and score tiles would take more
    than half of it (it would spill them: iterations 47), or where the output tile alone would take
    more than a quarter of it (a paged cache's tile then takes the contiguous table's cap). Features
    add registers (pages, appended tokens, 32 query rows), i.e. fewer programs per SM and a second
    wave without the cap (docs/tuning.md)."""
    if resident is None:
        resident = resident_by_headdim(headdim, profile, paged)
    threads = profile.wave_width * config.num_warps
    cap = profile.registers_per_multiprocessor // (resident * threads) // 8 * 8
    if cap >= profile.max_registers_per_thread:
        return None
    if config.block_m * (headdim + config.block_n) > threads * cap // 2:
        return None
    if config.block_m * headdim > threads * cap // 4:
        return register_cap(config, headdim, profile) if paged else None
    return cap


def merge_step_for(block_m: int) -> int:
    """Partials the merging program loads at once: 4 for row tiles of up to 16 rows, 2 above, where
    4 would spill (docs/tuning.md)."""
    return 4 if block_m <= 16 else 2


def retiled(config: TritonConfig, headdim: int, profile: HardwareProfile, paged: bool = False,
            resident: int | None = None, **changes) -> TritonConfig:
    """``config`` with ``changes`` (a sweep's tile), its register ceiling derived again for the new
    tile (``register_cap``'s ``paged`` and ``resident``) unless ``changes`` names one (``headdim``
    padded)."""
    config = dataclasses.replace(config, **changes)
    if "max_registers" in changes:
        return config
    return dataclasses.replace(config, max_registers=register_cap(config, headdim, profile, paged, resident))


def fp8_stages(problem: Problem, profile: HardwareProfile) -> int:
    """The tuning's ``triton_fp8_stages`` for a contiguous fp8 cache, else 0 (measured only there)."""
    return profile.tuning.triton_fp8_stages if problem.cache_dtype is not None and not problem.paged else 0


def pipelined(config: TritonConfig, problem: Problem, profile: HardwareProfile, programs: int,
              blocks: int) -> TritonConfig:
    """The tuning's ``triton_pipelined_stages`` for programs of at least that many blocks less one
    where the grid's ``programs`` working programs all stay resident at that depth: a grid that
    leaves shared memory over lets each program keep several of its blocks in flight instead of
    waiting on memory once a block. A grid that fills the device keeps the table's stages: fewer
    programs an SM would cost it a second wave. Only where measured: contiguous 16-bit caches
    without appended tokens or rotary, head dims 64-128 (docs/tuning.md)."""
    stages, headdim = profile.tuning.triton_pipelined_stages, padded_headdim(problem.headdim)
    if (not stages or fp8_stages(problem, profile) or blocks < stages - 1 or config.num_stages >= stages
            or problem.paged or problem.seqlen_new > 0 or problem.rotary_dim > 0 or headdim not in (64, 128)):
        return config
    deeper = dataclasses.replace(config, num_stages=stages)
    per_multiprocessor = min(resident_by_headdim(headdim, profile), profile.shared_memory_per_multiprocessor //
                             shared_bytes(deeper, headdim, problem.element_bytes, profile,
                                          problem.cache_element_bytes))
    return deeper if programs <= per_multiprocessor * profile.multiprocessors else config


def padded_headdim(headdim: int) -> int:
    """The head dim the kernels compute with: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(headdim))


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it q's when it is not (no-op otherwise)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class _LaunchSpec:
    """What a (problem, plan) launches with, computed once: grids, constexprs, options, and the
    scalars that do not change between calls."""

    split_grid: tuple
    split_constexprs: dict
    split_options: dict
    combine_grid: tuple | None
    combine_constexprs: dict
    combine_options: dict
    schedule: tuple  # batch, capacity, programs per head, forced splits, min chunk
    features: tuple  # seqlen_new, window_left, window_right (None where unused)
    tickets: int  # ticket counters a merging split kernel needs (``Plan.ticket_count``; 0: none)


class TritonBackend(Backend):
    """Split kernel over the plan's grid, then the combine of split sequences."""

    name = "triton"

    def __init__(self):
        self.launcher = Launcher()
        self._specs: dict = {}

    # -- the planner's questions -------------------------------------------------------------------
    def limitation(self, problem: Problem, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None
        if device.type == "cpu" and INTERPRETED:
            return interpreter_limitation(problem)
        return "a CUDA device, or TRITON_INTERPRET=1 for CPU tensors"

    def kernels(self, problem: Problem) -> frozenset[str]:
        return frozenset((SINGLE_PASS, SPLIT))

    def default_config(self, problem: Problem, profile: HardwareProfile, kernel: str) -> TritonConfig:
        """block_n, warps and stages from the profile's ``triton_tiles`` by padded head dim (stages:
        ``fp8_stages`` where set); block_m: the packed rows (ragged on a small cache,
        ``Tuning.ragged_query_tiles_max_cache_bytes``: one query's) rounded up to a power of two, 16
        to MAX_BLOCK_M; warps doubled while the fp32 output tile holds more than
        MAX_OUTPUT_PER_THREAD values a thread; block_n halved (down to 16), then stages dropped (down
        to 2), then block_m halved (more row tiles), until ``shared_bytes`` fits a multiprocessor;
        then steered off a Triton miscompile (``workarounds``)."""
        if kernel not in self.kernels(problem):
            raise ValueError(f"kernel must be one of {sorted(self.kernels(problem))} for backend 'triton', "
                             f"got {kernel!r}")
        headdim = padded_headdim(problem.headdim)
        table = profile.tuning.triton_tiles
        _, block_n, num_warps, num_stages = next((row for row in table if row[0] >= headdim), table[-1])
        num_stages = fp8_stages(problem, profile) or num_stages
        # Ragged on a small cache: a tile holds one query's rows (at least 16); the tiles past a
        # sequence's own rows read nothing, and a sequence's further tiles read its keys again.
        one_query = problem.ragged and problem.cache_bytes() <= profile.tuning.ragged_query_tiles_max_cache_bytes
        rows = min(problem.q_rows, problem.group) if one_query else problem.q_rows
        block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
        while block_m * headdim > MAX_OUTPUT_PER_THREAD * profile.wave_width * num_warps and num_warps < 8:
            num_warps *= 2
        one_sequence = problem.batch == 1
        config = TritonConfig(block_n, block_m, num_warps, num_stages,
                              COMBINE_STEP_ONE_SEQUENCE if one_sequence else COMBINE_STEP_BATCH,
                              combine_dims=min(COMBINE_DIMS_ONE_SEQUENCE, headdim) if one_sequence else None,
                              fp8_v_words=profile.tuning.triton_fp8_v_words and problem.cache_dtype is not None)
        while shared_bytes(config, headdim, problem.element_bytes, profile, problem.cache_element_bytes) > \
                profile.shared_memory_per_multiprocessor:
            if config.block_n > 16:
                config = dataclasses.replace(config, block_n=config.block_n // 2)
            elif config.num_stages > 2:
                config = dataclasses.replace(config, num_stages=config.num_stages - 1)
            elif config.block_m > 16:  # more row tiles
                config = dataclasses.replace(config, block_m=config.block_m // 2)
            else:
                break
        config = retiled(config, headdim, profile, problem.paged)
        return steer(problem, config, headdim)  # a Triton miscompile (``workarounds``)

    def for_grid(self, config: TritonConfig, problem: Problem, profile: HardwareProfile, kernel: str,
                 programs: int, blocks: int) -> TritonConfig:
        """``config`` with a deeper pipeline where the grid leaves shared memory over (``pipelined``)
        and the register cap of ``split_32_row_resident``'s programs an SM where it gives any."""
        config = pipelined(config, problem, profile, programs, blocks)
        resident = split_32_row_resident(problem, kernel, config, profile, programs, blocks)
        if resident is None:
            return config
        return retiled(config, padded_headdim(problem.headdim), profile, problem.paged, resident)

    def merges_in_split(self, problem: Problem) -> bool:
        """Every problem: the split kernel can merge its partials itself (``merge_if_last``)."""
        return True

    def launches_dependent_combine(self, problem: Problem) -> bool:
        """Where Triton has grid-dependency control and compiles the kernels (``DEPENDENT_LAUNCH_UNAVAILABLE``)."""
        return DEPENDENT_LAUNCH_UNAVAILABLE is None

    def resident_programs(self, problem: Problem, config, profile: HardwareProfile) -> int:
        """From the profile's measured ``triton_resident_programs``, by padded head dim, or fewer
        where ``config``'s register cap lets fewer fit (``split_32_row_resident``'s cap)."""
        resident = resident_by_headdim(padded_headdim(problem.headdim), profile)
        if config is None or config.max_registers is None:
            return resident
        threads = profile.wave_width * config.num_warps
        return max(1, min(resident, profile.registers_per_multiprocessor // (config.max_registers * threads)))

    # -- the launch --------------------------------------------------------------------------------
    def launch(self, plan, problem: Problem, args: LaunchArgs) -> None:
        """The split kernel over ``plan.grid(problem)``, then the combine when the plan splits
        (``launches`` says with what)."""
        with _on_device(args.q.device):
            for launch in self.launches(plan, problem, args):
                self.launcher.launch(*launch)

    def host_launches(self, plan, problem: Problem, args: LaunchArgs) -> list | None:
        """``launches`` as CudaLaunches of the kernels ``launch`` just compiled or ran (None where the
        launcher cannot describe one, ``Launcher.cuda_launch``)."""
        described = [self.launcher.cuda_launch(*launch) for launch in self.launches(plan, problem, args)]
        return None if any(launch is None for launch in described) else described

    def launches(self, plan, problem: Problem, args: LaunchArgs) -> list:
        """[(kernel, grid, tensors, scalars, constexprs, options)] of the plan, in launch order. Unused
        features pass None (Triton compiles None as a constant). lse, part_o and part_lse must be
        contiguous, as ``DecodeContext`` allocates them, and a merging plan needs its ticket counters;
        the other tensors need a contiguous last dimension only."""
        spec = self._spec(plan, problem)
        if spec.tickets and (args.tickets is None or args.tickets.numel() < spec.tickets
                             or args.tickets.dtype != torch.int32):
            got = "None" if args.tickets is None else f"{args.tickets.numel()} {args.tickets.dtype}"
            raise ValueError(f"tickets: a plan that merges in the split kernel needs {spec.tickets} zeroed int32 "
                             f"counters (Plan.ticket_count), got {got}")
        q, k_cache, v_cache, out = args.q, args.k_cache, args.v_cache, args.out
        k_new, v_new, cos, table, alibi = args.k_new, args.v_new, args.rotary_cos, args.block_table, args.alibi_slopes
        k_descale, v_descale = args.k_descale, args.v_descale  # (B, Hk) views with fp8 caches, else None
        if problem.cache_dtype is not None and (k_descale is None or v_descale is None):
            raise ValueError("k_descale, v_descale: an fp8 cache needs both as float32 (batch, nheads_k) views "
                             "(LaunchArgs)")
        softcap_in = softcap_out = None
        if problem.softcap:
            softcap_in = 2.0 * LOG2E * args.softmax_scale / args.softcap
            softcap_out = args.softcap * LOG2E
        total_q = q.shape[0] if problem.ragged else None
        out_strides = _sequence_strides(out, problem)
        scalars = (
            args.softmax_scale * LOG2E, softcap_in, softcap_out, *spec.schedule, *spec.features,
            k_cache.shape[0] if problem.paged or problem.batch_idx else None,
            None if cos is None else cos.shape[0], total_q,
            *_sequence_strides(q, problem), *k_cache.stride()[:3], *v_cache.stride()[:3], *out_strides,
            *((None,) * 3 if k_new is None else _sequence_strides(k_new, problem)),
            *((None,) * 3 if v_new is None else _sequence_strides(v_new, problem)),
            None if table is None else table.stride(0),
            alibi.stride(0) if alibi is not None and alibi.dim() == 2 else None,
            *((None,) * 2 if k_descale is None else k_descale.stride()),
            *((None,) * 2 if v_descale is None else v_descale.stride()))
        tensors = (q, k_cache, v_cache, args.cache_seqlens, out, args.lse, args.part_o, args.part_lse,
                   k_new, v_new, args.cache_batch_idx, args.cache_leftpad, table, cos, args.rotary_sin, alibi,
                   args.tickets, k_descale, v_descale, args.sinks, args.cu_seqlens_q)
        split_constexprs = spec.split_constexprs
        if split_constexprs["FP8_V_WORDS"] and (v_cache.data_ptr() % 16 or any(s % 2 for s in v_cache.stride()[:3])):
            # V's 16-bit words need even strides and addresses (16-byte aligned: the host path keys on that)
            split_constexprs = {**split_constexprs, "FP8_V_WORDS": False}
        launches = [(split_kernel, spec.split_grid, tensors, scalars, split_constexprs, spec.split_options)]
        if spec.combine_grid is not None:
            launches.append((
                combine_kernel, spec.combine_grid,
                (args.cache_seqlens, args.cache_leftpad, out, args.lse, args.part_o, args.part_lse, args.sinks,
                 args.cu_seqlens_q),
                (*spec.schedule, *spec.features[:2], total_q, *out_strides),
                spec.combine_constexprs, spec.combine_options))
        return launches

    def _spec(self, plan, problem: Problem) -> _LaunchSpec:
        """The memoized spec of (plan, problem), found by identity (the caller keeps both objects)."""
        key = (id(plan), id(problem))
        entry = self._specs.get(key)
        if entry is None or entry[0] is not plan or entry[1] is not problem:
            if len(self._specs) >= MAX_SPECS:
                self._specs.clear()
            entry = self._specs[key] = (plan, problem, _make_spec(plan, problem))
        return entry[2]


def _sequence_strides(tensor: torch.Tensor, problem: Problem) -> tuple:
    """(sequence, query position, head) strides of q, out, k or v: a ragged call's packed
    (total_q, heads, D) tensors step 0 between sequences (each program adds its rows' offset)."""
    if problem.ragged:
        return (0, *tensor.stride()[:2])
    return tensor.stride()[:3]


def fp8_v_words(config: TritonConfig, problem: Problem) -> bool:
    """The kernel's ``FP8_V_WORDS``: ``config.fp8_v_words`` over an fp8 cache of an even head dim."""
    return config.fp8_v_words and problem.cache_dtype is not None and problem.headdim % 2 == 0


def _make_spec(plan, problem: Problem) -> _LaunchSpec:
    config = plan.config
    page = problem.page_size
    if page and (page % config.block_n if page >= config.block_n else page & (page - 1)):
        # the kernels look a block up in one page, or each token in a power-of-two page (``cache_offsets``)
        raise ValueError(f"triton: block_n {config.block_n} must divide the page size {page}, or the page size "
                         f"be a power of two below it")
    batch_pad = max(16, triton.next_power_of_2(problem.batch))
    head_pad = padded_headdim(problem.headdim)
    append, leftpad = problem.seqlen_new > 0, problem.leftpad
    window_left, window_right = problem.window_left >= 0, problem.window_right >= 0
    schedule = (problem.batch, problem.seqlen_cache, plan.programs_per_head, plan.forced_splits, plan.min_chunk)
    features = (problem.seqlen_new if append else None, problem.window_left if window_left else None,
                problem.window_right if window_right else None)
    split_constexprs = dict(
        GROUP=problem.group, SEQLEN_Q=problem.seqlen_q, HEAD_DIM=problem.headdim, HEAD_PAD=head_pad,
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BATCH_PAD=batch_pad, CAN_SPLIT=plan.can_split,
        PAGE_SIZE=problem.page_size, OFFSETS_32=problem.paged and problem.offsets_32, APPEND=append,
        ROTARY_DIM=problem.rotary_dim, ROTARY_INTERLEAVED=problem.rotary_interleaved, ROTARY_PER_ROW=problem.windowed,
        WINDOW_LEFT=window_left, WINDOW_RIGHT=window_right, SOFTCAP=problem.softcap, ALIBI=problem.alibi,
        LEFTPAD=leftpad, BATCH_IDX=problem.batch_idx and not problem.paged, MERGE_IN_SPLIT=plan.merge_in_split,
        MERGE_STEP=merge_step_for(config.block_m) if plan.merge_in_split else 1,
        DEPENDENT_COMBINE=plan.dependent_combine, FP8=problem.cache_dtype is not None, SINKS=problem.sinks,
        RAGGED=problem.ragged, FP8_V_WORDS=fp8_v_words(config, problem))
    head_chunk = config.combine_dims or head_pad
    if head_chunk & (head_chunk - 1) or head_chunk > head_pad:
        raise ValueError(f"triton: combine_dims must be a power of two of at most the padded head dim {head_pad}, "
                         f"got {config.combine_dims}")
    combine_constexprs = dict(
        GROUP=problem.group, SEQLEN_Q=problem.seqlen_q, HEAD_DIM=problem.headdim, HEAD_PAD=head_pad,
        BLOCK_N=config.block_n, BATCH_PAD=batch_pad, SPLITS_PER_STEP=config.combine_step, HEAD_CHUNK=head_chunk,
        APPEND=append,
        LEFTPAD=leftpad, WINDOW_LEFT=window_left, EMPTY_ROWS=problem.windowed and problem.seqlen_q > 1,
        DEPENDENT_COMBINE=plan.dependent_combine, SINKS=problem.sinks, RAGGED=problem.ragged)
    split_options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.max_registers is not None:
        split_options[REGISTER_CEILING] = config.max_registers
    return _LaunchSpec(
        plan.grid(problem), split_constexprs, split_options,
        (problem.batch, problem.nheads_k * problem.q_rows, head_pad // head_chunk) if plan.needs_combine else None,
        combine_constexprs,
        dict(num_warps=4, launch_pdl=True) if plan.dependent_combine else dict(num_warps=4), schedule, features,
        plan.ticket_count(problem))
