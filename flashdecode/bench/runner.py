"""One benchmark run: every selected case under every selected variant through every selected system,
timed and checked.

A *system* is one of our backends (the public call ``flash_attn_with_kvcache(..., backend=NAME)``),
a peer (``peers.py``) or, on CPU only, the torch reference through the same call. Each is asked
whether it takes the call (ours: ``flashdecode.plan_for``, whose Plan is recorded), set up on the
case's inputs and on those of the other layers of the eager loop, called once (compilation, first
check against ``flashdecode.reference.reference_attention``, row by row: ``correctness``), timed
four ways (cold-L2 median; CUDA-graph replay, i.e. GPU time; host time per call; per call of an
eager loop over layers), checked again on the graph's output and on fresh inputs, and given
bandwidth, fraction of the in-run ceiling and speedup over the baseline.

Without CUDA the run is a smoke test: Triton's interpreter on scaled-down float16 cases, timed on
the CPU. Set ``TRITON_INTERPRET=1`` before importing this module there (it imports Triton).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable

import torch
import triton

import flashdecode
from flashdecode import cases
from flashdecode.context import default_context

from . import BenchError, Unsupported, correctness, report
from .ceiling import measure_ceiling
from .peers import select_peers
from .provenance import environment, version
from .results import BenchRun, CaseRun, Result, System
from .timing import INTERLEAVE_ROUNDS, CallFailed, Timer, summarize

OUR_BACKENDS = ("tilelang", "triton")
#: Seeds of the timed inputs (make_inputs' default) and of the second correctness check.
TIMED_SEED, FRESH_SEED = 1, 2
#: Layer i >= 1 of the eager loop draws its inputs with seed LAYER_SEED + i (layer 0: the timed inputs).
LAYER_SEED = 100
CUDA_ITERS, CUDA_MIN_ITERS, CUDA_WARMUP = 100, 50, 10
#: Without CUDA: tiny cases (a single KV block, so no split: the interpreter runs the split grid
#: at several seconds per call), few runs, float16 because the interpreter computes bf16 wrongly.
CPU_ITERS, CPU_WARMUP, CPU_MAX_BATCH, CPU_MAX_SEQLEN, CPU_DTYPE = 3, 0, 2, 64, torch.float16
HOST_OVERHEAD_CALLS, CPU_HOST_CALLS = 200, 2
#: Loops of host_calls calls whose median is the host time per call (one on the CPU: the interpreter is slow).
HOST_OVERHEAD_LOOPS, CPU_HOST_LOOPS = 5, 1
#: The eager loop: one call per layer of a 32-layer model, each layer on its own inputs while their
#: memory stays under EAGER_MEMORY_SHARE of what is free (fewer layers beyond), EAGER_REPEATS loops.
EAGER_LAYERS, EAGER_REPEATS, EAGER_MEMORY_SHARE = 32, 20, 0.5
CPU_EAGER_LAYERS, CPU_EAGER_REPEATS = 2, 1
ANCHOR_PATH = pathlib.Path(flashdecode.__file__).parent / "data" / "h200-peers.json"
#: The GPU the anchor was measured on, as torch.cuda.get_device_name() names it.
ANCHOR_DEVICE = "NVIDIA H200"


@dataclasses.dataclass(frozen=True)
class Options:
    cases: tuple[cases.Case, ...]
    variants: tuple[str, ...] = ("plain",)
    backends: tuple[str, ...] | None = None  # None: every backend that can run here
    peers: tuple[str, ...] | None = None  # None: every peer that imports
    iters: int | None = None  # None: CUDA_ITERS, or CPU_ITERS without CUDA
    cold_l2: bool = True


@dataclasses.dataclass
class Selection:
    """What a run will do, resolved (and checked) before anything is timed."""

    cuda: bool
    cases: list[cases.Case]
    variants: list[cases.Variant]
    systems: list[System]
    skipped: list[str]  # default peers/backends left out, with the reason
    iters: int
    warmup: int
    cold_l2: bool

    @property
    def steps(self) -> int:
        return 1 + len(self.cases) * len(self.variants) * len(self.systems)

    @property
    def host_calls(self) -> int:
        return HOST_OVERHEAD_CALLS if self.cuda else CPU_HOST_CALLS

    @property
    def host_loops(self) -> int:
        return HOST_OVERHEAD_LOOPS if self.cuda else CPU_HOST_LOOPS

    @property
    def eager_layers(self) -> int:
        return EAGER_LAYERS if self.cuda else CPU_EAGER_LAYERS

    @property
    def eager_repeats(self) -> int:
        return EAGER_REPEATS if self.cuda else CPU_EAGER_REPEATS


_OURS_CALL = "flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=, block_table=, causal=, backend={!r})"


def call_ours(backend: str):
    """System.check, System.setup, System.launch_path and System.setup_with_lse of the public call
    with ``backend``: the timed calls return out, the checked ones (out, lse). A call of ``parts``
    runs each part into its rows of the call's ``out`` (no lse); the plan recorded is the first part's."""
    def check(call):
        first = call.parts[0] if call.parts else call
        try:
            route = flashdecode.plan_for(first.q, first.k_cache, first.v_cache, **first.kwargs(), backend=backend)
        except flashdecode.BackendError as error:
            raise Unsupported(str(error)) from error
        return dataclasses.asdict(route.plan)

    def bind(call, lse: bool):
        q, k_cache, v_cache, kwargs, out = call.q, call.k_cache, call.v_cache, call.kwargs(), call.out
        return lambda: flashdecode.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, backend=backend, out=out,
                                                           return_softmax_lse=lse)

    def setup(calls):
        return [bind_parts(call) if call.parts else bind(call, False) for call in calls]

    def setup_with_lse(calls):
        return [bind_parts(call) if call.parts else bind(call, True) for call in calls]

    def bind_parts(call):
        parts = [bind(part, False) for part in call.parts]

        def run():
            for part in parts:
                part()
            return call.out
        return run

    def launch_path(call):
        context = default_context(call.q)
        host = context.host_path
        return (0 if host is None else host.hits), context.host_path_off_because

    return check, setup, launch_path, setup_with_lse


def _our_backend(name: str, cuda: bool) -> System:
    """Our backend ``name`` as a system; BenchError when it cannot take even a small plain call here."""
    device = torch.device("cuda" if cuda else "cpu")
    probe = cases.make_call(cases.Case(0, 1, 64, 1, 4), cases.VARIANTS["plain"], device,
                            cases.DTYPE if cuda else CPU_DTYPE)
    check, setup, launch_path, setup_with_lse = call_ours(name)
    try:
        check(probe)
    except Unsupported as error:
        raise BenchError(str(error)) from error
    mode = "" if cuda or name != "triton" else " (interpreter)"
    package = triton.__version__ if name == "triton" else version(name)
    return System(name, "ours", f"flashdecode {flashdecode.__version__}, {name} {package}{mode}",
                  _OURS_CALL.format(name), check, setup, launch_path if cuda else None, setup_with_lse)


def _peer_check(limitation):
    def check(call):
        if call.sinks is not None or call.cu_seqlens_q is not None:
            raise Unsupported("sinks and ragged queries are flashdecode's own arguments (no peer takes them)")
        reason = limitation(call)
        if reason is not None:
            raise Unsupported(reason)
    return check


def select(options: Options) -> Selection:
    """Resolve cases, variants, backends and peers for this machine; BenchError for anything asked
    that cannot run."""
    cuda = torch.cuda.is_available()
    if not options.cases:
        raise BenchError("need at least one case")
    bad = [name for name in options.variants if name not in cases.VARIANTS]
    if bad or not options.variants:
        raise BenchError(f"unknown variants {bad}; variants are {', '.join(cases.VARIANTS)}")
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
        check, setup, _, setup_with_lse = call_ours("reference")
        systems.append(System("reference", "reference", f"torch {torch.__version__}",
                              _OURS_CALL.format("reference") + ": the float32 torch reference", check, setup,
                              setup_with_lse=setup_with_lse))
    peers, skipped_peers = select_peers(None if options.peers is None else list(options.peers), cuda)
    systems += [System(peer.name, "peer", peer_version, peer.description, _peer_check(peer.limitation), peer.setup)
                for peer, peer_version in peers]
    iters = options.iters if options.iters is not None else (CUDA_ITERS if cuda else CPU_ITERS)
    if cuda and iters < CUDA_MIN_ITERS:
        raise BenchError(f"--iters must be at least {CUDA_MIN_ITERS} on CUDA (medians of fewer runs are noise), "
                         f"got {iters}")
    return Selection(cuda, list(options.cases), [cases.VARIANTS[name] for name in options.variants], systems,
                     skipped + skipped_peers, iters, CUDA_WARMUP if cuda else CPU_WARMUP, options.cold_l2)


def run(selection: Selection, advance: Callable[[str], None] = lambda label: None,
        so_far: Callable[[BenchRun], None] | None = None) -> BenchRun:
    """Measure the ceiling and a plain torch launch, then every case and variant with every system;
    ``advance`` is called after each step, ``so_far`` after each case and variant with the run up to
    there (a note says it is partial), so a run cut by a time limit keeps what it measured."""
    device = torch.device("cuda" if selection.cuda else "cpu")
    timer = Timer(device, selection.iters, selection.warmup, cold_l2=selection.cold_l2)
    ceiling = measure_ceiling(timer)
    launch_us = torch_launch_us(timer, selection.host_calls, selection.host_loops)
    launch_gpu_us = torch_launch_gpu_us(timer)
    advance("ceiling")
    peer_versions = {s.name: s.version for s in selection.systems if s.kind == "peer"}
    machine = environment(selection.cuda, peer_versions)
    anchor = anchor_for(machine["device"])
    settings, notes = _settings(selection, timer, launch_us, launch_gpu_us), _notes(selection, anchor)

    def bench_run(case_runs: list[CaseRun], run_notes: list[str]) -> BenchRun:
        return BenchRun(machine, settings, ceiling, selection.systems, selection.skipped, run_notes, case_runs)

    total = len(selection.cases) * len(selection.variants)
    case_runs = []
    for case in selection.cases:
        for variant in selection.variants:
            case_runs.append(_run_case(case, variant, selection, timer, ceiling, anchor, advance))
            if so_far is not None and len(case_runs) < total:
                partial = f"{report.PARTIAL_NOTE}{len(case_runs)} of {total} case runs"
                so_far(bench_run(list(case_runs), [*notes, partial]))
    return bench_run(case_runs, notes)


def plain_launch(device) -> Callable[[], object]:
    """One plain torch kernel launch, ``q.add_(0)`` on a q-sized tensor (warmed up): the floor under
    every host time per call."""
    q = torch.randn(1, 1, cases.NHEADS, cases.HEADDIM, device=device)
    for _ in range(CUDA_WARMUP):
        q.add_(0)
    return lambda: q.add_(0)


def torch_launch_us(timer: Timer, calls: int, loops: int) -> float:
    """Host time of ``plain_launch`` back to back, once for the run (each result also has its own,
    ``Result.host_launch_us``)."""
    return timer.host_overhead_us(plain_launch(timer.device), calls, loops)


def torch_launch_gpu_us(timer: Timer) -> float | None:
    """GPU time of the same launch (16 KB read and written) replayed from a CUDA graph after the
    cold-L2 flush, as every graph figure is timed: about what any one-kernel call that reads its
    input from memory takes at least (None without CUDA)."""
    q = torch.randn(1, 1, cases.NHEADS, cases.HEADDIM, device=timer.device)
    graph = timer.time_graph(lambda: q.add_(0))
    return None if graph is None else graph[0].median_us


def as_run(case: cases.Case, cuda: bool) -> tuple[cases.Case, torch.dtype]:
    """The case's shape and dtype as this machine runs it (scaled down and float16 without CUDA)."""
    if cuda:
        return case, cases.DTYPE
    return dataclasses.replace(case, batch=min(case.batch, CPU_MAX_BATCH),
                               seqlen_cache=min(case.seqlen_cache, CPU_MAX_SEQLEN)), CPU_DTYPE


def layer_count(call: cases.Call, selection: Selection) -> int:
    """Layers of the eager loop: ``selection.eager_layers``, fewer where their inputs would take more
    than EAGER_MEMORY_SHARE of the free device memory, counting what torch's allocator holds unused
    (at least 1: the timed inputs)."""
    if not selection.cuda:
        return selection.eager_layers
    device = call.q.device
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, min(selection.eager_layers, 1 + int(free * EAGER_MEMORY_SHARE) // call.storage_bytes()))


def case_inputs(case: cases.Case, variant: cases.Variant, selection: Selection, device) -> tuple:
    """(shape run, the eager loop's layers with the timed inputs first, fresh inputs, what the timed
    and the fresh inputs' outputs are judged against: ``correctness.Expected``) of one case and
    variant, as every system of the run gets them."""
    shape, dtype = as_run(case, selection.cuda)
    call = cases.make_call(shape, variant, device, dtype, seed=TIMED_SEED)
    fresh = cases.make_call(shape, variant, device, dtype, seed=FRESH_SEED)
    references = correctness.expected(call), correctness.expected(fresh)
    layers = [call] + [cases.make_call(shape, variant, device, dtype, seed=seed)
                       for seed in layer_seeds(layer_count(call, selection))]
    return shape, layers, fresh, references


def layer_seeds(layers: int) -> list[int]:
    """The seeds of an eager loop's inputs past the timed ones (layer 0), for ``layers`` layers."""
    return [LAYER_SEED + index for index in range(1, layers)]


def _run_case(case, variant, selection, timer, ceiling, anchor, advance) -> CaseRun:
    shape, layers, fresh, references = case_inputs(case, variant, selection, timer.device)
    nbytes = layers[0].bytes_moved()
    results = measure(selection.systems, layers, fresh, references, timer, selection,
                      lambda system: advance(f"case {case.label} {variant.name} {system}"))
    del layers
    for result in results:
        if result.timing is not None:
            result.bandwidth_gbps = nbytes / result.timing.median_us / 1e3
            result.fraction = result.bandwidth_gbps / ceiling.gbps
    reference = baseline(case, variant, results, selection.cuda, anchor)
    for result in results:
        if result.correct and reference[0] is not None:
            result.speedup = reference[0] / result.timing.median_us
    return CaseRun(case, shape, variant, nbytes, *reference, results)


def measure(systems: list[System], layers: list[cases.Call], fresh: cases.Call, references, timer: Timer,
            selection: Selection, advance: Callable[[str], None] = lambda system: None) -> list[Result]:
    """Check, set up, time and re-check each system on one case and variant (``layers[0]``: the
    timed inputs; ``references``: the timed and the fresh inputs' ``correctness.Expected``); a call
    a system cannot take ends up in its ``skipped``, a failure in ``error``. Outputs are judged on
    the first call, the graph replay (of the call returning lse where the system has one: the same
    kernels) and fresh inputs.
    The cold-L2 runs of all systems are timed in rounds, then their graph replays
    (``Timer.interleaved``: blocks of consecutive runs, each system in turn): on the H200 the first
    graph timed on a case's inputs read up to 10% high when the systems were timed one after
    another (``docs/design.md``, "The benchmark").
    ``advance(name)`` is called as each system is done."""
    results = [Result(system.name, system.kind) for system in systems]
    calls: list = [None] * len(systems)
    checked: list = [None] * len(systems)  # the call on the timed inputs whose output is judged
    verdicts: list[list[correctness.Verdict]] = [[] for _ in systems]

    def failed(index: int, error: Exception) -> None:
        calls[index] = None
        if isinstance(error, Unsupported):
            results[index].skipped = str(error)
        else:
            results[index].error = f"{type(error).__name__}: {error}"

    for index, system in enumerate(systems):
        try:
            results[index].plan = system.check(layers[0])
            calls[index] = system.setup(layers)
            checked[index] = system.setup_with_lse([layers[0]])[0] if system.setup_with_lse else calls[index][0]
            result = checked[index]()
            timer.synchronize()
            results[index].compiled = True
            verdicts[index].append(correctness.judge(result, references[0]))
        except Exception as error:  # noqa: BLE001 - a failing system is reported, the run goes on
            failed(index, error)
    while True:
        live = [index for index, found in enumerate(calls) if found is not None]
        try:
            timings = timer.interleaved([calls[index][0] for index in live])
            graphs = timer.time_graphs([checked[index] for index in live])
            break
        except CallFailed as failure:  # time the others again without it
            failed(live[failure.index], failure.error)
    for index, samples, graph in zip(live, timings, graphs):
        results[index].timing = summarize(samples)
        if graph is not None:
            results[index].graph, graph_out = graph
            verdicts[index].append(correctness.judge(graph_out, references[0]))
    launch = plain_launch(timer.device)
    for index, system in enumerate(systems):
        if calls[index] is not None:
            try:
                _finish(results[index], system, calls[index], layers, fresh, references[1], verdicts[index], launch,
                        timer, selection)
            except Exception as error:  # noqa: BLE001
                failed(index, error)
        advance(system.name)
    return results


def _finish(result: Result, system: System, calls: list, layers, fresh, fresh_reference: correctness.Expected,
            verdicts: list[correctness.Verdict], launch: Callable[[], object], timer: Timer,
            selection: Selection) -> None:
    """Host time (its loops alternating with a plain torch launch's), the eager loop and the check
    on fresh inputs of one system that was timed."""
    before = system.launch_path(layers[0]) if system.launch_path else None
    result.host_overhead_us, result.host_launch_us = timer.host_times([calls[0], launch], selection.host_calls,
                                                                      selection.host_loops)
    if before is not None:
        result.host_path = host_path_of(before, system.launch_path(layers[0]),
                                        selection.host_calls * selection.host_loops)
    result.eager, result.eager_layers = timer.eager_loop(calls, selection.eager_repeats), len(calls)
    fresh_verdict = correctness.judge((system.setup_with_lse or system.setup)([fresh])[0](), fresh_reference)
    verdicts = [*verdicts, fresh_verdict]
    result.rel_err = max(verdict.rel_err for verdict in verdicts[:-1])
    result.fresh_rel_err = fresh_verdict.rel_err
    result.row_ratio = max(verdict.row_ratio for verdict in verdicts)
    result.failed_rows = max(verdict.failed_rows for verdict in verdicts)
    lse_errors = [verdict.lse_error for verdict in verdicts if verdict.lse_error is not None]
    result.lse_error = max(lse_errors) if lse_errors else None
    result.correct = all(verdict.correct for verdict in verdicts)


def host_path_of(before: tuple, after: tuple, calls: int) -> str:
    """What the report says launched a host-time loop of ``calls`` calls, from ``launch_path``'s
    (hits, why off) before and after it: "compiled" when each call was a hit of the compiled host
    path's records, else "python: " and why."""
    hits, off_because = after[0] - before[0], after[1]
    if hits >= calls:
        return "compiled"
    if off_because is not None:
        return f"python: {off_because}"
    return f"python: {calls - hits} of {calls} calls found no record"


def anchor_for(device: str) -> dict | None:
    """The anchor file where ``device`` is the GPU it was measured on, else None: its FA2 times are
    no baseline elsewhere (an H100's ratios against them were 0.85-1.63×: 2026-12-07)."""
    return json.loads(ANCHOR_PATH.read_text()) if device == ANCHOR_DEVICE else None


def baseline(case, variant, results, cuda, anchor) -> tuple[float | None, str, str | None]:
    """(µs, source, system): FlashAttention 2 from this run where it ran correctly; else its H200
    anchor timing (``anchor``: None off the H200; plain cases of the 14-case matrix only) or the torch
    reference (CPU, where the anchor's shapes are not what ran); else none."""
    fa2 = next((r for r in results if r.system == "fa2" and r.correct), None)
    if fa2 is not None:
        return fa2.timing.median_us, "fa2 timed in this run", "fa2"
    if not cuda:
        ref = next((r for r in results if r.kind == "reference" and r.timing is not None), None)
        return (ref.timing.median_us if ref else None), "torch reference timed in this run (CPU)", "reference"
    if anchor is None:
        return None, f"none: no correct fa2 in this run, and the anchor file is an {ANCHOR_DEVICE}'s", None
    if case.matrix == "cases" and variant.name == "plain":
        row = next(row for row in anchor["cases"] if row["case"] == case.number)
        return row["fa2"]["median_us"], f"fa2 from flashdecode/data/{ANCHOR_PATH.name}, not this run", None
    return None, "none: fa2 did not run correctly here, and the anchor file holds the 14 plain cases only", None


def _settings(selection: Selection, timer: Timer, launch_us: float, launch_gpu_us: float | None) -> dict:
    return {"iters": selection.iters, "warmup": selection.warmup,
            "cold_l2": timer.flush_bytes > 0, "flush_bytes": timer.flush_bytes,
            "host_overhead_calls": selection.host_calls, "host_overhead_loops": selection.host_loops,
            "torch_launch_us": launch_us,
            "torch_launch_gpu_us": launch_gpu_us,
            "eager_layers": selection.eager_layers, "eager_repeats": selection.eager_repeats,
            "eager_memory_share": EAGER_MEMORY_SHARE if selection.cuda else None,
            "variants": [variant.name for variant in selection.variants],
            "out_error_factor": correctness.OUT_ERROR_FACTOR, "out_atol": correctness.OUT_ATOL,
            "lse_atol": correctness.LSE_ATOL, "fresh_seed": FRESH_SEED,
            "dtype": str(cases.DTYPE if selection.cuda else CPU_DTYPE).removeprefix("torch.")}


def _notes(selection: Selection, anchor: dict | None) -> list[str]:
    """What a reader must know to interpret the numbers; the same for every process with the same
    settings (what a process measures for itself is in the settings), so merged runs share them."""
    notes = [f"correct: on every (sequence, query, head) row, max |out-ref| <= {correctness.OUT_ERROR_FACTOR:g} x a "
             f"same-dtype torch run's + eps(dtype) x the row's max |ref| + {correctness.OUT_ATOL:g}, and "
             f"|lse-ref| <= {correctness.LSE_ATOL:g} where the system returns lse (ours), against the float32 "
             f"flashdecode.reference, on the timed inputs, the graph replay and fresh inputs (seed {FRESH_SEED}); "
             f"err: ||out-ref||/||ref|| (timed / fresh), shown only",
             f"host us: host time per call, median of {selection.host_loops} loops of {selection.host_calls} calls "
             f"back to back, GPU work not waited for inside a loop; launch us: a plain torch launch's "
             f"(q.add_(0)) host time in loops alternating with the call's",
             f"the systems of a case are timed in {INTERLEAVE_ROUNDS} rounds, each system a block of consecutive "
             f"runs per round, the cold runs first, then the graph replays",
             f"eager us: per call of a loop over up to {selection.eager_layers} layers (x N: the layers that fit "
             f"in {EAGER_MEMORY_SHARE:.0%} of free memory), each on its own inputs, same lengths; L2 flushed "
             f"before each loop, one event pair around it, no sync inside; median of {selection.eager_repeats}"]
    for variant in selection.variants:
        notes.append(f"variant {variant.name}: {variant.description}")
    if not selection.cuda:
        notes.insert(0, f"CPU TIMINGS (Triton interpreter, torch on CPU): not comparable with anything. Cases "
                        f"scaled down to batch <= {CPU_MAX_BATCH}, seqlen_cache <= {CPU_MAX_SEQLEN}, float16; "
                        f"baseline: the torch reference on the same inputs; no CUDA graph.")
    elif anchor is not None and not any(system.name == "fa2" for system in selection.systems):
        notes.append(f"baseline (REF_RUNTIME, speedup): the fa2 column of flashdecode/data/{ANCHOR_PATH.name} for "
                     f"the 14 plain cases, NOT this run ({anchor['what']}); none for other cases and variants")
    return notes
