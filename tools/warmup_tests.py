"""Build, on a machine without the GPU, the TileLang kernels the GPU tests need, into TileLang's cache
(``flashdecode warmup`` builds the benchmark's: run both into one folder before a GPU run).

The tests' calls are read from the test modules (the random-shape test's kernel shapes, the paged
tests' calls, TileLang's feature cases, its sinks and fp8 calls, the FlashAttention grid's TileLang
and auto samples, the empty cache) or recorded from the transformers models' GPU tests run here on
the reference (``transformers_calls``); each is planned as ``flashdecode warmup`` plans a case
(``kernels.tilelang.warmup``).
Carry the folder packed (``XZ_OPT=-9e tar -cJf .tl-cache.tar.xz .tl-cache``; ``tools/device.sh`` unpacks
it and says why -9e).

Usage: python tools/warmup_tests.py [--cache-dir .tl-cache] [--shard I/N]
(about 10-30 s a kernel on 2 cores; needs pytest and hypothesis, which the test modules import)
"""
import argparse
import itertools
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from flashdecode import plan_for  # noqa: E402
from flashdecode.cli import parse_shard  # noqa: E402
from flashdecode.kernels.tilelang import warmup  # noqa: E402
from flashdecode.problem import Problem  # noqa: E402


def problem_of_call(q, k_cache, v_cache, **arguments):
    """The Problem the public call validates from these (CPU) arguments."""
    return plan_for(q, k_cache, v_cache, **arguments, backend="reference").problem


def test_problems() -> list:
    """(problem, forced split count) of every call the GPU tests make (``warmup.kernels`` keeps
    TileLang's)."""
    import fa_grid
    import test_fa_kvcache
    import test_gpu
    import test_paged
    import test_tilelang_compile

    problems = [Problem(3, 1, 8, 2, 128, "bfloat16")]  # the empty-cache test's kernels (unsplit)
    problems += [problem for problem, _ in test_tilelang_compile.GPU_CASES.values()]
    for dtype, headdim, nheads_k, group in test_gpu.KERNEL_SHAPES:
        for batch, capacity in itertools.product((1, 40), test_gpu.RANDOM_CAPACITIES + [70000]):
            problems.append(Problem(batch, capacity, nheads_k * group, nheads_k, headdim,
                                    str(dtype).removeprefix("torch.")))
    paged_calls = [(page_size, dtype, variant, test_paged.GPU_SHAPE) for page_size, dtype, variant in
                   itertools.product(test_paged.PAGE_SIZES, (torch.float16, torch.bfloat16),
                                     test_paged.VARIANTS.values())]
    paged_calls += [(page_size, torch.bfloat16, test_paged.VARIANTS[variant], shape)
                    for shape in test_paged.GPU_WIDE_SHAPES.values() for page_size in (16, 256)
                    for variant in ("plain", "serving")]
    for page_size, dtype, variant, shape in paged_calls:
        problems.append(problem_of_call(**test_paged.paged_call(page_size, variant, shape, dtype, 0)))
    calls = [(problem, splits) for problem in problems for splits in warmup.DEFAULT_SPLITS]
    return calls + serving_calls() + transformers_calls() + [
        (fa_grid.problem_of(combo), combo.num_splits)
        for combo in test_fa_kvcache.TILELANG_COMBOS + test_fa_kvcache.AUTO_COMBOS]


def serving_calls() -> list:
    """(problem, forced split count) of the GPU tests' sinks and fp8 calls on TileLang (``test_sinks``,
    ``test_fp8``)."""
    import test_fp8
    import test_sinks

    def problem_of(q, k_cache, v_cache, kwargs):
        return problem_of_call(q, k_cache, v_cache, **kwargs)

    calls = [(problem_of(*test_sinks.make_inputs(**test_sinks.GPU_CALL)), splits) for splits in test_sinks.GPU_SPLITS]
    for dtype in (torch.float16, torch.bfloat16):
        calls += [(problem_of(*test_fp8.make_call(**test_fp8.FEATURES[name], dtype=dtype)), 0)
                  for name in test_fp8.TILELANG_FEATURES]
        calls += [(problem_of(*test_fp8.make_call(**features, dtype=dtype)), splits)
                  for features in test_fp8.TILELANG_SPLIT_FEATURES.values() for splits in (1, 3, 0)]
    return calls


def transformers_calls() -> list:
    """(problem, 0) of every flashdecode call of ``test_transformers``' GPU tests on TileLang (the tiny
    models at TileLang's head dims, SmolLM2's config with random weights, both caches, bfloat16), recorded
    from the same steps run here on the reference; none where transformers is missing."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return []
    import test_transformers as models

    from flashdecode.integrations import transformers as integration

    problems, call = [], integration.flash_attn_with_kvcache

    def recording(q, k_cache, v_cache, backend, **arguments):
        problems.append((problem_of_call(q, k_cache, v_cache, **arguments), 0))
        return call(q, k_cache, v_cache, backend=backend, **arguments)

    integration.flash_attn_with_kvcache = recording
    try:
        name = integration.register("reference")
        runs = [(models.gpu_tiny_model(family, "tilelang"), *models.padded_prompts(256), models.STEPS)
                for family in models.FAMILIES]
        runs.append((*models.smollm2_random_batch(layers=1), models.SMOLLM_STEPS))
        for model32, ids, mask, steps in runs:
            for cache_kind in ("dynamic", "static"):
                models.step_logits(models.with_attention(model32, name), ids, mask, None, cache_kind, steps)
    finally:
        integration.flash_attn_with_kvcache = call
    return list(dict.fromkeys(problems))  # each layer and step repeats a few


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=str(REPO / ".tl-cache"), help="TileLang's cache folder "
                        "(TILELANG_CACHE_DIR; default: .tl-cache in the repository)")
    parser.add_argument("--shard", default="0/1", help="I/N: build every N-th kernel from the I-th (N processes)")
    args = parser.parse_args()
    try:
        index, count = parse_shard(args.shard)
    except ValueError as error:
        parser.error(str(error))
    os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    entries = warmup.kernels(test_problems())
    built = warmup.build(entries, shard=(index, count),
                         on_built=lambda kernel, problem, config: print("built", kernel, problem, config, flush=True))
    print(f"{built} of {len(entries)} kernels built into {args.cache_dir}")


if __name__ == "__main__":
    main()
