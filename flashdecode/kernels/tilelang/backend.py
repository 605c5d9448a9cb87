"""The TileLang backend: Hopper kernels (TMA, warp-specialised pipeline, wgmma) for the planner's plans.

It decides nothing: ``plan.kernel`` says which kernel runs and ``plan.config`` its tile config; it
answers the planner's questions (:meth:`TileLangBackend.kernels`, ``default_config``,
``resident_programs``) and says what it cannot take (``limitation``). Kernels compile on first use
and are kept on the instance, in bounded caches keyed by (kernel, config, shape, target, profile).
TileLang is imported only then, so the backend can say that it is missing.
"""
import collections
import importlib.util
import math
import os
import threading

from ... import hardware
from ...planner import SHORT_CACHE, SINGLE_PASS, SPLIT
from ..base import Backend, FfiLaunch
from . import occupancy
from .config import KernelShape, ShortCacheConfig, SplitConfig
from .launch import is_ffi_function, launcher

#: Head dims the kernels take (their tiles and shared-memory budget are sized for these).
HEAD_DIMS = (64, 128, 256)
#: Most query rows (seqlen_q * group) of one KV head: one q tile of 64 rows.
MAX_Q_ROWS = 64
#: Fewest rows of the q tile of each kernel (wide heads excepted, below): 64 is one wgmma M tile; the
#: short-cache kernel's few softmax steps are all latency, where a 16-row mma.sync tile measured
#: faster (docs/tuning.md).
MIN_BLOCK_M = {SPLIT: 64, SINGLE_PASS: 64, SHORT_CACHE: 16}
#: Wide heads: from WIDE_HEAD_DIM, a split or single-pass q tile of at most WIDE_HEAD_BLOCK_M rows
#: runs mma.sync on tiles of WIDE_HEAD_BLOCK_N tokens (one program per SM), where one such program
#: fits a multiprocessor: faster than the 64-row wgmma tile on 32 tokens, whose output alone holds
#: 128 registers per consumer thread (docs/tuning.md). Its 4 warps need WIDE_HEAD_MIN_BLOCK_N tokens
#: per tile.
WIDE_HEAD_DIM, WIDE_HEAD_BLOCK_M, WIDE_HEAD_BLOCK_N, WIDE_HEAD_MIN_BLOCK_N = 256, 16, 64, 32
#: Problem features (``Problem.features``) the kernels implement (``features.py``); rotary, ALiBi,
#: cache_batch_idx and ragged q are left to the other backends.
FEATURES = frozenset(("seqlen_q>1", "paged", "append", "causal", "window", "softcap", "sinks", "fp8", "leftpad",
                      "heads_first"))
#: Most query positions per call (the q tile holds seqlen_q * group <= MAX_Q_ROWS rows).
MAX_SEQLEN_Q = 16
#: Fewest tokens per page: a tile gathers whole pages with one TMA load per page (and 128-byte column
#: chunk), and a load of fewer than 16 rows would make tiles of many tiny loads.
MIN_PAGE_SIZE = 16
#: The plan kernels it has, for every problem it takes (pages of any size included).
PLAN_KERNELS = frozenset((SHORT_CACHE, SINGLE_PASS, SPLIT))
#: Compiled kernels a backend keeps (least recently used dropped first), and launch lists it memoizes.
MAX_COMPILED, MAX_LAUNCHES = 128, 1024


def q_tile_rows(q_rows: int, minimum: int) -> int:
    """Rows of a q tile for ``q_rows`` query rows: a power of two, at least ``minimum``."""
    return max(minimum, 1 << (q_rows - 1).bit_length())


def problem_limitation(problem) -> str | None:
    """What of this problem the kernels cannot take, as the phrase after "needs", or None."""
    if not problem.dense:
        return ("contiguous, 16-byte aligned q, k_cache, v_cache, k, v and out (the caches may be heads-first: "
                "(batch, nheads_k, seqlen, headdim) seen through transpose(1, 2)), and a cache of q's batch rows")
    if problem.headdim not in HEAD_DIMS:
        return f"a head dim of 64, 128 or 256 (got {problem.headdim})"
    if problem.seqlen_q > MAX_SEQLEN_Q:
        return f"seqlen_q of at most {MAX_SEQLEN_Q} (got {problem.seqlen_q})"
    if problem.paged and problem.page_size < MIN_PAGE_SIZE:
        return f"a page_size of at least {MIN_PAGE_SIZE} (got {problem.page_size})"
    if problem.paged and problem.page_size & (problem.page_size - 1):  # e.g. 768: not run on a GPU yet
        return f"a power-of-two page_size (got {problem.page_size})"
    if problem.q_rows > MAX_Q_ROWS:
        return (f"at most {MAX_Q_ROWS} query rows per KV head, seqlen_q * group "
                f"(got {problem.seqlen_q} * {problem.group})")
    missing = [name for name in problem.features() if name not in FEATURES]
    if missing:
        return ", ".join(f"no {name}" for name in missing) + " (the TileLang kernels do not implement it)"
    return None


class TileLangBackend(Backend):
    """Executes plans with the TileLang kernels (``kernels.py``), built for the device's target."""

    name = "tilelang"

    def __init__(self):
        self._lock = threading.Lock()
        self._compiled = collections.OrderedDict()  # (kernel, config, shape, target, profile) -> kernel
        self._launches = {}  # (id(plan), id(problem), device) -> (plan, problem, launchers)
        self._hopper = {}  # device index -> bool
        self._targets = {}  # device index -> target dict
        self._unavailable = None

    # -- what it can take ------------------------------------------------------------------------
    def unavailable(self) -> str | None:
        if self._unavailable is None:
            self._unavailable = (_why_unavailable(),)
        return self._unavailable[0]

    def limitation(self, problem, device) -> str | None:
        reason = self.unavailable()
        if reason is not None:
            return reason
        if device.type != "cuda" or not self._is_hopper(device):
            return "a Hopper GPU (compute capability 9.x)"
        return self.problem_limitation(problem)

    def problem_limitation(self, problem) -> str | None:
        return problem_limitation(problem)

    def block_ids_read_from(self, plan) -> int:
        """Its kernels scan the block ids of whole tiles: from the tile holding the first visible key."""
        return plan.block_n

    def kernels(self, problem) -> frozenset[str]:
        return PLAN_KERNELS

    def default_config(self, problem, profile, kernel: str):
        """Split and single pass: ``block_n`` from the shared-memory rule, 2 stages, 64 q rows (wide
        heads: 16 rows on WIDE_HEAD_BLOCK_N tokens), producer registers 24, combine step 16; short
        cache: the rule's ``block_n``, 16 q rows, no loop when the capacity fits one tile. Paged
        caches keep that ``block_n``: a tile lies within one larger page or gathers several smaller
        ones (``features.py``), except in the split kernel with appended tokens, whose tiles stay
        within a page (TileLang took 3 minutes and more to compile its gathered tail), and with an
        fp8 cache, whose gathered tile TileLang 0.1.15 cannot convert (its thread-sync pass stops on
        the consumer's barrier)."""
        if kernel not in self.kernels(problem):
            raise ValueError(f"kernel must be one of {sorted(self.kernels(problem))} for backend 'tilelang', "
                             f"got {kernel!r}")
        block_n = occupancy.largest_block_n(problem, profile)
        block_m = q_tile_rows(problem.q_rows, MIN_BLOCK_M[kernel])
        if kernel == SHORT_CACHE:
            return ShortCacheConfig(block_n, block_m, one_tile=problem.seqlen_cache <= block_n)
        # appending or fp8: tiles within a page
        most_n = problem.page_size if problem.paged and (problem.seqlen_new or problem.cache_dtype) else math.inf
        wide = SplitConfig(min(WIDE_HEAD_BLOCK_N, most_n), WIDE_HEAD_BLOCK_M)
        if (problem.headdim >= WIDE_HEAD_DIM and problem.q_rows <= wide.block_m
                and wide.block_n >= WIDE_HEAD_MIN_BLOCK_N
                and occupancy.split_shared_bytes(problem, wide, profile) <= profile.shared_memory_per_multiprocessor):
            return wide
        return SplitConfig(min(block_n, most_n), block_m)

    def resident_programs(self, problem, config, profile) -> int:
        return occupancy.resident_programs(problem, config, profile)

    # -- running it ------------------------------------------------------------------------------
    def launch(self, plan, problem, args) -> None:
        """Queue the plan's kernels: the short-cache kernel, or the split kernel and, when sequences
        may split, the combine kernel (``calls`` says with what)."""
        if problem.seqlen_cache == 0:  # no keys anywhere (and no TMA descriptor for an empty cache)
            bad = (args.cache_seqlens + problem.seqlen_new != 0)[:, None, None, None]
            args.out.zero_().masked_fill_(bad, math.nan)
            if problem.sinks:  # a row without keys: the sink alone
                args.lse.copy_(args.sinks.view(1, -1, 1).expand_as(args.lse))
            else:
                args.lse.fill_(-math.inf)
            return
        for function, arguments in self.calls(plan, problem, args):
            function(*arguments)

    def host_launches(self, plan, problem, args) -> list | None:
        """``calls`` as FfiLaunches, where each function is a TVM-FFI entry (``launch.fast_entry`` found
        them)."""
        if problem.seqlen_cache == 0:
            return None
        calls = self.calls(plan, problem, args)
        if not all(is_ffi_function(function) for function, _ in calls):
            return None
        return [FfiLaunch(function, tuple(arguments)) for function, arguments in calls]

    def calls(self, plan, problem, args) -> list:
        """[(launcher, arguments)] of the plan's kernels, in launch order. Each takes the plain
        arguments, then those of the features the problem uses (``kernels.py`` lists the order)."""
        device = args.q.device
        key = (id(plan), id(problem), device)  # by identity: the caller's memo keeps both objects alive
        entry = self._launches.get(key)
        if entry is None or entry[0] is not plan or entry[1] is not problem:
            if len(self._launches) >= MAX_LAUNCHES:
                self._launches.clear()
            entry = self._launches[key] = (plan, problem, self._launchers(plan, problem, device))
        first, combine, plain = entry[2]
        # lse is (B, Hq, Sq); for one query position the kernels index it as (B, Hq), the same memory
        lse = args.lse.view(problem.batch, problem.nheads) if problem.seqlen_q == 1 else args.lse
        extra = () if plain else _feature_arguments(problem, args)
        k_cache, v_cache = args.k_cache, args.v_cache
        if problem.heads_first:  # the (B, Hk, T, D) tensors the transposed views are of
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        if plan.kernel == SHORT_CACHE:
            return [(first, (args.q, k_cache, v_cache, args.cache_seqlens, args.out, lse, args.softmax_scale, *extra))]
        calls = [(first, (args.q, k_cache, v_cache, args.cache_seqlens, args.out, lse, args.part_o, args.part_lse,
                          plan.programs_per_head, plan.forced_splits, plan.min_chunk, args.softmax_scale, *extra))]
        if combine is not None:
            calls.append((combine, (args.cache_seqlens, args.part_o, args.part_lse, args.out, lse,
                                    problem.seqlen_cache, plan.programs_per_head, plan.forced_splits,
                                    plan.min_chunk, *(() if plain else _combine_feature_arguments(problem, args)))))
        return calls

    def compiled(self, kernel: str, problem, config, profile, target: dict):
        """The compiled TileLang kernel object of ``kernel`` (a plan kernel, or "combine" with the
        split kernel's ``config``) for this problem, built once per (config, shape, target, profile).
        ``target`` e.g. {"kind": "cuda", "arch": "sm_90a"}: kernels build without the GPU."""
        from . import build

        shape = KernelShape.of(problem)
        key = (kernel, config, shape, tuple(sorted(target.items())), profile)
        with self._lock:
            built = self._compiled.get(key)
            if built is not None:
                self._compiled.move_to_end(key)
                return built
        if kernel == SHORT_CACHE:
            built = build.short_cache(shape, config, profile, target)
        elif kernel in (SPLIT, SINGLE_PASS):
            built = build.split(shape, config, kernel == SPLIT, profile, target)
        elif kernel == "combine":
            built = build.combine(shape, config.combine, config.block_n, target)
        else:
            raise ValueError(f"kernel must be one of {(SHORT_CACHE, SINGLE_PASS, SPLIT, 'combine')}, got {kernel!r}")
        with self._lock:
            self._compiled[key] = built
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return built

    def _launchers(self, plan, problem, device):
        profile, target = hardware.profile_for(device), self._target(device)
        first = launcher(self.compiled(plan.kernel, problem, plan.config, profile, target))
        combine = (launcher(self.compiled("combine", problem, plan.config, profile, target))
                   if plan.needs_combine else None)
        return first, combine, KernelShape.of(problem).plain

    def _is_hopper(self, device) -> bool:
        import torch

        index = _index(device)
        if index not in self._hopper:
            self._hopper[index] = torch.cuda.get_device_capability(index)[0] == 9
        return self._hopper[index]

    def _target(self, device) -> dict:
        from . import build

        index = _index(device)
        if index not in self._targets:
            self._targets[index] = build.device_target(index)
        return self._targets[index]


def _feature_arguments(problem, args) -> list:
    """The attention kernels' arguments after the plain ones: block_table, k and v, softcap, window
    sizes, the fp8 descales (``flat_descale``: k's and v's views, then their strides), sinks,
    cache_leftpad, each where the problem uses it."""
    extra = []
    if problem.paged:
        extra.append(args.block_table)
    if problem.seqlen_new:
        extra += [args.k_new, args.v_new]
    if problem.softcap:
        extra.append(args.softcap)
    if problem.window_left >= 0:
        extra.append(problem.window_left)
    if problem.window_right >= 0:
        extra.append(problem.window_right)
    if problem.cache_dtype is not None:
        (k_view, *k_strides), (v_view, *v_strides) = flat_descale(args.k_descale), flat_descale(args.v_descale)
        extra += [k_view, v_view, *k_strides, *v_strides]
    if problem.sinks:
        extra.append(args.sinks)
    if problem.leftpad:
        extra.append(args.cache_leftpad)
    return extra


def flat_descale(descale) -> tuple:
    """An fp8 cache's descale, a float32 (batch, nheads_k) view (often expanded: strides of 0), as
    (the elements it spans as one contiguous view, its batch stride, its head stride): the kernels
    read sequence b's and KV head h's at b * stride_b + h * stride_h. ValueError without one."""
    if descale is None:
        raise ValueError("k_descale, v_descale: an fp8 cache needs both as float32 (batch, nheads_k) views")
    stride_b, stride_h = descale.stride()
    span = (descale.shape[0] - 1) * stride_b + (descale.shape[1] - 1) * stride_h + 1
    return descale.as_strided((span,), (1,)), stride_b, stride_h


def _combine_feature_arguments(problem, args) -> list:
    """The combine kernel's arguments after the plain ones: what its key-range rule reads (and the
    left pads, after the sinks its merge starts from)."""
    extra = [problem.seqlen_new] if problem.seqlen_new else []
    extra += [problem.window_left] if problem.window_left >= 0 else []
    return extra + ([args.sinks] if problem.sinks else []) + ([args.cache_leftpad] if problem.leftpad else [])


def _index(device) -> int:
    """The index of a CUDA device (its current device when the index is not given)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def _why_unavailable() -> str | None:
    """Why TileLang kernels cannot be built in this process: TileLang missing, no nvcc under its
    CUDA_HOME (it compiles each specialisation on first use), or a TileLang release the split
    kernel's CUDA rewrite was not written for."""
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang installed (pip install 'flashdecode[tilelang]')"
    try:
        from tilelang.env import CUDA_HOME

        from . import patches
    except ImportError as error:
        return f"TileLang to import ({error})"
    if not CUDA_HOME or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return f"nvcc under TileLang's CUDA_HOME ({CUDA_HOME or 'not set'}) to compile its kernels"
    return patches.unsupported_version()
