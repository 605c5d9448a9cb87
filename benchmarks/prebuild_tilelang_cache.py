"""Build, on a machine without the GPU, the TileLang kernels the H200 runs need, into .tl-cache/.

TileLang caches compiled kernels on disk, keyed by the kernel, the target and TileLang's version;
the kernels build for {"kind": "cuda", "arch": "sm_90a"} here and on the H200 alike, so carrying
this folder (packed: `tar -cJf .tl-cache.tar.xz .tl-cache`, then `carry: [".tl-cache.tar.xz"]`, see
benchmarks/device.sh) saves the ~15-20 s per kernel the GPU machine would spend compiling, out of
the session's device time. A cache entry that does not load there is treated by TileLang as a miss
and rebuilt.

Usage: python benchmarks/prebuild_tilelang_cache.py [--stages 2,3 --q-rows 64,16 --block-n 32] [--shard I/N]
(about 10 s per kernel on 2 cores; the default builds the shipped configs, a list builds sweep
variants of the split kernel's config)
"""
import argparse
import dataclasses
import itertools
import os
import pathlib
import sys

os.environ.setdefault("TILELANG_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".tl-cache"))

import torch  # noqa: E402

from flashdecode import plan_for, planner  # noqa: E402
from flashdecode.cases import CASES, MODEL_CASES, VARIANTS, WIDE_CASES  # noqa: E402
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang.backend import TileLangBackend, problem_limitation, q_tile_rows  # noqa: E402
from flashdecode.kernels.tilelang.build import SM90A  # noqa: E402
from flashdecode.kernels.tilelang.config import KernelShape  # noqa: E402
from flashdecode.problem import Problem  # noqa: E402

H200 = PROFILES["h200"]


def calls(backend, with_tests: bool):
    """(problem, plan) for every call the benchmark (every variant; the wide and models matrices plain) and
    the sanitizer make, forced splits too, and with ``with_tests`` the GPU tests' calls (the random shapes
    and the TileLang feature cases)."""
    problems = [variant.problem(case) for case in CASES for variant in VARIANTS.values()]
    problems += [VARIANTS["plain"].problem(case) for case in WIDE_CASES + MODEL_CASES]
    problems.append(Problem(3, 1, 8, 2, 128, "bfloat16"))  # empty-cache test's kernels (unsplit)
    if with_tests:  # the random-shape test's kernels (its KERNEL_SHAPES); needs pytest and hypothesis
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        import test_gpu
        import test_tilelang_compile

        problems += [problem for problem, _ in test_tilelang_compile.GPU_CASES.values()]

        for dtype, headdim, nheads_k, group in test_gpu.KERNEL_SHAPES:
            for batch, capacity in itertools.product((1, 40), test_gpu.RANDOM_CAPACITIES + [70000]):
                problems.append(Problem(batch, capacity, nheads_k * group, nheads_k, headdim,
                                        str(dtype).removeprefix("torch.")))
        import test_paged  # the paged tests' calls TileLang takes

        paged_calls = [(page_size, dtype, variant, test_paged.GPU_SHAPE) for page_size, dtype, variant in
                       itertools.product(test_paged.PAGE_SIZES, (torch.float16, torch.bfloat16),
                                         test_paged.VARIANTS.values())]
        paged_calls += [(page_size, torch.bfloat16, test_paged.VARIANTS[variant], shape)
                        for shape in test_paged.GPU_WIDE_SHAPES.values() for page_size in (16, 256)
                        for variant in ("plain", "serving")]
        for page_size, dtype, variant, shape in paged_calls:
            problem = problem_of_call(**test_paged.paged_call(page_size, variant, shape, dtype, 0))
            if problem_limitation(problem) is None:
                problems.append(problem)
    for problem in problems:
        if problem_limitation(problem) is not None:  # e.g. the benchmark's pages of 1 and 4: Triton's
            continue
        for num_splits in (0, 2, 3):
            yield problem, planner.plan(problem, H200, backend, num_splits)
    if with_tests:  # FlashAttention's grid: test_fa_kvcache's samples of TileLang's part (named and auto)
        import fa_grid
        import test_fa_kvcache

        for combo in test_fa_kvcache.TILELANG_COMBOS + test_fa_kvcache.AUTO_COMBOS:
            problem = fa_grid.problem_of(combo)
            if problem_limitation(problem) is None:
                yield problem, planner.plan(problem, H200, backend, combo.num_splits)


def problem_of_call(**arguments):
    """The Problem the public call validates from these (CPU) arguments."""
    return plan_for(**arguments, backend="reference").problem


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="", help="SplitConfig.num_stages values (default: the shipped one)")
    parser.add_argument("--q-rows", default="",
                        help="fewest q-tile rows, SplitConfig.block_m (default: the shipped one)")
    parser.add_argument("--block-n", default="", help="SplitConfig.block_n (default: the shipped one)")
    parser.add_argument("--with-tests", action="store_true",
                        help="also the GPU tests' kernels (always, when no variant is given)")
    parser.add_argument("--shard", default="0/1", help="I/N: build every N-th kernel from the I-th (N processes)")
    args = parser.parse_args()
    shard, shards = (int(part) for part in args.shard.split("/"))
    backend = TileLangBackend()
    knobs = [(field, [int(value) for value in values.split(",")])
             for field, values in (("num_stages", args.stages), ("block_m", args.q_rows), ("block_n", args.block_n))
             if values]
    variants = [dict(zip([field for field, _ in knobs], values))
                for values in itertools.product(*[values for _, values in knobs])]
    shipped = not knobs
    seen = set()
    for problem, plan in calls(backend, with_tests=shipped or args.with_tests):
        configs = [plan.config]
        if plan.kernel != planner.SHORT_CACHE and not shipped:
            configs = [dataclasses.replace(plan.config, **{**variant, "block_m": q_tile_rows(
                problem.q_rows, variant.get("block_m", plan.config.block_m))}) for variant in variants]
        for config in configs:
            kernels = [plan.kernel] + (["combine"] if plan.needs_combine else [])
            for kernel in kernels:
                key = (kernel, config, KernelShape.of(problem))
                if key in seen:
                    continue
                seen.add(key)
                if len(seen) % shards != shard:
                    continue
                backend.compiled(kernel, problem, config, H200, SM90A)
                print("built", key, flush=True)
    print(f"{len(seen)} kernels in {os.environ['TILELANG_CACHE_DIR']}")


if __name__ == "__main__":
    main()
