"""Compile a benchmark run's kernels before it times anything, in parallel processes.

Triton compiles a kernel specialisation on its first launch and keeps it in its disk cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``); the host path's extension is built once per
machine. On a fresh machine the benchmark's own process pays both, one kernel at a time: the serving
variants over cases 1-7 took 390 s on a fresh H100, and cases 8-14 then 148 s on the same machine
(2026-12-07, docs/iterations.md entry 65). This tool builds the extension once, then calls each
(case, variant) of a selection once per backend, with and without lse, in ``--jobs`` processes
sharing the cache, over every seed whose shapes the benchmark draws (a ragged variant's drafts
change with the seed), so the timed run loads each kernel instead of compiling it. Nothing is
timed; outputs are not checked (the benchmark checks its own).

Usage: python tools/prewarm.py --cases 1-14 --variant plain,fp8,sinks,ragged --backends triton [--jobs 12]
"""
import argparse
import concurrent.futures
import multiprocessing
import sys
import time

import torch

import flashdecode
from flashdecode import cases
from flashdecode.bench import runner
from flashdecode.kernels.base import BackendError


def seeds(case: cases.Case, variant: cases.Variant) -> list[int]:
    """The seeds of the benchmark's inputs for ``case`` (timed, fresh, then the eager loop's
    layers) whose calls differ in shape: the first only, unless the variant's drafts are random."""
    drawn = [1, runner.FRESH_SEED] + [runner.LAYER_SEED + index for index in range(1, runner.EAGER_LAYERS)]
    if not variant.max_draft:
        return drawn[:1]
    kept, seen = [], set()
    for seed in drawn:
        drafts = tuple(cases.draft_lengths(case, variant, seed))
        if drafts not in seen:
            seen.add(drafts)
            kept.append(seed)
    return kept


def warm(work: tuple) -> tuple[int, list[str]]:
    """Call one (case, variant) over its seeds on each backend that takes it: (calls made, the
    backends that refused it, with why)."""
    case, variant_name, backends = work
    variant = cases.VARIANTS[variant_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, dtype = runner.as_run(case, device == "cuda")
    made, refused = 0, []
    for seed in seeds(shape, variant):
        call = cases.make_call(shape, variant, device, dtype, seed=seed)
        for backend in backends:
            for part in call.parts or [call]:
                try:
                    for lse in (False, True):
                        flashdecode.flash_attn_with_kvcache(part.q, part.k_cache, part.v_cache, **part.kwargs(),
                                                            backend=backend, return_softmax_lse=lse)
                        made += 1
                except BackendError as error:
                    refused.append(f"case {case.label} {variant_name} {backend}: {error}")
                    break
    if device == "cuda":
        torch.cuda.synchronize()
    return made, sorted(set(refused))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", choices=tuple(cases.MATRICES), default="cases")
    parser.add_argument("--cases", default="all", help="as flashdecode bench takes them")
    parser.add_argument("--variant", default="plain", help="comma list of flashdecode bench's variants")
    parser.add_argument("--backends", default="triton", help="our backends to call (default: triton)")
    parser.add_argument("--jobs", type=int, default=8, help="processes (default 8)")
    args = parser.parse_args(argv)
    try:
        selected = cases.select(args.matrix, args.cases)
    except ValueError as error:
        parser.error(f"--cases: {error}")
    variants = [name.strip() for name in args.variant.split(",") if name.strip()]
    unknown = [name for name in variants if name not in cases.VARIANTS]
    if unknown:
        parser.error(f"--variant: unknown variants {unknown}; variants are {', '.join(cases.VARIANTS)}")
    backends = tuple(name.strip() for name in args.backends.split(",") if name.strip())
    bad = [name for name in backends if name not in runner.OUR_BACKENDS]
    if bad or not backends:
        parser.error(f"--backends: must be among {', '.join(runner.OUR_BACKENDS)}, got {args.backends!r}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    start = time.perf_counter()
    if torch.cuda.is_available():  # the extension once, here, before the workers would each build it
        from flashdecode import host_path

        print(f"host path: {host_path.unavailable() or 'built'}")
    work = [(case, name, backends) for case in selected for name in variants]
    made, refused = 0, []
    context = multiprocessing.get_context("spawn")  # CUDA in the workers: no fork
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        for calls, why in pool.map(warm, work):
            made += calls
            refused += why
    for line in refused:
        print(f"skipped: {line}", file=sys.stderr)
    print(f"prewarm: {made} calls over {len(work)} (case, variant) in {time.perf_counter() - start:.0f} s, "
          f"{args.jobs} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
