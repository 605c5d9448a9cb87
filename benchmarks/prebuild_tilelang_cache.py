"""Build, on a machine without the GPU, the TileLang kernels the H200 runs need, into .tl-cache/.

TileLang caches compiled kernels on disk, keyed by the kernel, the target and TileLang's version;
the kernels build for {"kind": "cuda", "arch": "sm_90a"} here and on the H200 alike, so carrying
this folder (packed: `tar -cJf .tl-cache.tar.xz .tl-cache`, then `carry: [".tl-cache.tar.xz"]`, see
benchmarks/device.sh) saves the ~15-20 s per kernel the
GPU machine would spend compiling, out of the session's device time. A cache entry that does not
load there is treated by TileLang as a miss and rebuilt.

Usage: python benchmarks/prebuild_tilelang_cache.py [--stages 2,3 --q-rows 64,16 --block-n 32]
(about 10 s per kernel on 2 cores; the default builds the shipped knobs, a list builds sweep variants)
"""
import argparse
import itertools
import os
import pathlib
import sys

os.environ.setdefault("TILELANG_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".tl-cache"))

from flashdecode import planner  # noqa: E402
from flashdecode.cases import CASES  # noqa: E402
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang import decode  # noqa: E402

H200_TARGET = decode._freeze({"kind": "cuda", "arch": "sm_90a"})


def specialisations(with_tests: bool):
    """(problem, plan) for every call the benchmark and the sanitizer make, forced splits too, and
    with ``with_tests`` the GPU tests' calls."""
    problems = [planner.Problem(c.batch, c.seqlen_cache, c.nheads, c.nheads_k, 128, "bfloat16") for c in CASES]
    problems.append(planner.Problem(3, 1, 8, 2, 128, "bfloat16"))  # empty-cache test's kernels (unsplit)
    if with_tests:  # the random-shape test's kernels (its KERNEL_SHAPES); needs pytest and hypothesis
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        import test_gpu

        for dtype, headdim, nheads_k, group in test_gpu.KERNEL_SHAPES:
            for batch, capacity in itertools.product((1, 40), test_gpu.RANDOM_CAPACITIES + [70000]):
                problems.append(planner.Problem(batch, capacity, nheads_k * group, nheads_k, headdim,
                                                str(dtype).removeprefix("torch.")))
    for problem in problems:
        for num_splits in (0, 3):
            yield problem, planner.plan(problem, PROFILES["h200"], num_splits)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default=str(decode.NUM_STAGES))
    parser.add_argument("--q-rows", default=str(decode.MIN_Q_ROWS), help="MIN_Q_ROWS values")
    parser.add_argument("--block-n", default="", help="force the planner's tile (sweep variants)")
    parser.add_argument("--with-tests", action="store_true",
                        help="also the GPU tests' kernels (always, when no knob is given)")
    args = parser.parse_args()
    if args.block_n:
        planner.BLOCK_N_CANDIDATES = (int(args.block_n),)
    variants = list(itertools.product(map(int, args.stages.split(",")),
                                      map(int, args.q_rows.split(","))))
    seen = set()
    shipped = variants == [(decode.NUM_STAGES, decode.MIN_Q_ROWS)] and not args.block_n
    calls = list(specialisations(with_tests=shipped or args.with_tests))
    for stages, q_rows in variants:
        decode.NUM_STAGES, decode.MIN_Q_ROWS = stages, q_rows  # launchers_for builds with the knobs
        for problem, plan in calls:
            shape = (problem.dtype, problem.headdim, problem.group, problem.nheads_k, plan.block_n)
            short = decode.takes_short_cache(problem, plan)  # its own q tile, no stages; one tile: no loop
            key = ((*shape, "short", problem.seqlen_cache <= plan.block_n) if short
                   else (*shape, plan.can_split, stages, q_rows))
            if key in seen:
                continue
            seen.add(key)
            decode.launchers_for(problem, plan, PROFILES["h200"], H200_TARGET)
            print("built", key, flush=True)
    print(f"{len(seen)} specialisations in {os.environ['TILELANG_CACHE_DIR']}")


if __name__ == "__main__":
    main()
