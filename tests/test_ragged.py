"""Ragged queries (``cu_seqlens_q``, ``max_seqlen_q``; FlashAttention 3's kvcache layout): q, k and
v packed (total_q, heads, headdim), sequence b's rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])``,
bottom-right aligned to its own keys, each appending as many tokens as it has rows; out packed like
q, lse (nheads, total_q). The reference against the padded call, the Triton kernels on every plan
kind against the reference (CPU tensors under Triton's interpreter), the public call on every
backend, the checks of the arguments and their values, bad values on the device, and the route.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import slow_except
from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.hardware import profile_for
from flashdecode.reference import relative_error
from plan_launch import DEVICE, check_plan_against_reference, make_inputs, reference, through_plan

OUT_TOLERANCE, LSE_TOLERANCE = 5e-3, 2e-3
ROWS = (2, 0, 4, 1)  # a sequence without query rows too


def packed_as_padded(q, k_cache, v_cache, kwargs):
    """The padded call whose rows at the end of each sequence are the ragged call's rows (zeros
    before them), without appended tokens: its bottom-right rows sit where the ragged ones do."""
    bounds = kwargs["cu_seqlens_q"].tolist()
    width = kwargs["max_seqlen_q"]
    padded = q.new_zeros(len(bounds) - 1, width, *q.shape[1:])
    for b, (first, last) in enumerate(zip(bounds, bounds[1:])):
        padded[b, width - (last - first):] = q[first:last]
    arguments = {name: value for name, value in kwargs.items() if name not in ("cu_seqlens_q", "max_seqlen_q")}
    return padded, k_cache, v_cache, arguments


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 1))])
def test_reference_rows_are_the_padded_calls_bottom_rows(causal, window):
    inputs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, causal=causal, window=window, sinks=True)
    out, lse, _, _ = reference(*inputs)
    padded_out, padded_lse, _, _ = reference(*packed_as_padded(*inputs))
    assert out.shape == inputs[0].shape and lse.shape == (inputs[0].shape[1], sum(ROWS))
    first = 0
    for b, count in enumerate(ROWS):
        # (a window's other key range sums in another order: equal to rounding)
        assert torch.allclose(out[first:first + count], padded_out[b, 4 - count:], atol=1e-3)
        assert torch.allclose(lse[:, first:first + count], padded_lse[b, :, 4 - count:], atol=1e-5)
        first += count


def test_reference_appends_each_sequences_own_tokens():
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, append=True, causal=True)
    _, _, k_after, v_after = reference(q, k_cache, v_cache, kwargs)
    first = 0
    for b, (count, length) in enumerate(zip(ROWS, kwargs["cache_seqlens"].tolist())):
        assert torch.equal(v_after[b, length:length + count], kwargs["v"][first:first + count])
        assert torch.equal(v_after[b, length + count:], v_cache[b, length + count:])  # nothing past them
        first += count


#: (feature, make_inputs arguments, num_splits, merged in the split kernel): every plan kind with
#: ragged rows non-causal, causal, appending, windowed, paged and with sinks.
TRITON_CASES = [
    ("plain", {}, 1, False),
    ("causal", dict(causal=True), 3, False),
    ("causal, append", dict(causal=True, append=True), 3, True),
    ("causal, append, combine", dict(causal=True, append=True), 2, False),
    ("window, append", dict(window=(6, 0), append=True), 3, False),
    ("paged, append", dict(page_size=16, causal=True, append=True), 0, True),
    ("sinks", dict(causal=True, sinks=True), 3, False),
    ("one row at most", dict(seqlen_q=1, rows=(1, 0, 1, 1)), 3, False),
    # 32 rows over 16-row tiles: a sequence of 2 rows or fewer leaves its second tile without rows
    ("tiles past rows", dict(group=8, causal=True, append=True), 3, True),
]


@pytest.mark.parametrize("feature,arguments,num_splits,merge",
                         slow_except(TRITON_CASES, [TRITON_CASES[0], TRITON_CASES[-1]], several=True),
                         ids=[f"{case[0]}-splits{case[2]}{'-merge' if case[3] else ''}" for case in TRITON_CASES])
def test_triton_kernels_match_the_reference(feature, arguments, num_splits, merge):
    inputs = make_inputs(**{"batch": 4, "seqlen_q": 4, "rows": ROWS, **arguments})
    check_plan_against_reference(inputs, num_splits, merge, OUT_TOLERANCE, LSE_TOLERANCE)


@pytest.mark.parametrize("group,limit,block_m", [(1, 1 << 20, 16), (4, 1 << 20, 16), (8, 1 << 20, 16),
                                                 (32, 1 << 20, 32), (71, 1 << 20, 64), (4, 0, 32), (4, 1024, 32)])
def test_triton_ragged_tiles_follow_the_cache_limit(group, limit, block_m):
    """A ragged call whose cache (80 KiB at group 4) is at most ``ragged_query_tiles_max_cache_bytes``
    takes Triton tiles of one query's rows (16 at least, 64 at most): the tiles past a sequence's own
    rows read no block. Above the limit, or with the rule off (0), tiles of max_seqlen_q's rows."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, group=group, seqlen_q=8, rows=(8, 1, 3, 0))
    context = DecodeContext(DEVICE, tuning=dataclasses.replace(profile_for(torch.device(DEVICE)).tuning,
                                                               ragged_query_tiles_max_cache_bytes=limit))
    assert plan_for(q, k_cache, v_cache, **kwargs, backend="triton", context=context).plan.config.block_m == block_m


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_public_call(backend):
    """Shapes as FlashAttention 3 returns them, and the values of the reference, which ``out``
    receives as well."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, causal=True, append=True)
    caches = k_cache.clone(), v_cache.clone()
    preallocated = torch.empty_like(q)
    out, lse = flash_attn_with_kvcache(q, *caches, **kwargs, return_softmax_lse=True, backend=backend,
                                       out=preallocated)
    ref_out, ref_lse, ref_k, _ = reference(q, k_cache, v_cache, kwargs)
    assert out is preallocated and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert relative_error(out, ref_out) < OUT_TOLERANCE and torch.allclose(lse, ref_lse, atol=LSE_TOLERANCE)
    assert torch.equal(caches[0], ref_k)
    problem = plan_for(q, k_cache, v_cache, **kwargs, backend=backend).problem
    assert problem.ragged and (problem.batch, problem.seqlen_q, problem.seqlen_new) == (4, 4, 4)


def test_a_generous_max_seqlen_q_runs_and_one_past_the_grid_is_refused():
    """FlashAttention 3's callers may pass a generous max_seqlen_q (a batch's token budget): the
    rows past each sequence's own are idle tiles, the result the same; one whose row tiles exceed
    the 65,535 CUDA launches on a grid's z raises ValueError naming it on a backend that launches one
    (before 2026-12-07, 2^20 planned 524,288); the reference, which launches none, takes it."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, "max_seqlen_q": 64}, backend="triton")
    assert relative_error(out, reference(q, k_cache, v_cache, kwargs)[0]) < OUT_TOLERANCE
    with pytest.raises(ValueError, match=r"max_seqlen_q: .* row tiles .* pass a tighter bound"):
        plan_for(q, k_cache, v_cache, **{**kwargs, "max_seqlen_q": 2 ** 20}, backend="triton")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, "max_seqlen_q": 2 ** 20}, backend="reference")
    assert relative_error(out, reference(q, k_cache, v_cache, kwargs)[0]) < 1e-6  # no grid: no limit


@pytest.mark.parametrize("bounds", [(0, 2), (1, 3)])
def test_rows_of_no_sequence_are_left_unwritten(bounds):
    """q rows outside [cu_seqlens_q[0], cu_seqlens_q[-1]) belong to no sequence (padding, as in
    FlashAttention 3): the kernels leave those rows of ``out`` as they were and compute the others."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=1, seqlen_q=2, rows=(2,))
    q = torch.cat([q, q[:1]]) if bounds[0] == 0 else torch.cat([q[:1], q])  # one row of no sequence
    kwargs = dict(kwargs, cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32, device=DEVICE))
    out = torch.full_like(q, 7.0)
    flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, backend="triton", out=out)
    ref_out = reference(q, k_cache, v_cache, kwargs)[0]
    covered = slice(*bounds)
    assert relative_error(out[covered], ref_out[covered]) < OUT_TOLERANCE
    uncovered = 2 if bounds[0] == 0 else 0
    assert torch.all(out[uncovered] == 7.0)


def test_arguments_are_checked():
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, append=True)
    cu = kwargs.pop("cu_seqlens_q")
    kwargs.pop("max_seqlen_q")
    cases = (
        (dict(cu_seqlens_q=cu), ValueError, "max_seqlen_q is required with cu_seqlens_q"),
        (dict(max_seqlen_q=4), ValueError, "max_seqlen_q is only taken with cu_seqlens_q"),
        (dict(cu_seqlens_q=cu.long(), max_seqlen_q=4), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=cu[:1], max_seqlen_q=4), ValueError, r"cu_seqlens_q must have batch \+ 1 >= 2"),
        (dict(cu_seqlens_q=cu, max_seqlen_q=0), ValueError, "max_seqlen_q must be >= 1"),
        (dict(cu_seqlens_q=cu, max_seqlen_q=4.0), TypeError, "max_seqlen_q must be an int"),
        (dict(cu_seqlens_q=cu[:-1], max_seqlen_q=4), ValueError, r"cache_seqlens must have shape \(3,\)"),
    )
    for extra, error, message in cases:
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, **extra)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_q"):
        flash_attn_with_kvcache(q.unsqueeze(0), k_cache, v_cache, **kwargs, cu_seqlens_q=cu, max_seqlen_q=4)
    with pytest.raises(ValueError, match=r"k and v must have shape \(7, 2, 32\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, "k": kwargs["k"][:-1], "v": kwargs["v"][:-1]},
                                cu_seqlens_q=cu, max_seqlen_q=4)


@pytest.mark.parametrize("bounds,message", [
    ([0, 2, 1, 5, 7], "cu_seqlens_q must rise"),  # decreasing
    ([0, 2, 2, 7, 7], "cu_seqlens_q must rise"),  # a step above max_seqlen_q
    ([0, 2, 2, 6, 8], "cu_seqlens_q must rise"),  # past total_q
])
def test_values_of_cu_seqlens_q_are_checked_on_the_host(bounds, message):
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS)
    kwargs["cu_seqlens_q"] = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    if DEVICE == "cpu":  # CPU index tensors are always checked (CUDA ones with value checks on)
        with pytest.raises(ValueError, match=message):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)


def test_cache_seqlens_leave_room_for_each_sequences_own_tokens():
    """A sequence of fewer rows may sit closer to the capacity: checked per sequence."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, capacity=80, seqlen_q=4, rows=ROWS, append=True,
                                              lengths=[78, 80, 76, 79])
    flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, backend="reference")
    kwargs["cache_seqlens"][0] = 79
    with pytest.raises(ValueError, match="cache_seqlens must be in"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_int_cache_seqlens_is_checked_per_sequence_too(backend):
    """An int length is every sequence's: it may leave room for each one's own rows only, not for
    max_seqlen_q (a bucket an engine pads it to), and it is the same call as its tensor."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, capacity=80, seqlen_q=4, rows=ROWS, append=True, causal=True)
    kwargs["max_seqlen_q"] = 6  # capacity - max_seqlen_q = 74: 76 fits every sequence's rows all the same
    results = []
    for lengths in (76, torch.full((4,), 76, dtype=torch.int32, device=DEVICE)):
        caches = k_cache.clone(), v_cache.clone()
        results.append((flash_attn_with_kvcache(q, *caches, **{**kwargs, "cache_seqlens": lengths}, backend=backend),
                        *caches))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    if DEVICE == "cpu":  # 77 leaves sequence 2's 4 rows 3 slots (CUDA values: its rows NaN, unchecked)
        with pytest.raises(ValueError, match=r"cache_seqlens must be in .* got 77 with .*\(sequence 2\)"):
            flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, "cache_seqlens": 77}, backend=backend)


@pytest.mark.parametrize("num_splits,merge",
                         slow_except([(1, False), (3, False), (3, True)], [(1, False)], several=True))
def test_bad_cu_seqlens_q_on_the_device_make_their_sequence_nan(num_splits, merge):
    """A value the host check rejects (a sequence of more rows than max_seqlen_q), swapped in after
    validation: that sequence's rows come out NaN, the others right, nothing read
    or written out of bounds."""
    inputs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, causal=True)
    ref_out, _, _, _ = reference(*inputs)
    bad = torch.tensor([0, 2, 2, 7, 7], dtype=torch.int32, device=DEVICE)  # sequence 2: 5 rows
    out, _, _, _ = through_plan(*inputs, num_splits=num_splits, merge=merge, cu_seqlens_q=bad)
    assert out[2:6].isnan().all()  # its rows, clamped to max_seqlen_q = 4 (as other bad values, out only)
    assert relative_error(out[:2], ref_out[:2]) < OUT_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_gpu_ragged_graph_replays_new_draft_lengths(backend, num_splits):
    """On the GPU: the public call appending drafts of 1-8 tokens against the reference; captured in
    a CUDA graph once, then replayed with other lengths in the same cu_seqlens_q (same total_q), as a
    speculative decoder's verify step is. No host read of cu_seqlens_q: the capture would fail."""
    rows = (1, 8, 3, 5, 2, 8, 1, 4)
    # room for max_seqlen_q appended tokens in every sequence, whatever lengths a replay brings
    lengths = [4096 - 8 - 7 * b for b in range(8)]
    q, k_cache, v_cache, kwargs = make_inputs(batch=8, capacity=4096, nheads_k=8, group=4, headdim=128,
                                              seqlen_q=8, rows=rows, causal=True, append=True, lengths=lengths,
                                              dtype=torch.bfloat16)
    assert plan_for(q, k_cache, v_cache, **kwargs, num_splits=num_splits, backend=backend).backend == "triton"
    expected = reference(q, k_cache, v_cache, kwargs)
    out, lse = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), **kwargs, num_splits=num_splits,
                                       return_softmax_lse=True, backend=backend)
    assert relative_error(out, expected[0]) < 2e-2 and torch.allclose(lse, expected[1], atol=1e-2)
    caches = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = flash_attn_with_kvcache(q, *caches, **kwargs, num_splits=num_splits,
                                                         return_softmax_lse=True, backend=backend)
    for other in ((8, 1, 5, 3, 8, 2, 4, 1), (4, 4, 4, 4, 4, 4, 4, 4)):
        kwargs["cu_seqlens_q"].copy_(torch.tensor([0, *torch.tensor(other).cumsum(0).tolist()], dtype=torch.int32))
        caches[0].copy_(k_cache)
        caches[1].copy_(v_cache)
        graph.replay()
        expected = reference(q, k_cache, v_cache, kwargs)
        assert relative_error(captured, expected[0]) < 2e-2 and torch.allclose(captured_lse, expected[1], atol=1e-2)
        assert torch.equal(caches[1], expected[3])


def test_torch_compile_fullgraph_with_sinks():
    """A ragged call with sinks traces under torch.compile(fullgraph=True) through the custom ops
    (their fake gives out packed like q and lse (nheads, total_q))."""
    q, k_cache, v_cache, kwargs = make_inputs(batch=4, seqlen_q=4, rows=ROWS, causal=True, append=True, sinks=True)
    expected = reference(q, k_cache, v_cache, kwargs)

    def step(q, k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, return_softmax_lse=True, backend="reference")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k_cache, v_cache)
    torch.testing.assert_close(out, expected[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected[1], atol=2e-3, rtol=2e-3)
    assert torch.equal(k_cache, expected[2])
