"""One benchmark run: every selected case through every selected system, timed and checked.

A *system* is one of our backends (the public call ``flash_decode_with_kvcache(..., backend=NAME)``),
a peer (``peers.py``) or, on CPU only, the torch reference. Each is set up on the case's inputs,
called once (compilation, first correctness check), timed (cold L2, then replayed from a CUDA
graph), checked again on fresh inputs, and given bandwidth, fraction of the in-run ceiling and
speedup over the baseline.

Without CUDA the run is a smoke test: Triton's interpreter on scaled-down float16 cases, timed on
the CPU. Set ``TRITON_INTERPRET=1`` before importing this module there (it imports Triton).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import pathlib
import platform
import subprocess
import sys
from typing import Callable

import torch
import triton

import flashdecode
from flashdecode import api, cases, hardware
from flashdecode.api import is_hopper
from flashdecode.reference import reference_decode, relative_error
from flashdecode.validate import validate

from . import BenchError
from .ceiling import measure_ceiling
from .peers import select_peers
from .results import BenchRun, CaseRun, Result, System
from .timing import Timer

OUR_BACKENDS = ("tilelang", "triton")
#: A result is correct when ||out - ref|| / ||ref|| (float32) is at most this, for bf16 and fp16.
REL_ERR_THRESHOLD = 2e-2
#: Seed of the second correctness check; the timed inputs use make_inputs' default seed.
FRESH_SEED = 2
CUDA_ITERS, CUDA_MIN_ITERS, CUDA_WARMUP = 100, 50, 10
#: Without CUDA: tiny cases (a single KV block, so no split: the interpreter runs the split grid
#: at several seconds per call), few runs, float16 because the interpreter computes bf16 wrongly.
CPU_ITERS, CPU_WARMUP, CPU_MAX_BATCH, CPU_MAX_SEQLEN, CPU_DTYPE = 3, 0, 2, 64, torch.float16
HOST_OVERHEAD_CALLS = 200
ANCHOR_PATH = pathlib.Path(flashdecode.__file__).parent / "data" / "h200-peers.json"


@dataclasses.dataclass(frozen=True)
class Options:
    cases: tuple[int, ...]
    backends: tuple[str, ...] | None = None  # None: every backend that can run here
    peers: tuple[str, ...] | None = None  # None: every peer that imports
    iters: int | None = None  # None: CUDA_ITERS, or CPU_ITERS without CUDA
    cold_l2: bool = True


@dataclasses.dataclass
class Selection:
    """What a run will do, resolved (and checked) before anything is timed."""

    cuda: bool
    cases: list[cases.Case]
    systems: list[System]
    skipped: list[str]  # default peers/backends left out, with the reason
    iters: int
    warmup: int
    cold_l2: bool

    @property
    def steps(self) -> int:
        return 1 + len(self.cases) * len(self.systems)


_OURS_CALL = "flash_decode_with_kvcache(q, k_cache, v_cache, cache_seqlens, backend={!r})"


def _our_backend(name: str, cuda: bool) -> System:
    """Our backend ``name`` as a system; BenchError when it cannot run here."""
    if name == "triton":
        mode = "" if cuda else " (interpreter)"
        return System(name, "ours", f"flashdecode {flashdecode.__version__}, triton {triton.__version__}{mode}",
                      _OURS_CALL.format(name), _setup_ours(name))
    if not cuda:
        raise BenchError(f"backend {name!r} needs a CUDA device")
    if not is_hopper(torch.cuda.current_device()):
        raise BenchError(f"backend {name!r} needs a Hopper GPU (compute capability 9.x), "
                         f"got {torch.cuda.get_device_name()}")
    try:
        from flashdecode.kernels import tilelang as module
    except Exception as error:  # noqa: BLE001 - any import failure means the backend cannot run
        raise BenchError(f"backend 'tilelang' cannot run here: flashdecode.kernels.tilelang "
                         f"does not import ({error})") from error
    if not hasattr(module, "run"):
        raise BenchError("backend 'tilelang' cannot run here: flashdecode.kernels.tilelang has no run()")
    return System(name, "ours", f"flashdecode {flashdecode.__version__}, tilelang {_version('tilelang')}",
                  _OURS_CALL.format(name), _setup_ours(name))


def _setup_ours(backend: str):
    def setup(q, k_cache, v_cache, seqlens):
        return lambda: flashdecode.flash_decode_with_kvcache(q, k_cache, v_cache, seqlens, backend=backend)
    return setup


def select(options: Options) -> Selection:
    """Resolve cases, backends and peers for this machine; BenchError for anything asked that cannot run."""
    cuda = torch.cuda.is_available()
    unknown = [number for number in options.cases if number not in cases.CASES_BY_NUMBER]
    if unknown or not options.cases:
        raise BenchError(f"need case numbers in 1-{len(cases.CASES)}, got {list(options.cases)}")
    skipped = []
    if options.backends is None:
        systems = []
        for name in OUR_BACKENDS:
            try:
                systems.append(_our_backend(name, cuda))
            except BenchError as error:
                skipped.append(str(error))
    else:
        bad = [name for name in options.backends if name not in OUR_BACKENDS]
        if bad:
            raise BenchError(f"unknown backends {bad}; backends are {', '.join(OUR_BACKENDS)}")
        systems = [_our_backend(name, cuda) for name in options.backends]
    if not cuda:
        systems.append(System("reference", "reference", f"torch {torch.__version__}",
                              _OURS_CALL.format("reference") + ": the float32 torch reference",
                              _setup_ours("reference")))
    peers, skipped_peers = select_peers(None if options.peers is None else list(options.peers), cuda)
    systems += [System(peer.name, "peer", version, peer.description, peer.setup) for peer, version in peers]
    iters = options.iters if options.iters is not None else (CUDA_ITERS if cuda else CPU_ITERS)
    if cuda and iters < CUDA_MIN_ITERS:
        raise BenchError(f"--iters must be at least {CUDA_MIN_ITERS} on CUDA (medians of fewer runs are noise), "
                         f"got {iters}")
    return Selection(cuda, [cases.CASES_BY_NUMBER[n] for n in options.cases], systems,
                     skipped + skipped_peers, iters, CUDA_WARMUP if cuda else CPU_WARMUP, options.cold_l2)


def run(selection: Selection, advance: Callable[[str], None] = lambda label: None) -> BenchRun:
    """Measure the ceiling, then every case with every system; ``advance`` is called after each step."""
    device = torch.device("cuda" if selection.cuda else "cpu")
    timer = Timer(device, selection.iters, selection.warmup, cold_l2=selection.cold_l2)
    ceiling = measure_ceiling(timer)
    advance("ceiling")
    anchor = json.loads(ANCHOR_PATH.read_text())
    case_runs = [_run_case(case, selection, timer, ceiling, anchor, advance) for case in selection.cases]
    return BenchRun(_environment(selection), _settings(selection, timer), ceiling, selection.systems,
                    selection.skipped, _notes(selection, anchor), case_runs)


def _run_case(case, selection, timer, ceiling, anchor, advance) -> CaseRun:
    shape, dtype = case, cases.DTYPE
    if not selection.cuda:
        shape = dataclasses.replace(case, batch=min(case.batch, CPU_MAX_BATCH),
                                    seqlen_cache=min(case.seqlen_cache, CPU_MAX_SEQLEN))
        dtype = CPU_DTYPE
    inputs = cases.make_inputs(shape, timer.device, dtype=dtype)
    fresh = cases.make_inputs(shape, timer.device, dtype=dtype, seed=FRESH_SEED)
    references = reference_decode(*inputs)[0], reference_decode(*fresh)[0]
    nbytes = cases.bytes_read(inputs[3].tolist(), shape.nheads_k, shape.nheads)
    results = []
    for system in selection.systems:
        result = _measure(system, inputs, fresh, references, timer)
        if result.timing is not None:
            result.bandwidth_gbps = nbytes / result.timing.median_us / 1e3
            result.fraction = result.bandwidth_gbps / ceiling.gbps
        results.append(result)
        advance(f"case {case.number} {system.name}")
    baseline = _baseline(case, results, selection.cuda, anchor)
    for result in results:
        if result.correct and baseline[0] is not None:
            result.speedup = baseline[0] / result.timing.median_us
    return CaseRun(case, shape, nbytes, *baseline, results)


def _measure(system: System, inputs, fresh, references, timer: Timer) -> Result:
    """Set up, check, time and re-check one system on one case; failures end up in ``error``."""
    result = Result(system.name, system.kind)
    try:
        if system.kind == "ours":
            problem, _ = validate(*inputs, None, 0, system.name, None)
            result.plan = dataclasses.asdict(api.plan_for(system.name, problem, hardware.profile_for(inputs[0].device)))
        call = system.setup(*inputs)
        out = call()
        timer.synchronize()
        result.compiled = True
        errors = [relative_error(out, references[0])]
        result.timing = timer.time(call)
        graph = timer.time_graph(call)
        if graph is not None:
            result.graph, graph_out = graph
            errors.append(relative_error(graph_out, references[0]))
        if system.kind == "ours" and timer.cuda:
            result.host_overhead_us = timer.host_overhead_us(call, HOST_OVERHEAD_CALLS)
        result.rel_err = max(errors)
        result.fresh_rel_err = relative_error(system.setup(*fresh)(), references[1])
        result.correct = all(error <= REL_ERR_THRESHOLD for error in (*errors, result.fresh_rel_err))
    except Exception as error:  # noqa: BLE001 - a failing system is reported, the run goes on
        result.error = f"{type(error).__name__}: {error}"
    return result


def _baseline(case, results, cuda, anchor) -> tuple[float | None, str, str | None]:
    """(µs, source, system): FlashAttention from this run; else its H200 anchor timing (CUDA) or
    the torch reference (CPU, where the anchor's shapes are not what ran)."""
    fa2 = next((r for r in results if r.system == "fa2" and r.timing is not None), None)
    if fa2 is not None:
        return fa2.timing.median_us, "fa2 timed in this run", "fa2"
    if not cuda:
        ref = next((r for r in results if r.kind == "reference" and r.timing is not None), None)
        return (ref.timing.median_us if ref else None), "torch reference timed in this run (CPU)", "reference"
    row = next(row for row in anchor["cases"] if row["case"] == case.number)
    return row["fa2"]["median_us"], f"fa2 from flashdecode/data/{ANCHOR_PATH.name}, not this run", None


def _version(distribution: str) -> str | None:
    """Installed version of a distribution, or of an imported module without metadata; else None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(distribution), "__version__", None)


def git_commit() -> str | None:
    """HEAD of the repository flashdecode is imported from, with "-dirty" appended when tracked files
    differ from it (the numbers then belong to uncommitted code); None when not a checkout or no git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=pathlib.Path(flashdecode.__file__).parent,
                              capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if changed.returncode != 0:
        return head.stdout.strip() + "-unknown-state"
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def source_digest() -> str:
    """sha256 (first 12 hex digits) of the package's Python sources, path by path: names the code that
    ran even where git's view of the checkout is stale (the GPU machine's copy of the working tree
    carried an old HEAD, so git_commit read "<old>-dirty"). The same digest of a commit's tree:
    ``git worktree``/``git archive`` it and call this on that copy."""
    root = pathlib.Path(flashdecode.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _environment(selection: Selection) -> dict:
    if selection.cuda:
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.machine()}, {platform.processor() or 'unknown'}), Triton interpreter"
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "tilelang": _version("tilelang"), "flashdecode": flashdecode.__version__}
    versions.update({s.name: s.version for s in selection.systems if s.kind == "peer"})
    return {"device": device, "cuda": selection.cuda, "versions": versions, "git_commit": git_commit(),
            "source_digest": source_digest(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _settings(selection: Selection, timer: Timer) -> dict:
    return {"iters": selection.iters, "warmup": selection.warmup,
            "cold_l2": timer.flush_bytes > 0, "flush_bytes": timer.flush_bytes,
            "host_overhead_calls": HOST_OVERHEAD_CALLS if selection.cuda else None,
            "rel_err_threshold": REL_ERR_THRESHOLD, "fresh_seed": FRESH_SEED,
            "dtype": str(cases.DTYPE if selection.cuda else CPU_DTYPE).removeprefix("torch.")}


def _notes(selection: Selection, anchor: dict) -> list[str]:
    """What a reader must know to interpret the numbers."""
    threshold = f"correct: ||out-ref||/||ref|| <= {REL_ERR_THRESHOLD:g} (float32, vs flashdecode.reference) " \
                f"on the timed inputs, the graph replay and fresh inputs (seed {FRESH_SEED})"
    if not selection.cuda:
        return [f"CPU TIMINGS (Triton interpreter, torch on CPU): not comparable with anything. Cases scaled down to "
                f"batch <= {CPU_MAX_BATCH}, seqlen_cache <= {CPU_MAX_SEQLEN}, float16; baseline: the torch reference "
                f"on the same inputs; no CUDA graph, no host-overhead figure.", threshold]
    notes = [threshold]
    if not any(system.name == "fa2" for system in selection.systems):
        notes.append(f"baseline (REF_RUNTIME, speedup): the fa2 column of flashdecode/data/{ANCHOR_PATH.name}, "
                     f"NOT this run: {anchor['what']}")
    return notes
