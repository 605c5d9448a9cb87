"""Build, on a machine without the GPU, the TileLang kernels the H200 runs need, into .tl-cache/.

TileLang caches compiled kernels on disk, keyed by the kernel, the target and TileLang's version;
the kernels build for {"kind": "cuda", "arch": "sm_90a"} here and on the H200 alike, so carrying
this folder (`carry: [".tl-cache"]`, see benchmarks/device.sh) saves the ~15-20 s per kernel the
GPU machine would spend compiling, out of the session's device time. A cache entry that does not
load there is treated by TileLang as a miss and rebuilt.

Usage: python benchmarks/prebuild_tilelang_cache.py   (about 10 s per kernel on 2 cores)
"""
import os
import pathlib

os.environ.setdefault("TILELANG_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".tl-cache"))

from flashdecode import planner  # noqa: E402
from flashdecode.cases import CASES  # noqa: E402
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang import decode  # noqa: E402

H200_TARGET = decode._freeze({"kind": "cuda", "arch": "sm_90a"})


def specialisations():
    """(problem, plan) for every call the GPU tests, the benchmark and the sanitizer make, forced splits too."""
    problems = [planner.Problem(c.batch, c.seqlen_cache, c.nheads, c.nheads_k, 128, "bfloat16") for c in CASES]
    problems.append(planner.Problem(3, 1, 8, 2, 128, "bfloat16"))  # empty-cache test's kernels (unsplit)
    for problem in problems:
        for num_splits in (0, 3):
            yield problem, planner.plan(problem, PROFILES["h200"], num_splits)


def main():
    seen = set()
    for problem, plan in specialisations():
        key = (problem.dtype, problem.headdim, problem.group, problem.nheads_k, plan.block_n, plan.can_split)
        if key in seen:
            continue
        seen.add(key)
        decode.kernels_for(*key, PROFILES["h200"].registers_per_multiprocessor, target=H200_TARGET)
        print("built", key, flush=True)
    print(f"{len(seen)} specialisations in {os.environ['TILELANG_CACHE_DIR']}")


if __name__ == "__main__":
    main()
