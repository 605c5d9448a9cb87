"""Planner properties on every hardware profile: exact coverage, bounds, fill, and no tail."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from flashdecode.cases import CASES, case_seqlens
from flashdecode.hardware import PROFILES
from flashdecode.planner import Problem, plan, work_list

PROFILE_NAMES = sorted(PROFILES)


def problem_for(lengths, seqlen_cache, nheads_k=8, group=4, headdim=128):
    return Problem(len(lengths), seqlen_cache, nheads_k * group, nheads_k, headdim, "bfloat16")


def assert_covers_exactly_once(p, lengths):
    items = work_list(p, lengths)
    assert len(items) <= p.programs_per_head
    assert [item.program for item in items] == list(range(len(items)))
    for sequence, length in enumerate(lengths):
        mine = [item for item in items if item.sequence == sequence]
        assert mine, "every sequence gets a program (an empty one writes 0 / -inf)"
        assert [item.split for item in mine] == list(range(len(mine)))
        assert all(item.num_splits == len(mine) for item in mine)
        covered = [t for item in mine for t in range(item.token_start, item.token_end)]
        assert covered == list(range(length)), f"sequence {sequence} not covered exactly once"
        # Splits start on block boundaries, so every program but the last reads whole blocks.
        assert all(item.token_start % p.block_n == 0 for item in mine)
        if len(mine) > 1:
            assert all(item.tokens > 0 for item in mine), "a split sequence has no empty split"
    return items


@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_lengths_covered_exactly_once(profile_name, data):
    seqlen_cache = data.draw(st.integers(1, 70000))
    lengths = data.draw(st.lists(st.integers(0, seqlen_cache), min_size=1, max_size=96))
    nheads_k = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_splits = data.draw(st.sampled_from([0, 0, 0, 1, 2, 7]))
    p = plan(problem_for(lengths, seqlen_cache, nheads_k), PROFILES[profile_name], num_splits)
    assert 1 <= p.programs_per_head
    items = assert_covers_exactly_once(p, lengths)
    if num_splits:
        capped = min(num_splits, max(1, math.ceil(seqlen_cache / p.block_n)))  # no split can be empty
        assert p.programs_per_head == len(lengths) * capped
        assert all(item.num_splits <= capped for item in items)


@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c.number}")
def test_matrix_cases_fill_the_machine_without_tail(profile_name, case):
    profile = PROFILES[profile_name]
    lengths = case_seqlens(case.batch, case.seqlen_cache).tolist()
    p = plan(problem_for(lengths, case.seqlen_cache, case.nheads_k, case.group), profile)
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


@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
def test_skewed_batch_has_no_tail(profile_name):
    lengths = [65536] + [480 + 7 * i for i in range(31)]
    profile = PROFILES[profile_name]
    for nheads_k in (4, 8):
        p = plan(problem_for(lengths, 65536, nheads_k), profile)
        items = assert_covers_exactly_once(p, lengths)
        mean = sum(lengths) / len(items)
        assert max(item.tokens for item in items) <= 2 * mean
        assert len(items) * nheads_k >= profile.multiprocessors


@pytest.mark.parametrize("profile_name", PROFILE_NAMES)
def test_shapes_named_by_the_brief(profile_name):
    profile = PROFILES[profile_name]
    long_single = plan(problem_for([60000], 60000, 4), profile)
    assert long_single.can_split and len(work_list(long_single, [60000])) * 4 >= profile.multiprocessors
    big_batch = plan(problem_for([2048] * 64, 2048, 8), profile)
    assert len(work_list(big_batch, [2048] * 64)) <= 4 * 64, "batch 64 x 2k needs few splits or none"
    tiny = plan(problem_for([1], 1, 4), profile)
    assert not tiny.needs_combine and tiny.programs_per_head == 1


def test_plan_is_cached_and_rejects_negative_splits():
    problem = problem_for([10], 10)
    assert plan(problem, PROFILES["h200"]) is plan(problem, PROFILES["h200"])
    with pytest.raises(ValueError, match="num_splits"):
        plan(problem, PROFILES["h200"], -1)


def test_block_n_fits_the_shared_memory_of_each_profile():
    for profile in PROFILES.values():
        for headdim in (64, 128, 256):
            p = plan(Problem(1, 4096, 8, 1, headdim, "float16"), profile)
            assert 2 * 2 * p.block_n * headdim * 2 <= profile.shared_memory_per_multiprocessor // 2
