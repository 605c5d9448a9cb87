"""Compile a benchmark run's kernels before it times anything, in parallel processes.

Triton compiles a kernel specialisation on its first launch and keeps it in its disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``); the host path's extension is built once per
machine. The benchmark's own process pays both on a newly started machine, one kernel at a time (the
serving variants' device calls took 390 s for cases 1-7 on a newly started H100 and 148 s for cases
8-14 on the same machine afterwards, FlashInfer's builds included: 2026-12-07, docs/iterations.md
entry 65; the share of compiling was not measured). This tool builds the extension once, then makes
the benchmark's calls of each (case, variant) once per backend, in ``--jobs`` processes sharing the
cache, over every seed whose shapes the benchmark draws (a ragged variant's drafts change with the
seed), so the timed run finds its kernels on disk. Nothing is timed; outputs are not checked.

Usage: python tools/prewarm.py --cases 1-14 --variant plain,fp8,sinks,ragged --backends triton [--jobs 8]
"""
import argparse
import concurrent.futures
import multiprocessing
import sys
import time

import torch

import flashdecode
from flashdecode import cases, cli
from flashdecode.argtypes import positive_int
from flashdecode.bench import runner
from flashdecode.kernels.base import BackendError


def seeds(case: cases.Case, variant: cases.Variant) -> list[int]:
    """The seeds of the benchmark's inputs for ``case`` (timed, fresh, then the eager loop's
    layers) whose calls differ in shape: the first only, unless the variant's drafts are random."""
    drawn = [runner.TIMED_SEED, runner.FRESH_SEED, *runner.layer_seeds(runner.EAGER_LAYERS)]
    if not variant.max_draft:
        return drawn[:1]
    kept, seen = [], set()
    for seed in drawn:
        drafts = tuple(cases.draft_lengths(case, variant, seed))
        if drafts not in seen:
            seen.add(drafts)
            kept.append(seed)
    return kept


def warm(work: tuple) -> tuple[int, list[str], list[str]]:
    """Make one (case, variant)'s calls over its seeds on each backend, as the benchmark makes them
    (a call with and without lse; a call of parts, each part without): (calls made, the backends
    that refused it, with why; the calls that failed, with the error)."""
    case, variant_name, backends = work
    variant = cases.VARIANTS[variant_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, dtype = runner.as_run(case, device == "cuda")
    made, refused, failed = 0, set(), set()
    for seed in seeds(shape, variant):
        call = cases.make_call(shape, variant, device, dtype, seed=seed)
        runs = [(part, False) for part in call.parts or ()] or [(call, False), (call, True)]
        for backend in backends:
            try:
                for part, lse in runs:
                    flashdecode.flash_attn_with_kvcache(part.q, part.k_cache, part.v_cache, **part.kwargs(),
                                                        backend=backend, return_softmax_lse=lse)
                    made += 1
            except BackendError as error:
                refused.add(f"case {case.label} {variant_name} {backend}: {error}")
            except Exception as error:  # noqa: BLE001 - reported; the benchmark records it again when it runs
                failed.add(f"case {case.label} {variant_name} {backend}: {type(error).__name__}: {error}")
    if device == "cuda":
        torch.cuda.synchronize()
    return made, sorted(refused), sorted(failed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_case_selection(parser, default_variants=("plain",))  # as flashdecode bench takes them
    parser.add_argument("--backends", type=cli.names, default=("triton",), help="our backends (default: triton)")
    parser.add_argument("--jobs", type=positive_int, default=8, help="processes (default 8; device.sh: PREWARM_JOBS, 12)")
    parser.set_defaults(command_parser=parser)
    args = parser.parse_args(argv)
    selected = cli.selected_cases(args)
    backends = args.backends
    if not backends or not set(backends) <= set(runner.OUR_BACKENDS):
        parser.error(f"--backends: must be among {', '.join(runner.OUR_BACKENDS)}, got {','.join(backends)!r}")
    start = time.perf_counter()
    if torch.cuda.is_available():  # the extension once, here, before the workers would each build it
        from flashdecode import host_path

        print(f"host path: {host_path.unavailable() or 'built'}")
    work = [(case, name, backends) for case in selected for name in args.variant]
    made, refused, failed = 0, [], []
    context = multiprocessing.get_context("spawn")  # CUDA in the workers: no fork
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        for calls, why, errors in pool.map(warm, work):
            made, refused, failed = made + calls, refused + why, failed + errors
    for line in refused:
        print(f"skipped: {line}", file=sys.stderr)
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    print(f"prewarm: {made} calls over {len(work)} (case, variant) in {time.perf_counter() - start:.0f} s, "
          f"{args.jobs} processes, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
