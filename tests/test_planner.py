"""Planner properties on every hardware profile and backend: exact coverage, bounds, fill, no tail."""
import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashdecode.cases import CASES, case_seqlens
from flashdecode.hardware import PROFILES, Tuning
from flashdecode.kernels import get_backend
from flashdecode.kernels.triton.backend import fp8_v_words
from flashdecode.planner import SHORT_CACHE, SINGLE_PASS, SPLIT, Problem, key_range, plan, work_list

PROFILE_NAMES = sorted(PROFILES)
BACKENDS = ["triton", "tilelang"]


def problem_for(lengths, seqlen_cache, nheads_k=8, group=4, headdim=128, **features):
    return Problem(len(lengths), seqlen_cache, nheads_k * group, nheads_k, headdim, "bfloat16", **features)


def assert_covers_exactly_once(p, lengths, starts=None):
    starts = starts or [0] * len(lengths)
    items = work_list(p, lengths, starts)
    assert len(items) <= p.programs_per_head
    assert [item.program for item in items] == list(range(len(items)))
    for sequence, (start, length) in enumerate(zip(starts, lengths)):
        mine = [item for item in items if item.sequence == sequence]
        assert mine, "every sequence gets a program (an empty one writes 0 / -inf)"
        assert [item.split for item in mine] == list(range(len(mine)))
        assert all(item.num_splits == len(mine) for item in mine)
        covered = [t for item in mine for t in range(item.token_start, item.token_end)]
        assert covered == list(range(start, length)), f"sequence {sequence} not covered exactly once"
        # Every split but the first starts on a block boundary, so programs read whole blocks.
        assert all(item.token_start % p.block_n == 0 for item in mine[1:])
        if len(mine) > 1:
            assert all(item.tokens > 0 for item in mine), "a split sequence has no empty split"
    return items


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_key_ranges_covered_exactly_once(backend, profile_name, data):
    seqlen_cache = data.draw(st.integers(1, 70000))
    lengths = data.draw(st.lists(st.integers(0, seqlen_cache), min_size=1, max_size=96))
    starts = [data.draw(st.integers(0, length)) for length in lengths]
    nheads_k = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_splits = data.draw(st.sampled_from([0, 0, 0, 1, 2, 7]))
    problem = problem_for(lengths, seqlen_cache, nheads_k)
    p = plan(problem, PROFILES[profile_name], get_backend(backend), num_splits)
    assert 1 <= p.programs_per_head
    items = assert_covers_exactly_once(p, lengths, starts)
    assert all(item.num_splits <= p.max_splits(problem) for item in items)  # the bound merging relies on
    # the bounds the grid's tile config is chosen by (``Backend.for_grid``)
    assert len(items) <= p.working_programs(problem)
    assert all(-(-item.token_end // p.block_n) - item.token_start // p.block_n <= p.most_blocks_per_program(problem)
               for item in items if item.tokens)
    if num_splits:
        capped = min(num_splits, max(1, math.ceil(seqlen_cache / p.block_n)))  # no split can be empty
        assert p.programs_per_head == len(lengths) * capped
        assert all(item.num_splits <= capped for item in items)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c.number}")
def test_matrix_cases_fill_the_machine_without_tail(backend, profile_name, case):
    profile = PROFILES[profile_name]
    lengths = case_seqlens(case.batch, case.seqlen_cache).tolist()
    p = plan(problem_for(lengths, case.seqlen_cache, case.nheads_k, case.group), profile, get_backend(backend))
    items = assert_covers_exactly_once(p, lengths)
    blocks = sum(math.ceil(n / p.block_n) for n in lengths)
    programs = len(items) * case.nheads_k
    # The grid fills every multiprocessor wherever there are enough KV blocks to go round in
    # splits of at least min_chunk blocks.
    if p.can_split:
        assert programs >= min(profile.multiprocessors, blocks // p.min_chunk * case.nheads_k)
    # No program carries much more than the average: at most twice the mean, plus one block.
    mean = sum(lengths) / len(items)
    assert max(item.tokens for item in items) <= 2 * mean + p.block_n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
def test_skewed_batch_has_no_tail(backend, profile_name):
    lengths = [65536] + [480 + 7 * i for i in range(31)]
    profile = PROFILES[profile_name]
    for nheads_k in (4, 8):
        p = plan(problem_for(lengths, 65536, nheads_k), profile, get_backend(backend))
        items = assert_covers_exactly_once(p, lengths)
        mean = sum(lengths) / len(items)
        assert max(item.tokens for item in items) <= 2 * mean
        assert len(items) * nheads_k >= profile.multiprocessors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
def test_shapes_named_by_the_brief(backend, profile_name):
    profile, chosen = PROFILES[profile_name], get_backend(backend)
    long_single = plan(problem_for([60000], 60000, 4), profile, chosen)
    assert long_single.can_split and len(work_list(long_single, [60000])) * 4 >= profile.multiprocessors
    big_batch = plan(problem_for([2048] * 64, 2048, 8), profile, chosen)
    assert len(work_list(big_batch, [2048] * 64)) <= 4 * 64, "batch 64 x 2k needs few splits or none"
    tiny = plan(problem_for([1], 1, 4), profile, chosen)
    assert not tiny.needs_combine and tiny.programs_per_head == 1


def test_the_plan_names_the_kernel():
    profile = PROFILES["h200"]
    tilelang, triton = get_backend("tilelang"), get_backend("triton")
    one_tile = problem_for([17] * 16, 17, 4, 8)
    assert plan(one_tile, profile, tilelang).kernel == SHORT_CACHE  # TileLang has a short-cache kernel
    assert plan(one_tile, profile, triton).kernel == SINGLE_PASS  # Triton does not
    assert plan(problem_for([362] * 16, 362), profile, tilelang).kernel == SINGLE_PASS  # 6 tiles: no split
    assert plan(problem_for([4096] * 16, 4096, 4, 8), profile, tilelang).kernel == SPLIT
    forced = plan(one_tile, profile, tilelang, num_splits=1)
    assert forced.kernel == SINGLE_PASS and forced.programs_per_head == 16


def test_a_window_narrows_the_keys_planned():
    profile, triton = PROFILES["h200"], get_backend("triton")
    windowed = problem_for([65536], 65536, 4, 8, window_left=100)
    assert windowed.key_span() == 101
    assert plan(windowed, profile, triton).kernel == SINGLE_PASS  # 2 blocks: never worth a split
    assert key_range(windowed, 65536) == (65536 - 101, 65536)
    appended = problem_for([1000], 1000, seqlen_new=3, seqlen_q=3)
    assert key_range(appended, 997, leftpad=10) == (10, 1000)
    assert key_range(appended, 999) == (0, 1000)  # past the capacity: clamped (the kernels write NaN)


def test_row_tiles_share_the_split_target():
    profile, triton = PROFILES["h200"], get_backend("triton")
    single = plan(problem_for([65536], 65536, 1, 8), profile, triton)
    many_rows = plan(problem_for([65536], 65536, 1, 32, seqlen_q=16), profile, triton)
    assert many_rows.row_tiles(problem_for([1], 1, 1, 32, seqlen_q=16)) > 1
    assert many_rows.programs_per_head < single.programs_per_head


def test_negative_splits_are_rejected():
    with pytest.raises(ValueError, match="num_splits"):
        plan(problem_for([10], 10), PROFILES["h200"], get_backend("triton"), -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_program_fits_the_shared_memory_of_each_profile(backend):
    """A split program's shared memory, by the backend's own layout, fits a multiprocessor of every
    profile, for every head dim, dtype and q tile."""
    if backend == "tilelang":
        from flashdecode.kernels.tilelang.occupancy import split_shared_bytes as needed
    else:
        from flashdecode.kernels.triton.backend import padded_headdim, shared_bytes

        def needed(problem, config, profile):
            return shared_bytes(config, padded_headdim(problem.headdim), problem.element_bytes, profile)
    for profile, headdim, dtype, group in itertools.product(PROFILES.values(), (64, 128, 256), ("float16", "float32"),
                                                            (1, 8, 64)):
        if backend == "tilelang" and (dtype == "float32" or profile.name == "c500"):
            continue  # TileLang's kernels: 16-bit types on Hopper
        problem = Problem(1, 4096, 8 * group, 8, headdim, dtype)
        p = plan(problem, profile, get_backend(backend), num_splits=2)
        assert needed(problem, p.config, profile) <= profile.shared_memory_per_multiprocessor, (profile.name, p)


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, headdim, able, expected, features", [
    (16, 64, 8, 128, ("tilelang", "triton"), "tilelang", {}),  # one block a sequence, under 32 MiB
    (16, 200, 8, 128, ("tilelang", "triton"), "triton", {}),  # 4 blocks a program: Triton's 4 stages
    (16, 100, 8, 128, ("tilelang", "triton"), "tilelang", {}),  # 2 blocks: Triton keeps 2 stages
    (1, 256, 8, 128, ("tilelang", "triton"), "triton", {}),  # 256 tokens a sequence: never split, 4 stages
    (16, 362, 8, 128, ("tilelang", "triton"), "triton", {}),  # 6 blocks, 128 programs: Triton splits
    (17, 300, 8, 128, ("tilelang", "triton"), "triton", {}),  # 5 blocks, 136 programs: no split, 4 stages
    (1, 8192, 4, 128, ("tilelang", "triton"), "triton", {}),  # case 10: 16 MiB, but a split cache
    (16, 4096, 4, 128, ("tilelang", "triton"), "triton", {}),  # 128 MiB at head dim 128
    (8, 32768, 1, 256, ("tilelang", "triton"), "tilelang", {}),  # head dim 256
    (8, 32768, 1, 256, ("triton",), "triton", {}),  # where TileLang cannot take it
    (16, 362, 8, 128, ("triton",), "triton", {}),
    (16, 362, 8, 128, (), "reference", {}),
    (16, 362, 8, 128, ("tilelang", "triton"), "triton", dict(page_size=16)),  # paged, under 32 MiB
    (16, 362, 8, 128, ("tilelang", "triton"), "triton", dict(seqlen_new=1)),  # appended tokens
    (16, 64, 8, 128, ("tilelang", "triton"), "tilelang", dict(seqlen_q=4)),  # several query tokens
    (16, 362, 8, 256, ("tilelang", "triton"), "tilelang", dict(page_size=64)),  # paged at head dim 256
])
def test_auto_takes_the_first_backend_whose_limits_hold(monkeypatch, batch, seqlen_cache, nheads_k, headdim, able,
                                                        expected, features):
    """``select("auto")`` over ``Tuning.auto_order`` on a CUDA device, each backend able or not."""
    from flashdecode.kernels import base

    monkeypatch.setattr(base, "why_not", lambda name, problem, device: None if name in able else "unable here")
    problem = Problem(batch, seqlen_cache, nheads_k * 4, nheads_k, headdim, "bfloat16", **features)
    chosen = base.select("auto", problem, torch.device("cuda", 0), PROFILES["h200"])
    assert chosen.name == expected


def test_auto_gives_pages_that_are_no_power_of_two_to_triton(monkeypatch):
    """Pages of 768 tokens (a FlashAttention size): TileLang's limitation names the page size, so
    ``auto`` runs Triton where it would run TileLang on pages of 256 (head dim 256)."""
    from flashdecode.kernels import base
    from flashdecode.kernels.tilelang.backend import problem_limitation

    monkeypatch.setattr(base, "why_not", lambda name, problem, device:
                        problem_limitation(problem) if name == "tilelang" else None)
    problem = Problem(16, 1536, 32, 8, 256, "bfloat16", page_size=768)
    assert "power-of-two page_size (got 768)" in problem_limitation(problem)
    assert base.select("auto", problem, torch.device("cuda", 0), PROFILES["h200"]).name == "triton"
    pages_of_256 = dataclasses.replace(problem, page_size=256)
    assert base.select("auto", pages_of_256, torch.device("cuda", 0), PROFILES["h200"]).name == "tilelang"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_plan_bounds_hold_under_windows_and_appended_tokens(backend, data):
    """The bounds the device-side rule must respect, with a left window whose keys start mid-block
    (or none), appended tokens and several query rows: ``Plan.max_splits`` (what merging in the
    split kernel is allowed by) is at least the splits any sequence gets, ``working_programs`` the
    programs with keys, ``most_blocks_per_program`` any program's blocks (what the grid's tile
    config is chosen by, ``Backend.for_grid``). Some lengths put a window's first visible key on the last
    key of a block, where its keys span the most blocks."""
    seqlen_cache = data.draw(st.integers(1, 20000))
    window_left = data.draw(st.sampled_from([-1, data.draw(st.integers(0, 3000))]))
    seqlen_new = data.draw(st.sampled_from([0, 0, min(seqlen_cache, data.draw(st.integers(1, 8)))]))
    seqlen_q, batch = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
    problem = problem_for([0] * batch, seqlen_cache, seqlen_q=seqlen_q, window_left=window_left,
                          window_right=0 if window_left >= 0 else -1, seqlen_new=seqlen_new)
    p = plan(problem, PROFILES["h200"], get_backend(backend), data.draw(st.sampled_from([0, 0, 3])))
    room = seqlen_cache - seqlen_new
    # lengths whose first visible key (length + seqlen_new - seqlen_q - window_left) ends a block
    first_worst = p.block_n - 1 + seqlen_q + window_left - seqlen_new
    worst = [n for n in range(first_worst, room + 1, p.block_n) if n >= 0][:50] if window_left >= 0 else []
    length = st.one_of(st.integers(0, room), st.sampled_from(worst)) if worst else st.integers(0, room)
    lengths = [data.draw(length) for _ in range(batch)]
    ranges = [key_range(problem, length) for length in lengths]
    items = work_list(p, [hi for _, hi in ranges], [lo for lo, _ in ranges])
    assert all(item.num_splits <= p.max_splits(problem) for item in items)
    assert len([item for item in items if item.tokens]) <= p.working_programs(problem)
    assert all(-(-item.token_end // p.block_n) - item.token_start // p.block_n <= p.most_blocks_per_program(problem)
               for item in items if item.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
@pytest.mark.parametrize("seqlen_q, nheads_k, group, num_splits", [
    (256, 32, 8, 64), (2048, 8, 4, 0), (2048, 8, 4, 64), (4096, 32, 1, 0), (16, 8, 4, 0), (16, 8, 4, 5)])
def test_grids_fit_cudas_limits(backend, profile_name, seqlen_q, nheads_k, group, num_splits):
    """A long chunk of queries over a long cache (a chunked prefill) forced into more splits than the
    split kernel merges would get a combine whose grid of KV heads x query rows exceeds CUDA's
    65,535, above which CUDA launches no grid (256 x 32 x 8 rows, num_splits=64; planned so before
    2026-12-07): such calls run unsplit; more row tiles than a grid holds raise ValueError naming q."""
    from flashdecode.planner import GRID_YZ_LIMIT

    problem = problem_for([0] * 2, 32768, nheads_k=nheads_k, group=group, seqlen_q=seqlen_q)
    p = plan(problem, PROFILES[profile_name], get_backend(backend), num_splits)
    assert max(p.grid(problem)[1:]) <= GRID_YZ_LIMIT
    assert not p.needs_combine or nheads_k * problem.q_rows <= GRID_YZ_LIMIT
    if backend == "triton":  # (TileLang's programs hold all of a KV head's rows: one row tile)
        huge = dataclasses.replace(problem, seqlen_q=2 ** 26)
        with pytest.raises(ValueError, match=r"q: .* row tiles .* above the 65535"):
            plan(huge, PROFILES[profile_name], get_backend(backend))


@pytest.mark.parametrize("threshold", [0, 4, 64, 10_000])
def test_split_plans_merge_in_the_kernel_up_to_the_tunings_splits(threshold):
    """Triton's split plans merge in the split kernel exactly when no sequence can get more splits
    than the tuning allows; TileLang's never (it has no such kernel); other kernels never. Plans
    that keep a combine split down to ``min_blocks_per_combined_split``."""
    profile = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(
        PROFILES["h200"].tuning, max_splits_merged_in_split=threshold))
    for batch, seqlen_cache, num_splits in itertools.product([1, 4, 64], [100, 5000, 60000], [0, 3]):
        problem = problem_for([seqlen_cache] * batch, seqlen_cache)
        for backend in BACKENDS:
            p = plan(problem, profile, get_backend(backend), num_splits)
            one_sequence = backend == "triton" and batch == 1 and num_splits == 0  # 1-block splits
            merges = backend == "triton" and p.kernel == SPLIT and p.max_splits(problem) <= threshold \
                and p.max_splits(problem) * p.config.block_m <= 512  # Hopper's row cap
            assert p.merge_in_split == merges
            assert p.needs_combine == (p.kernel == SPLIT and not merges)
            assert p.workspace_rows == (p.programs_per_head if p.kernel == SPLIT else 0)
            assert p.ticket_count(problem) == (batch * problem.nheads_k * p.row_tiles(problem) if merges else 0)
            if p.kernel == SPLIT and num_splits == 0:  # a combine takes shorter splits than the merge allows
                tuning = profile.tuning
                combined = dict(tuning.min_blocks_per_combined_split).get(backend, tuning.min_blocks_per_split)
                assert p.min_chunk == (1 if one_sequence else tuning.min_blocks_per_split if merges else combined)


@pytest.mark.parametrize("seqlen_q, group, capacity, merges", [
    (1, 71, 8192, False),  # 64-row tiles: at most 8 splits merged (16 here)
    (1, 71, 2048, True),  # 4 splits of 64 rows
    (4, 16, 4096, False),  # 64 rows from 4 query tokens
    (4, 8, 4096, True),  # 32-row tiles merge up to 16 splits
    (1, 8, 4096, True)])
def test_large_row_tiles_merge_fewer_splits(seqlen_q, group, capacity, merges):
    """Hopper's ``max_rows_merged_in_split``: a merging program reads splits x row tile partial rows,
    at most 512 (measured on the H200, ``hardware.Tuning``)."""
    problem = problem_for([capacity] * 4, capacity, nheads_k=1, group=group, headdim=64 if group == 71 else 128,
                          seqlen_q=seqlen_q)
    # 4 sequences on one KV head leave the grid underfilled (``test_underfilled_grids_take_shorter_splits``):
    # the rows cap alone here
    rows_only = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(PROFILES["h200"].tuning,
                                                                             underfilled_merge_caps=None))
    p = plan(problem, rows_only, get_backend("triton"))
    assert p.kernel == SPLIT and p.merge_in_split == merges
    assert not merges or p.max_splits(problem) * p.config.block_m <= 512
    unlimited = dataclasses.replace(rows_only, tuning=dataclasses.replace(rows_only.tuning,
                                                                      max_rows_merged_in_split=None))
    assert plan(problem, unlimited, get_backend("triton")).merge_in_split  # at most 16 splits: the split rule alone
    forced = plan(problem, PROFILES["h200"], get_backend("triton"), 9)  # forced splits meet the cap too
    assert forced.merge_in_split == (forced.config.block_m <= 32)  # 9 x 64 rows > 512 >= 9 x 32


def test_shorter_combined_splits_only_where_measured():
    """The 2-block splits of plans that keep a combine are Hopper's (measured on the H200); a device
    with the default tuning splits no shorter than ``min_blocks_per_split``."""
    problem = problem_for([8192, 8192], 8192)
    triton = get_backend("triton")
    assert plan(problem, PROFILES["h200"], triton).min_chunk == 2
    assert plan(problem, PROFILES["c500"], triton).min_chunk == PROFILES["c500"].tuning.min_blocks_per_split == 4
    assert plan(problem, PROFILES["h200"], get_backend("tilelang")).min_chunk == 4


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, group, headdim, underfilled, merges", [
    (32, 1024, 1, 32, 128, True, True),  # 8 splits of 32 rows: within (8, 256)
    (16, 1024, 4, 1, 128, True, True),
    (16, 2048, 1, 71, 64, True, False),  # Falcon-7B's 71 heads: 8 splits of 64-row tiles, 512 rows
    (8, 4096, 2, 8, 256, True, False),  # 32 splits
    (64, 2048, 1, 71, 64, False, True),  # the keys fill the grid: splits of 6 blocks
    (16, 4096, 4, 8, 128, False, True),  # case 8's shape
    (4, 512, 8, 4, 128, False, True),  # a short cache's 1-block splits: none shorter to take
])
def test_underfilled_grids_take_shorter_splits(batch, seqlen_cache, nheads_k, group, headdim, underfilled, merges):
    """Hopper's ``underfilled_merge_caps``: a batch whose splits the fewest blocks a split carries
    sets (even at capacity) takes the combine's 2-block minimum and merges in the split kernel only
    within (8 splits, 256 rows) and the general caps; a batch that fills the grid, a short cache's
    single-block splits, one sequence and a device without the tuning keep the merge's rule."""
    problem = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group, headdim)
    triton = get_backend("triton")
    p = plan(problem, PROFILES["h200"], triton)
    merge_rule = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(
        PROFILES["h200"].tuning, underfilled_merge_caps=None))
    before = plan(problem, merge_rule, triton)
    assert p.kernel == before.kernel == SPLIT and before.merge_in_split
    assert p.merge_in_split == merges and p.needs_combine == (not merges)
    if underfilled:
        assert before.min_chunk_binds(problem) and p.min_chunk == 2
        assert not merges or (p.max_splits(problem) <= 8 and p.max_splits(problem) * p.config.block_m <= 256)
        items = assert_covers_exactly_once(before, [seqlen_cache] * batch)
        assert all(-(-item.token_end // before.block_n) - item.token_start // before.block_n <= before.min_chunk
                   for item in items), "a binding minimum sets every split's length, even at capacity"
        assert_covers_exactly_once(p, [seqlen_cache] * batch)
    else:
        assert p == before
    never = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(
        PROFILES["h200"].tuning, max_splits_merged_in_split=0))
    assert not plan(problem, never, triton).merge_in_split  # the caps are tighter, never looser
    tilelang = get_backend("tilelang")
    assert plan(problem, PROFILES["h200"], tilelang) == plan(problem, merge_rule, tilelang)  # its minimum is 4
    paged = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group, headdim, page_size=256)
    assert plan(paged, PROFILES["h200"], triton).merge_in_split == merges  # the capacity decides, not the layout
    one = problem_for([1024], 1024, 8)
    assert plan(one, PROFILES["h200"], triton) == plan(one, merge_rule, triton)  # one sequence: its own rule
    assert PROFILES["c500"].tuning.underfilled_merge_caps is None  # off where not measured


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, group, splits", [
    (16, 362, 8, 4, True),  # 6 blocks, 128 programs unsplit: fewer than the 132 multiprocessors
    (1, 320, 32, 1, True),  # 5 blocks
    (1, 512, 2, 8, True),
    (17, 362, 8, 4, False),  # 136 programs
    (4, 256, 8, 4, False),  # 4 blocks: at most the underfilled count
    (16, 512, 1, 64, True),  # 64 rows, one row tile
])
def test_short_caches_split_into_single_blocks_where_the_device_would_idle(batch, seqlen_cache, nheads_k, group,
                                                                          splits):
    """On Hopper Triton splits caches of 5-8 blocks into 1-block programs where the unsplit grid
    (batch * KV heads * row tiles) is smaller than the multiprocessor count; TileLang and a device
    without the tuning never split them."""
    problem = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group)
    triton, tilelang = get_backend("triton"), get_backend("tilelang")
    p = plan(problem, PROFILES["h200"], triton)
    assert (p.kernel == SPLIT) == splits
    if splits:
        assert p.min_chunk == 1 and p.max_splits(problem) == math.ceil(seqlen_cache / p.block_n)
        assert_covers_exactly_once(p, [seqlen_cache] * batch)
    assert plan(problem, PROFILES["h200"], tilelang).kernel != SPLIT
    untuned = dataclasses.replace(PROFILES["h200"], tuning=Tuning())
    assert plan(problem, untuned, triton).kernel != SPLIT


@pytest.mark.parametrize("seqlen_cache, merges", [(1024, True), (4096, False), (8192, False), (60000, False)])
def test_one_sequence_splits_into_single_blocks_where_measured(seqlen_cache, merges):
    """On Hopper one sequence takes Triton's 1-block splits, merged in the split kernel where it
    gets at most 16 (1024 tokens: 16 blocks), else by the combine; a forced split count, TileLang,
    a batch of two and a device without the tuning keep their rules."""
    one, two = problem_for([seqlen_cache], seqlen_cache), problem_for([seqlen_cache] * 2, seqlen_cache)
    triton, tilelang = get_backend("triton"), get_backend("tilelang")
    p = plan(one, PROFILES["h200"], triton)
    assert (p.kernel, p.min_chunk, p.merge_in_split, p.needs_combine) == (SPLIT, 1, merges, not merges)
    assert plan(one, PROFILES["h200"], triton, num_splits=4).merge_in_split  # forced: 4 splits merge
    assert plan(one, PROFILES["h200"], tilelang).min_chunk == 4
    assert plan(two, PROFILES["h200"], triton).min_chunk == 2  # a combine's: too many splits, or an underfilled grid
    assert plan(one, PROFILES["c500"], triton).min_chunk == 4
    lengths = [seqlen_cache - 1]
    items = work_list(p, lengths)
    assert sum(item.tokens for item in items) == seqlen_cache - 1 and len(items) <= p.programs_per_head


@pytest.mark.parametrize("tuned", [False, True])
@pytest.mark.parametrize("device", [True, False], ids=["hopper", "no-pdl"])
def test_combines_are_dependent_launches_where_the_tuning_the_device_and_the_backend_allow(tuned, device):
    """Plans that keep a combine launch it as a programmatic dependent launch exactly where the
    tuning asks, the device has it (a context's tuning cannot ask it of an older GPU) and the
    backend can; TileLang never."""
    h200 = PROFILES["h200"]
    profile = dataclasses.replace(h200, tuning=dataclasses.replace(h200.tuning, dependent_combine=tuned),
                                  dependent_launch=device)
    triton_type = type(get_backend("triton"))

    class Able(triton_type):
        def launches_dependent_combine(self, problem):
            return True

    class Unable(triton_type):
        def launches_dependent_combine(self, problem):
            return False

    for batch, seqlen_cache, num_splits in itertools.product([1, 4, 64], [100, 5000, 60000], [0, 3, 40]):
        problem = problem_for([seqlen_cache] * batch, seqlen_cache)
        for backend in (Able(), Unable(), get_backend("tilelang")):
            p = plan(problem, profile, backend, num_splits)
            assert p.dependent_combine == (tuned and device and p.needs_combine and isinstance(backend, Able))
            assert not (p.dependent_combine and p.merge_in_split)


@pytest.mark.parametrize("profile_name", ["h200", "h100-pcie"])
def test_auto_gives_tilelang_exactly_the_short_caches_no_plan_splits(monkeypatch, profile_name):
    """``auto``'s first Hopper rule (TileLang for contiguous caches under 32 MiB) asks the planner:
    TileLang runs a call only where neither its plan nor Triton's splits it and Triton's keeps its
    table's pipeline depth, whatever the head dim, row tiles, window or SM count (the H100 PCIe has 114,
    the H200 132); above head dim 128 TileLang takes what Triton's rule does not."""
    from flashdecode.kernels import base

    monkeypatch.setattr(base, "why_not", lambda name, problem, device: None)
    profile = PROFILES["h200"] if profile_name == "h200" else dataclasses.replace(PROFILES["h200"], multiprocessors=114)
    tilelang, triton = get_backend("tilelang"), get_backend("triton")
    shapes = itertools.product([1, 16, 40], [1, 100, 256, 257, 300, 362, 512, 513, 600, 8192], [-1, 100], [(4, 8, 128),
                               (8, 4, 128), (4, 8, 64), (2, 71, 64), (1, 8, 256)])
    for batch, seqlen_cache, window_left, (nheads_k, group, headdim) in shapes:
        problem = Problem(batch, seqlen_cache, nheads_k * group, nheads_k, headdim, "bfloat16", window_left=window_left)
        triton_plan = plan(problem, profile, triton)
        split = SPLIT in (plan(problem, profile, tilelang).kernel, triton_plan.kernel)
        deeper = triton_plan.config.num_stages > triton.default_config(problem, profile, triton_plan.kernel).num_stages
        chosen = base.select("auto", problem, torch.device("cuda", 0), profile).name
        if problem.cache_bytes() < 32 * 2**20:
            assert (chosen == "tilelang") == ((not split and not deeper) or headdim > 128), \
                (batch, seqlen_cache, nheads_k, group)


@pytest.mark.parametrize("device_name, major, merges, dependent", [
    ("NVIDIA H200", 9, 16, True), ("NVIDIA H100 80GB HBM3", 9, 16, True), ("NVIDIA A100-SXM4-80GB", 8, 0, False),
    ("MetaX C500", 8, 0, False)])
def test_the_tuning_comes_from_the_named_profile(monkeypatch, device_name, major, merges, dependent):
    """``hardware.current()`` takes a named profile's tuning (Hopper merges in the split kernel up to
    16 splits); an unknown device the defaults, which never merge."""
    from flashdecode import hardware

    properties = type("Properties", (), dict(name=device_name, major=major, multi_processor_count=108,
                                              shared_memory_per_multiprocessor=164 * 1024, L2_cache_size=40 << 20,
                                              warp_size=32, regs_per_multiprocessor=65536))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    hardware.current.cache_clear()
    try:
        assert hardware.current().tuning.max_splits_merged_in_split == merges
        assert hardware.current().tuning.dependent_combine == dependent
        assert hardware.current().dependent_launch == (major >= 9)
    finally:
        hardware.current.cache_clear()


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, group, headdim, features, kernel, stages", [
    (16, 141, 4, 8, 128, {}, "single_pass", 4),  # case 5: 64 programs of 3 blocks
    (4, 256, 8, 4, 128, {}, "single_pass", 4),  # 32 programs of 4
    (256, 512, 1, 16, 128, {}, "single_pass", 4),  # 256 programs: all resident at 2 an SM
    (8, 1000, 2, 16, 128, {}, "split", 2),  # underfilled: splits of at most 2 blocks
    (16, 2048, 1, 71, 64, {}, "split", 2),  # the same at group 71, head dim 64
    (64, 200, 8, 4, 128, {}, "single_pass", 2),  # 512 programs fill the device
    (64, 64, 8, 4, 128, {}, "single_pass", 2),  # case 4: one block
    (1, 8192, 4, 8, 128, {}, "split", 2),  # case 10: programs of at most 2 blocks
    (16, 100, 4, 8, 128, {}, "single_pass", 2),  # 2 blocks
    (64, 2048, 8, 4, 128, {}, "split", 2),  # case 7: a full grid
    (16, 141, 4, 8, 128, dict(page_size=16), "single_pass", 2),  # not measured: paged
    (16, 141, 4, 8, 128, dict(seqlen_new=1), "single_pass", 2),  # appended tokens
    (16, 141, 4, 8, 256, {}, "single_pass", 3),  # head dim 256 keeps its table's 3
])
def test_triton_pipelines_deeper_where_the_grid_leaves_shared_memory_over(batch, seqlen_cache, nheads_k, group,
                                                                          headdim, features, kernel, stages):
    """Hopper's ``triton_pipelined_stages`` on the shapes it was measured on (docs/iterations.md, entry 29):
    4 stages where the working grid stays resident and programs stream 3+ blocks; the table's
    elsewhere, outside the measured calls, and whenever the caller gives a tile config."""
    from flashdecode.kernels.triton.backend import TritonConfig

    problem = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group, headdim, **features)
    p = plan(problem, PROFILES["h200"], get_backend("triton"))
    assert (p.kernel, p.config.num_stages) == (kernel, stages)
    given = TritonConfig(p.config.block_n, p.config.block_m, 4, 2, 16)
    assert plan(problem, PROFILES["h200"], get_backend("triton"), config=given).config == given
    untuned = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(PROFILES["h200"].tuning,
                                                                               triton_pipelined_stages=0))
    assert plan(problem, untuned, get_backend("triton")).config.num_stages == (3 if headdim == 256 else 2)


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, group, features, stages, untuned_stages", [
    (64, 2048, 8, 4, {}, 3, 2),  # case 7: the tile table's 2
    (1, 58966, 8, 4, {}, 3, 4),  # case 13: pipelined deeper, 1-byte tiles leaving room for 4
    (16, 141, 4, 8, {}, 3, 4),  # a short cache pipelined deeper
    (64, 2048, 8, 4, dict(page_size=16), 2, 2),  # not measured: paged
])
def test_triton_fp8_stages_on_contiguous_caches(batch, seqlen_cache, nheads_k, group, features, stages,
                                                untuned_stages):
    """Hopper's ``triton_fp8_stages`` (docs/iterations.md, entry 41): 3 stages over contiguous fp8
    caches, whatever the tile table or the deeper pipeline would give; paged fp8 caches keep those
    rules, as a profile without it does."""
    problem = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group, 128, cache_dtype="float8_e4m3fn",
                          **features)
    assert plan(problem, PROFILES["h200"], get_backend("triton")).config.num_stages == stages
    untuned = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(PROFILES["h200"].tuning,
                                                                               triton_fp8_stages=0))
    assert plan(problem, untuned, get_backend("triton")).config.num_stages == untuned_stages


@pytest.mark.parametrize("headdim, cache_dtype, words", [
    (128, "float8_e4m3fn", True), (80, "float8_e5m2", True),
    (59, "float8_e4m3fn", False),  # an odd head dim: a word would hold two heads' dims
    (128, None, False)])  # 16-bit caches: nothing to convert
def test_triton_fp8_v_words_on_hopper(headdim, cache_dtype, words):
    """Hopper's ``triton_fp8_v_words`` (docs/iterations.md, entry 47): the kernels read an fp8 cache's V
    as 16-bit words where the head dim is even; a profile without it, and other caches, cast."""
    problem = problem_for([2048] * 8, 2048, 8, 4, headdim, cache_dtype=cache_dtype)
    config = plan(problem, PROFILES["h200"], get_backend("triton")).config
    assert fp8_v_words(config, problem) is words
    untuned = dataclasses.replace(PROFILES["h200"], tuning=Tuning())
    assert fp8_v_words(plan(problem, untuned, get_backend("triton")).config, problem) is False


@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, group, seqlen_q, headdim, features, cap", [
    (1, 58966, 8, 4, 8, 128, {}, 168),  # case 13's drafts of 8 at group 4: 32 rows, one wave at 3 an SM
    (1, 61519, 4, 8, 4, 128, {}, 168),  # case 14's 4 query tokens at group 8: one wave at 3
    (16, 362, 8, 4, 8, 128, {}, 168),  # case 6: past a wave at 3, but programs of 2 blocks
    (64, 2048, 8, 4, 8, 128, {}, 168),  # case 7: 6.85 programs an SM, over two waves at 3
    (8, 32768, 8, 4, 8, 128, {}, 128),  # case 12: 3.45 an SM (one to two waves at 3) of 84-block programs
    (32, 4096, 8, 4, 8, 128, {}, 128),  # case 9: 4.91 an SM of 42-block programs
    (16, 4096, 4, 8, 4, 128, {}, 128),  # case 8 at 4 tokens: 3.48 an SM of 11-block programs
    (32, 300, 8, 4, 8, 128, {}, 128),  # the single-pass kernel: its grid fills one wave at 4
    (1, 58966, 8, 32, 1, 128, {}, 128),  # 32 query heads on one KV head, one token: compiles within 128
    (1, 58966, 8, 4, 4, 128, {}, 128),  # 4 query tokens at group 4: 16 rows
    (1, 58966, 8, 4, 8, 128, {"page_size": 16}, 128),  # pages (not measured)
    (1, 58966, 8, 4, 8, 128, {"cache_dtype": "float8_e4m3fn"}, 128),  # fp8 (not measured)
    (1, 58966, 8, 4, 8, 64, {}, 128),  # head dim 64: 4 an SM, the tables' (W8: slower at 3)
])
def test_triton_register_cap_of_32_row_tiles_over_several_queries(batch, seqlen_cache, nheads_k, group, seqlen_q,
                                                                  headdim, features, cap):
    """On Hopper the split kernel's 32-row tiles over several query tokens, at head dim 128 over a
    contiguous 16-bit cache, spill under the tables' cap (4 programs an SM: 128 registers). They get
    the registers of 3 an SM (168) where the grid's working programs fit one wave at 3, fill two or
    more, or, in a batch, stream at most ``SHORT_PROGRAM_BLOCKS``, and the backend then says 3 are
    resident (iterations 56); a caller's config is kept as given."""
    problem = problem_for([seqlen_cache] * batch, seqlen_cache, nheads_k, group, headdim, seqlen_q=seqlen_q,
                          **features)
    backend = get_backend("triton")
    config = plan(problem, PROFILES["h200"], backend).config
    assert config.max_registers == cap
    assert backend.resident_programs(problem, config, PROFILES["h200"]) == (3 if cap == 168 else 4)
    given = dataclasses.replace(config, max_registers=None)  # a caller's config is kept as given
    assert plan(problem, PROFILES["h200"], backend, config=given).config == given
    untuned = dataclasses.replace(PROFILES["h200"], tuning=dataclasses.replace(
        PROFILES["h200"].tuning, triton_split_32_row_resident_programs=()))
    assert plan(problem, untuned, backend).config.max_registers == 128


@pytest.mark.parametrize("headdim, group, seqlen_q, page_size, cap", [
    (128, 4, 1, 0, 128),  # case 9's tile: 16 rows, 64 keys
    (64, 2, 64, 256, None),  # 64 rows of 128 keys: the cap spilled 1.5 KB a thread, a merged lse came out wrong
    (64, 71, 1, 0, None),  # Falcon-7B's 71 query heads on one KV head: the same tile
])
def test_triton_register_cap_leaves_large_tiles_uncapped(headdim, group, seqlen_q, page_size, cap):
    """No register cap where the fp32 output and score tiles alone fill half of it (iterations 47)."""
    problem = problem_for([256] * 2, 768, 3, group, headdim, seqlen_q=seqlen_q, page_size=page_size,
                          offsets_32=True)
    assert plan(problem, PROFILES["h200"], get_backend("triton")).config.max_registers == cap
