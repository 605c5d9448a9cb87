"""The compiled host path on the GPU (``flashdecode.host_path``): repeat calls of a metadata are
launched from C++ and give the reference's result, for every kernel TileLang and Triton plan and
every input the record patches (q, caches, pages, appended k/v, lengths, out, lse, fp8 descales,
sinks, ragged queries), each repeat with values of its own."""
import pytest
import torch

import fa_grid

from flashdecode import DecodeContext, flash_attn_with_kvcache
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call
from flashdecode.reference import reference_attention, relative_error

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-2
CALLS = 3  # the first records, the others take the host path


@pytest.fixture(autouse=True)
def needs_the_host_path():
    from flashdecode import host_path

    reason = host_path.unavailable()
    if reason is not None:
        pytest.skip(f"host path unavailable: {reason}")


@pytest.mark.parametrize("number, variant, extras", [
    (3, "plain", {}),  # short-cache kernel
    (10, "plain", {}),  # split + combine
    (6, "plain", {"return_softmax_lse": True}),
    (6, "plain", {"out": True}),
    (5, "paged64", {}),
    (7, "paged16", {}),
    (6, "append", {}),
    (4, "q4", {"return_softmax_lse": True}),
    (10, "plain", {"cache_seqlens": 5000}),  # an int: the record holds the lengths tensor
    (6, "fp8", {}),  # descales (nheads_k,): expanded views of the call's tensors
    (10, "fp8", {"return_softmax_lse": True}),
    (6, "sinks", {"return_softmax_lse": True}),
    (10, "sinks", {}),
], ids=str)
@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_repeat_calls_take_the_host_path(number, variant, extras, backend):
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    context = DecodeContext()
    for seed in range(CALLS):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS[variant], "cuda", seed=seed + 1)
        arguments = call.kwargs()
        if "cache_seqlens" in extras:
            arguments["cache_seqlens"] = extras["cache_seqlens"]
        expected_out, expected_lse = reference_attention(
            call.q, call.k_cache.clone(), call.v_cache.clone(), **arguments)
        out = torch.full_like(call.q, float("nan")) if extras.get("out") else None
        result = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **arguments, backend=backend,
                                         out=out, return_softmax_lse=extras.get("return_softmax_lse", False),
                                         context=context)
        got = result[0] if isinstance(result, tuple) else result
        assert out is None or got is out
        assert relative_error(got, expected_out) < TOLERANCE, f"call {seed}"
        if isinstance(result, tuple):
            torch.testing.assert_close(result[1], expected_lse, atol=1e-2, rtol=0)
        if call.k is not None:  # the appended token landed in the cache
            assert relative_error(call.k_cache, reference_attention_cache(call)) == 0
    assert context.host_path is not None and context.host_path.off_because is None
    assert context.host_path.hits == CALLS - 1


@pytest.mark.parametrize("number, extras", [
    (3, {}), (10, {}), (6, {"return_softmax_lse": True}), (6, {"out": True})], ids=str)
@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_plain_calls_go_from_the_api_to_the_record(number, extras, backend, monkeypatch):
    """The plain call (no context) goes from ``flash_attn_with_kvcache`` straight to its default
    context's record, and gives the reference's result there; with value checks on it takes the
    Python path."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    from flashdecode import context as context_module
    from flashdecode import set_value_checks

    monkeypatch.setattr(context_module._defaults, "table", {})  # this test's default context only
    call = make_call(CASES_BY_NUMBER[number], VARIANTS["plain"], "cuda")
    expected_out, expected_lse = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())

    def plain_call():
        out = torch.full_like(call.q, float("nan")) if extras.get("out") else None
        result = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend=backend,
                                         out=out, return_softmax_lse=extras.get("return_softmax_lse", False))
        got = result[0] if isinstance(result, tuple) else result
        assert out is None or got is out
        assert relative_error(got, expected_out) < TOLERANCE
        if isinstance(result, tuple):
            torch.testing.assert_close(result[1], expected_lse, atol=1e-2, rtol=0)

    for _ in range(CALLS):
        plain_call()
    host = _host_of(None, torch.cuda.current_stream())
    assert host.hits == CALLS - 1
    set_value_checks(True)
    try:
        plain_call()
    finally:
        set_value_checks(False)
    assert host.hits == CALLS - 1


@pytest.mark.parametrize("number", [6, 10])
def test_ragged_repeats_take_the_host_path(number):
    """Ragged verify steps on Triton (TileLang takes no ragged queries): repeats of one draft layout
    (so one total_q) with fresh q, k and v and a fresh cu_seqlens_q hit the record, writing out
    and the ragged lse (nheads, total_q) as the reference does."""
    context = DecodeContext()
    generator = torch.Generator(device="cuda").manual_seed(number)
    for index in range(CALLS):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS["ragged"], "cuda")
        for tensor in (call.q, call.k, call.v):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda"))
        expected_out, expected_lse = reference_attention(call.q, call.k_cache.clone(), call.v_cache.clone(),
                                                         **call.kwargs())
        out, lse = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend="triton",
                                           return_softmax_lse=True, context=context)
        assert relative_error(out, expected_out) < TOLERANCE, f"call {index}"
        assert lse.shape == expected_lse.shape
        torch.testing.assert_close(lse, expected_lse, atol=1e-2, rtol=0)
    assert context.host_path is not None and context.host_path.off_because is None
    assert context.host_path.hits == CALLS - 1


@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_new_descale_and_sink_values_reach_a_hit(backend):
    """The same fp8 call with sinks, repeated with other descale and sink values in new tensors and
    then in the first call's tensors written in place: each hit gives exactly what the Python path
    gives for those values (a fresh context's first call). A record made with one tensor for both
    descales hits calls that pass one tensor for both; a call that passes two makes its own."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    call = make_call(CASES_BY_NUMBER[6], VARIANTS["fp8"], "cuda")
    sinks = torch.randn(CASES_BY_NUMBER[6].nheads, device="cuda")

    def both(context, k_descale, v_descale, sinks):
        arguments = dict(call.kwargs(), k_descale=k_descale, v_descale=v_descale, sinks=sinks)
        hit = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **arguments, backend=backend,
                                      context=context)
        python = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **arguments, backend=backend,
                                         context=DecodeContext())
        assert torch.equal(hit, python)
        return hit

    context = DecodeContext()
    first = both(context, call.k_descale, call.v_descale, sinks)
    second = both(context, call.k_descale * 0.5, call.v_descale * 2.0, sinks - 1.0)
    assert context.host_path.hits == 1 and not torch.equal(second, first)
    call.k_descale.mul_(0.5)
    call.v_descale.mul_(2.0)
    sinks.sub_(1.0)
    assert torch.equal(both(context, call.k_descale, call.v_descale, sinks), second)
    assert context.host_path.hits == 2

    aliased = DecodeContext()
    other = call.v_descale * 3.0
    for k_descale, v_descale in ((call.k_descale, call.k_descale), (call.v_descale, call.v_descale),
                                 (call.v_descale, other), (other, other)):
        both(aliased, k_descale, v_descale, sinks)
    assert aliased.host_path.hits == 2  # the second on the first's record, the fourth on the third's


def reference_attention_cache(call):
    """The caches after ``call``'s append, by the reference (on copies)."""
    k_cache = call.k_cache.clone()
    reference_attention(call.q, k_cache, call.v_cache.clone(), **call.kwargs())
    return k_cache


@pytest.mark.parametrize("layout", ["contiguous", "heads-outer"])
@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_a_hit_allocates_out_and_lse_as_the_python_path_does(layout, backend):
    """A hit's out and lse are fresh tensors with the Python path's device, dtype and strides: the
    extension's own allocation where q is contiguous, ``at::empty_like`` where q's strides are not its
    shape's contiguous ones ("heads-outer": the seqlen_q stride of a (B, H, 1, D) tensor viewed as
    (B, 1, H, D))."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    call = make_call(CASES_BY_NUMBER[6], VARIANTS["plain"], "cuda")
    q = call.q if layout == "contiguous" else call.q.transpose(1, 2).contiguous().transpose(1, 2)
    context = DecodeContext()
    results = [flash_attn_with_kvcache(q, call.k_cache, call.v_cache, **call.kwargs(), return_softmax_lse=True,
                                       backend=backend, context=context) for _ in range(CALLS)]
    assert context.host_path.hits == CALLS - 1
    first_out, first_lse = results[0]
    assert first_out.stride() == torch.empty_like(q).stride()
    for out, lse in results[1:]:
        assert (out.device, out.dtype, out.stride()) == (q.device, q.dtype, first_out.stride())
        assert (lse.device, lse.dtype, lse.stride()) == (first_lse.device, torch.float32, first_lse.stride())
        torch.testing.assert_close(out, first_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, first_lse, rtol=0, atol=0)
    assert len({tensor.data_ptr() for pair in results for tensor in pair}) == 2 * CALLS  # none shared


def test_graph_capture_stays_on_the_python_path():
    pytest.importorskip("tilelang")
    call = make_call(CASES_BY_NUMBER[6], VARIANTS["plain"], "cuda")
    graph_context = DecodeContext()
    flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend="tilelang",
                            context=graph_context)  # warm up outside capture (records, compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend="tilelang",
                                           context=graph_context)
    graph.replay()
    torch.cuda.synchronize()
    assert graph_context.host_path.hits == 0
    expected, _ = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())
    assert relative_error(captured, expected) < TOLERANCE


@pytest.mark.parametrize("explicit_context", [True, False], ids=["context", "default-context"])
@pytest.mark.parametrize("backend", ["tilelang", "triton"])
def test_a_capture_on_the_stream_of_the_records_is_not_launched_from_them(backend, explicit_context, monkeypatch):
    """Calls recorded eagerly on a stream, then captured on that same stream: the extension asks the
    driver whether the stream captures and misses, so no launch is taken from a record under the
    capture (the graph gets buffers of its own from the Python path); a replay with new q values
    gives their result."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    from flashdecode import context as context_module

    # default contexts of this test only: a pool stream's handle may name an earlier test's context
    monkeypatch.setattr(context_module._defaults, "table", {})
    call = make_call(CASES_BY_NUMBER[8], VARIANTS["plain"], "cuda")  # a merging split plan (counters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        context = DecodeContext() if explicit_context else None
        for _ in range(CALLS):  # records, then hits
            flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend=backend,
                                    context=context)
    torch.cuda.synchronize()
    hits = _host_of(context, stream).hits
    assert hits == CALLS - 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend=backend,
                                           context=context)
    assert _host_of(context, stream).hits == hits
    call.q.copy_(torch.randn_like(call.q))
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())
    assert relative_error(captured, expected) < TOLERANCE


def _host_of(context, stream):
    """The HostPath of ``context``, or of the plain call's context on ``stream``."""
    if context is None:
        from flashdecode.context import default_context

        with torch.cuda.stream(stream):
            context = default_context(torch.empty(0, device="cuda"))
    return context.host_path


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("FLASHDECODE_HOST_PATH", "0")
    context = DecodeContext()
    call = make_call(CASES_BY_NUMBER[3], VARIANTS["plain"], "cuda")
    flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), backend="triton", context=context)
    assert context.host_path is None


#: FlashAttention-grid combos with the features only Triton takes (rotary on appended tokens, ALiBi,
#: cache_leftpad, cache_batch_idx), local windows and pages of 256.
TRITON_FEATURE_COMBOS = fa_grid.sample(6, seed=11, restrict={
    "new_kv": (True,), "alibi": (True,), "rotary_fraction": (0.5, 1.0), "has_leftpad": (True, False),
    "has_batch_idx": (True, False), "d": (64, 128), "seqlens": ((1, 339), (3, 799), (16, 20000))})


@pytest.mark.parametrize("combo", TRITON_FEATURE_COMBOS, ids=lambda combo: combo.id)
def test_triton_features_take_the_host_path(combo):
    """Every tensor a Triton-only feature passes (rotary tables, slopes, left pads, batch indices)
    is patched into the record: repeats match FlashAttention's rule like the first call."""
    context = DecodeContext()

    def call(**arguments):
        return flash_attn_with_kvcache(**arguments, backend="triton", context=context)

    for _ in range(CALLS):
        fa_grid.check_combo(combo, "cuda", call)
    assert context.host_path is not None and context.host_path.off_because is None
    assert context.host_path.hits == CALLS - 1
