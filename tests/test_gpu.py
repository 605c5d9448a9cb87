"""GPU tests: every kernel backend against the reference on the 14 cases and on random shapes.

bfloat16 operands with float32 accumulation land between 1e-3 and 1e-2 in relative L2 error against
the float32 reference (FlashAttention-2 shows 1.4e-3 to 2.3e-3 on these inputs); a real bug lands
far above 1e-2.
"""
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashdecode import flash_attn_with_kvcache, flash_decode_with_kvcache, plan_for
from flashdecode.cases import CASES, make_inputs
from flashdecode.reference import reference_attention, reference_decode, relative_error

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-2
LSE_TOLERANCE = 1e-2
KERNEL_BACKENDS = ["triton", "tilelang"]
CASE_ERRORS: dict = {}  # (backend, case) -> rel error, printed by conftest's terminal summary


def backend_or_skip(backend):
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    return backend


def check(backend, q, k, v, seqlens, num_splits=0):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out, lse = flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend=backend,
                                         return_softmax_lse=True, out=out)
    expected_out, expected_lse = reference_decode(q, k, v, seqlens)
    assert not out.isnan().any() and not lse.isnan().any()
    empty = (seqlens == 0).cpu()
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    error = relative_error(out[~empty], expected_out[~empty]) if (~empty).any() else 0.0
    assert error < TOLERANCE
    torch.testing.assert_close(lse[~empty], expected_lse[~empty], atol=LSE_TOLERANCE, rtol=0)
    return error


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c.number}")
def test_case(backend, case):
    backend_or_skip(backend)
    errors = [check(backend, *make_inputs(case, device="cuda", seed=seed)) for seed in (1, 2)]
    CASE_ERRORS[(backend, case.number)] = max(errors)


#: (dtype, head dim, nheads_k, group) of the random-shape test: every dtype, head dim and a spread of
#: groups, a fixed list because each is a compiled TileLang specialisation (~15 s to build on the
#: H200 machine, so benchmarks/prebuild_tilelang_cache.py builds them ahead). Batch, capacity,
#: lengths and splits are runtime values and vary freely.
KERNEL_SHAPES = [
    (torch.float16, 64, 1, 1), (torch.bfloat16, 64, 2, 32), (torch.float16, 128, 4, 5),
    (torch.bfloat16, 128, 8, 16), (torch.bfloat16, 128, 1, 2), (torch.float16, 256, 2, 8),
    (torch.bfloat16, 256, 1, 4),
]
RANDOM_CAPACITIES = [1, 2, 63, 64, 65, 127, 128, 129, 300, 511, 1000, 5000]  # 300, 511: short caches Hopper splits


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_shapes(backend, data):
    backend_or_skip(backend)
    batch = data.draw(st.integers(1, 40))
    seqlen_cache = data.draw(st.sampled_from(RANDOM_CAPACITIES + [70000 // batch]))
    dtype, headdim, nheads_k, group = data.draw(st.sampled_from(KERNEL_SHAPES))
    num_splits = data.draw(st.sampled_from([0, 0, 0, 1, 3, 16]))
    lengths = data.draw(st.lists(
        st.sampled_from([0, 1, seqlen_cache, max(0, seqlen_cache - 1)]) | st.integers(0, seqlen_cache),
        min_size=batch, max_size=batch))
    generator = torch.Generator("cuda").manual_seed(data.draw(st.integers(0, 2**31)))
    q = torch.randn(batch, 1, nheads_k * group, headdim, device="cuda", generator=generator).to(dtype)
    k = torch.randn(batch, seqlen_cache, nheads_k, headdim, device="cuda", generator=generator).to(dtype)
    v = torch.randn(batch, seqlen_cache, nheads_k, headdim, device="cuda", generator=generator).to(dtype)
    check(backend, q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda"), num_splits)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", [CASES[5], CASES[4], CASES[2]], ids=["case6", "case5", "case3"])
def test_out_of_range_lengths_give_nan_rows_on_device(backend, case):
    backend_or_skip(backend)
    # 16 x 362 (TileLang: split kernel, unsplit), 16 x 141 (short-cache kernel, 3 tiles), 16 x 17 (1 tile)
    q, k, v, _ = make_inputs(case, device="cuda")
    seqlens = torch.full((16,), case.seqlen_cache - 3, dtype=torch.int32, device="cuda")
    seqlens[3], seqlens[7] = case.seqlen_cache + 1, -5
    out = flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
    assert out[3].isnan().all() and out[7].isnan().all()
    assert not out[[0, 1, 2, 4, 5, 6]].isnan().any()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_empty_cache(backend):
    backend_or_skip(backend)
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(3, 0, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_decode_with_kvcache(q, k, k, torch.zeros(3, dtype=torch.int32, device="cuda"),
                                         backend=backend, return_softmax_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_queued_split_calls_keep_their_own_partials(backend):
    """Eager split calls reuse a workspace per stream and thread (the default DecodeContext): calls
    queued back to back without a sync, and from four threads sharing the default stream, must each
    get their own result. Whether the threads' launches interleave is up to the scheduler, so the
    per-thread separation itself is tested deterministically in tests/test_api.py."""
    backend_or_skip(backend)
    inputs = [make_inputs(CASES[9], device="cuda", seed=seed) for seed in range(4)]  # case 10: splits
    queued = [flash_decode_with_kvcache(*x, backend=backend) for x in inputs]
    threaded = [None] * len(inputs)

    def call(i):
        threaded[i] = flash_decode_with_kvcache(*inputs[i], backend=backend)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for x, out, out_threaded in zip(inputs, queued, threaded):
        expected, _ = reference_decode(*x)
        assert relative_error(out, expected) < TOLERANCE
        assert relative_error(out_threaded, expected) < TOLERANCE


def test_auto_backend_is_a_kernel_on_cuda():
    q, k, v, seqlens = make_inputs(CASES[0], device="cuda")
    assert plan_for(q, k, v, cache_seqlens=seqlens).backend in KERNEL_BACKENDS


def _paged_copy(k_cache, v_cache, page_size, generator):
    """The caches as shuffled pages of ``page_size`` tokens and their block table."""
    batch, seqlen, heads, dim = k_cache.shape
    blocks = seqlen // page_size
    order = torch.randperm(batch * blocks, generator=generator, device="cpu").to(k_cache.device)
    table = order.view(batch, blocks).to(torch.int32)
    k_pages = torch.empty(batch * blocks, page_size, heads, dim, dtype=k_cache.dtype, device=k_cache.device)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k_cache.reshape(batch * blocks, page_size, heads, dim)
    v_pages[order] = v_cache.reshape(batch * blocks, page_size, heads, dim)
    return k_pages, v_pages, table


def test_dependent_combine_replays_from_a_graph_with_new_lengths():
    """Triton's split plan with a dependent combine (one sequence, 100 splits a head on Hopper),
    captured once and replayed with lengths that split it (the combine waits for the partials) and
    lengths that do not (its programs only wait), then called eagerly back to back."""
    backend_or_skip("triton")
    q, k, v, _ = make_inputs(CASES[9], device="cuda")  # case 10: b1 s8192 hk4 g8
    lengths = torch.tensor([8192], dtype=torch.int32, device="cuda")
    route = plan_for(q, k, v, cache_seqlens=lengths, backend="triton")
    if not route.plan.dependent_combine:
        pytest.skip(f"no dependent combine planned on this device: {route.plan}")

    def call():
        return flash_decode_with_kvcache(q, k, v, lengths, backend="triton")

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for length in (8192, 1, 65, 5000, 513, 8191):
        lengths.fill_(length)
        q.normal_()
        expected = reference_decode(q, k, v, lengths)[0]
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, expected) < TOLERANCE, f"replay at length {length}"
        eager = [call() for _ in range(3)]  # queued back to back: each combine after its own split kernel
        assert all(relative_error(result, expected) < TOLERANCE for result in eager), f"eager at length {length}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_graph_replays_with_new_lengths_block_tables_and_tokens(backend):
    """One capture, several replays: new lengths, a new block table and new appended tokens are read
    on the device at each replay (nothing about them is baked into the graph)."""
    backend_or_skip(backend)
    generator = torch.Generator("cpu").manual_seed(0)
    batch, seqlen, heads_k, group, dim, page = 4, 1024, 2, 4, 128, 16
    q = torch.randn(batch, 1, heads_k * group, dim, device="cuda", dtype=torch.bfloat16)
    k_full = torch.randn(batch, seqlen, heads_k, dim, device="cuda", dtype=torch.bfloat16)
    v_full = torch.randn_like(k_full)
    k_pages, v_pages, table = _paged_copy(k_full, v_full, page, generator)
    lengths = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    k_new = torch.randn(batch, 1, heads_k, dim, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)

    def call():
        return flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                       backend=backend)

    call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(3):
        lengths.copy_(torch.randint(0, seqlen - 1, (batch,), generator=generator).to(torch.int32))
        k_new.normal_()
        v_new.normal_()
        q.normal_()
        new_pages, new_v_pages, new_table = _paged_copy(k_full, v_full, page, generator)
        k_pages.copy_(new_pages)
        v_pages.copy_(new_v_pages)
        table.copy_(new_table)
        expected_k, expected_v = k_pages.clone(), v_pages.clone()
        expected = reference_attention(q, expected_k, expected_v, k_new, v_new, cache_seqlens=lengths,
                                       block_table=table)[0]
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, expected) < TOLERANCE, f"replay {step}"
        assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v), f"replay {step}: cache"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_calls_on_several_streams_at_once(backend):
    """Each stream has its own default context (workspace): split calls queued on four streams at once."""
    backend_or_skip(backend)
    inputs = [make_inputs(CASES[9], device="cuda", seed=seed) for seed in range(4)]  # case 10: splits
    streams = [torch.cuda.Stream() for _ in inputs]
    outs = []
    torch.cuda.synchronize()
    for stream, x in zip(streams, inputs):
        with torch.cuda.stream(stream):
            outs.append(flash_decode_with_kvcache(*x, backend=backend))
    torch.cuda.synchronize()
    for x, out in zip(inputs, outs):
        assert relative_error(out, reference_decode(*x)[0]) < TOLERANCE


def merging_context():
    """A context whose Triton split plans all merge in the split kernel, whatever their splits."""
    import dataclasses

    from flashdecode import DecodeContext
    from flashdecode.hardware import current

    return DecodeContext("cuda", tuning=dataclasses.replace(current().tuning, max_splits_merged_in_split=10_000,
                                                            max_rows_merged_in_split=None,
                                                            underfilled_merge_caps=None))


@pytest.mark.parametrize("case", [CASES[6], CASES[7], CASES[9], CASES[11], CASES[13]],
                         ids=lambda c: f"case{c.number}")
def test_split_kernel_merging_its_partials(case):
    """Triton's split kernel with the merge in it (``Plan.merge_in_split``): eager calls on the
    context's counters (back at zero after every launch, or the second would not merge), then two
    graphs replayed in turn with new lengths (random, then 0, 1, a block's edges and the capacity's):
    each captured call takes counters of its own from the zeroed ``CAPTURED_COUNTERS`` (no memset
    in its graph), which every replay leaves at zero."""
    from flashdecode.workspace import CAPTURED_COUNTERS

    context = merging_context()
    q, k, v, seqlens = make_inputs(case, device="cuda", seed=1)

    def call():
        return flash_decode_with_kvcache(q, k, v, seqlens, backend="triton", context=context)

    route = plan_for(q, k, v, cache_seqlens=seqlens, backend="triton", context=context)
    assert route.plan.merge_in_split
    for _ in range(2):
        assert relative_error(call(), reference_decode(q, k, v, seqlens)[0]) < TOLERANCE
    handed_out = CAPTURED_COUNTERS.handed_out(q.device)
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph in graphs:
        with torch.cuda.graph(graph):
            outs.append(call())
    assert CAPTURED_COUNTERS.handed_out(q.device) == handed_out + 2 * route.plan.ticket_count(route.problem)
    generator = torch.Generator("cpu").manual_seed(3)
    block = route.plan.block_n
    edges = [0, 1, block - 1, block + 1, case.seqlen_cache - 1, case.seqlen_cache]
    for step in range(2 + len(edges)):
        if step < 2:
            seqlens.copy_(torch.randint(0, case.seqlen_cache + 1, (case.batch,), generator=generator).to(torch.int32))
        else:  # one edge for every sequence, the edges in turn
            seqlens.copy_(torch.tensor([edges[(step + b) % len(edges)] for b in range(case.batch)]))
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        expected = reference_decode(q, k, v, seqlens)[0]
        for out in outs:  # all sequences empty (one of length 0): zeros, where a relative error is undefined
            assert (not out.any() if not expected.any() else relative_error(out, expected) < TOLERANCE), \
                f"replay {step}, lengths {seqlens.tolist()[:8]}"
    assert relative_error(call(), reference_decode(q, k, v, seqlens)[0]) < TOLERANCE  # eager after the graph


@pytest.mark.parametrize("batch, forced_splits", [(1, 16), (8, 16), (64, 3), (64, 64)])
def test_merge_in_split_is_deterministic_over_many_calls(batch, forced_splits):
    """The merge takes a sequence's partials in split order, so every call gives the same bits:
    500 back-to-back calls (no sync between them) of a plan that merges, each equal to the first.
    A merger that read a partial before its program stored it, or counters left over, would not.
    64 sequences in 64 splits: 32768 programs, many waves, each tile's merger 64 partials."""
    context = merging_context()
    generator = torch.Generator("cuda").manual_seed(batch)
    q = torch.randn(batch, 1, 32, 128, device="cuda", generator=generator).bfloat16()
    k, v = (torch.randn(batch, 4096, 8, 128, device="cuda", generator=generator).bfloat16() for _ in range(2))
    seqlens = torch.randint(1, 4097, (batch,), device="cuda", generator=generator, dtype=torch.int32)
    route = plan_for(q, k, v, cache_seqlens=seqlens, num_splits=forced_splits, backend="triton", context=context)
    assert route.plan.merge_in_split

    def call():
        return flash_decode_with_kvcache(q, k, v, seqlens, num_splits=forced_splits, backend="triton", context=context)

    first = call().clone()
    outs = [call().clone() for _ in range(500)]
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    assert relative_error(first, reference_decode(q, k, v, seqlens)[0]) < TOLERANCE


@pytest.mark.parametrize("capacity, headdim, extra_rows, append", [
    (1, 128, 0, False), (17, 128, 3, False), (64, 64, 0, False), (65, 128, 0, True), (300, 59, 2, False),
    (129, 160, 0, False), (0, 128, 0, False)])
def test_the_first_block_prefetch_changes_no_bit(capacity, headdim, extra_rows, append):
    """``TritonConfig.prefetch_first_block`` is a hint to L2 only: single-pass calls (lengths 0, 1, the
    capacity and random; caches with more rows than sequences; an appended token; head dims whose
    padding holds lines past the row, 160 of 256; an empty cache) give exactly the bits they give
    without it, and the appended token lands in the cache alike."""
    import dataclasses

    from flashdecode import DecodeContext
    from flashdecode.kernels.triton.backend import prefetch_points

    generator = torch.Generator("cuda").manual_seed(capacity)
    batch = 6
    q = torch.randn(batch, 1, 8, headdim, device="cuda", generator=generator).half()
    k_cache, v_cache = (torch.randn(batch + extra_rows, capacity + append, 2, headdim, device="cuda",
                                    generator=generator).half() for _ in range(2))
    new = dict(k=torch.randn(batch, 1, 2, headdim, device="cuda", generator=generator).half(),
               v=torch.randn(batch, 1, 2, headdim, device="cuda", generator=generator).half()) if append else {}
    seqlens = torch.randint(0, capacity + 1, (batch,), device="cuda", generator=generator, dtype=torch.int32)
    seqlens[:3] = torch.tensor([0, min(1, capacity), capacity])
    default = plan_for(q, k_cache, v_cache, cache_seqlens=seqlens, backend="triton", **new).plan
    assert not default.can_split
    results = []
    for prefetch in (False, True):
        context = DecodeContext("cuda", config=dataclasses.replace(default.config, prefetch_first_block=prefetch))
        route = plan_for(q, k_cache, v_cache, cache_seqlens=seqlens, backend="triton", context=context, **new)
        assert (prefetch_points(route.plan.config, route.plan, route.problem) > 0) == prefetch
        caches = (k_cache.clone(), v_cache.clone())
        out, lse = flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, backend="triton", context=context,
                                           return_softmax_lse=True, **new)
        results.append((out, lse, *caches))
    torch.cuda.synchronize()
    assert all(torch.equal(without, with_prefetch) for without, with_prefetch in zip(*results))
    keyed = seqlens > 0 if not append else torch.ones_like(seqlens, dtype=torch.bool)
    if keyed.any():
        expected = reference_attention(q, k_cache, v_cache, cache_seqlens=seqlens, **new)[0]
        assert relative_error(results[1][0][keyed], expected[keyed]) < TOLERANCE
