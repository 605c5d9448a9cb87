"""Building TileLang's kernels ahead of the calls that need them (``flashdecode warmup``).

TileLang compiles each kernel specialisation on its first use (about 15-20 s on the H200 machine)
and keeps it on disk (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``), keyed by the kernel,
the target, the compile flags and TileLang's version. Kernels built for the explicit target
{"kind": "cuda", "arch": "sm_90a"} (``build.SM90A``) have the same key whether built on the GPU or
on a machine without one, so a cache built here and carried to a Hopper GPU saves that time there;
an entry that does not load is a miss TileLang rebuilds.

Which kernels: those of the planner's plans (on the H200 profile) for the given problems, forced
splits included, optionally with other tiles for the split kernel (a sweep's); problems TileLang
cannot take are skipped.
"""
from __future__ import annotations

import dataclasses
import itertools

from ... import planner
from ...hardware import PROFILES, HardwareProfile
from .backend import TileLangBackend, problem_limitation, q_tile_rows
from .build import SM90A
from ...validate import check_tile_config
from .config import KernelShape, SplitConfig

#: Forced split counts each case is planned with by default (0: the planner's own choice): the
#: unsplit and split kernels the GPU tests and the sanitizer force too.
DEFAULT_SPLITS = (0, 2, 3)
#: Split-kernel fields a warm-up may vary (``tile_variants``), as ``tools/sweep.py`` does.
SPLIT_FIELDS = ("block_n", "num_stages", "block_m")


def tile_variants(**values: tuple[int, ...]) -> list[dict]:
    """Every combination of the given split-kernel field values (``SPLIT_FIELDS``; an empty tuple
    leaves the field as planned): [{}] when none is given. ValueError for another field."""
    unknown = sorted(set(values) - set(SPLIT_FIELDS))
    if unknown:
        raise ValueError(f"tile fields must be among {SPLIT_FIELDS}, got {unknown}")
    given = [(field, options) for field, options in values.items() if options]
    variants = [dict(zip([field for field, _ in given], combination))
                for combination in itertools.product(*[options for _, options in given])]
    for variant in variants:  # the rule a DecodeContext's config meets (ValueError naming the field)
        check_tile_config(dataclasses.replace(SplitConfig(block_n=64), **variant))
    return variants


def kernels(calls, variants=({},), profile: HardwareProfile = PROFILES["h200"],
            backend: TileLangBackend | None = None) -> list[tuple]:
    """The distinct (kernel, problem, config) to build for ``calls``, (problem, forced split count)
    pairs (0: the planner's choice): each problem TileLang can take, planned so; its plan's kernel
    and, where the plan has one, the combine; the split kernel's config changed by each of
    ``variants`` (a query tile below the problem's rows is rounded up to them, as ``default_config``
    does). One entry per (kernel, config, kernel shape): calls that differ only in runtime sizes
    share it."""
    backend = backend or TileLangBackend()
    seen, found = set(), []
    for problem, num_splits in calls:
        if problem_limitation(problem) is not None:
            continue
        plan = planner.plan(problem, profile, backend, num_splits)
        configs = [plan.config]
        if plan.kernel != planner.SHORT_CACHE and variants != ({},):
            configs = [dataclasses.replace(plan.config, **{**variant, "block_m": q_tile_rows(
                problem.q_rows, variant.get("block_m", plan.config.block_m))}) for variant in variants]
        for config, kernel in itertools.product(configs, [plan.kernel] + (["combine"] if plan.needs_combine else [])):
            key = (kernel, config, KernelShape.of(problem))
            if key not in seen:
                seen.add(key)
                found.append((kernel, problem, config))
    return found


def build(entries, profile: HardwareProfile = PROFILES["h200"], target: dict = SM90A, shard: tuple[int, int] = (0, 1),
          backend: TileLangBackend | None = None, on_built=None) -> int:
    """Compile ``entries`` (``kernels``' list) for ``target`` into TileLang's cache; with ``shard`` =
    (i, n) only every n-th from the i-th, so that n processes share the list. ``on_built(kernel,
    problem, config)`` follows each build. Returns how many were built."""
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
    backend = backend or TileLangBackend()
    built = 0
    for kernel, problem, config in entries[index::count]:
        backend.compiled(kernel, problem, config, profile, target)
        built += 1
        if on_built is not None:
            on_built(kernel, problem, config)
    return built
