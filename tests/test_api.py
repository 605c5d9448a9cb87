"""The public API on the CPU: FlashAttention's signature and positional order, the project's own
name, routes, contexts, backend errors, and torch.compile through the custom ops."""
import dataclasses
import inspect
import re
import threading

import pytest
import torch

import flashdecode
from conftest import last_dim_strided
from flashdecode import DecodeContext, flash_attn_with_kvcache, flash_decode_with_kvcache, plan_for
from flashdecode.reference import reference_attention

#: FlashAttention 2.8's flash_attn_with_kvcache: parameter names and defaults, in order.
FA_SIGNATURE = [("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("rotary_cos", None),
                ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
                ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
                ("return_softmax_lse", False)]


def inputs(batch=2, seqlen=32, nheads=8, nheads_k=2, headdim=64, seqlen_q=1, dtype=torch.float16, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return (randn(batch, seqlen_q, nheads, headdim), randn(batch, seqlen, nheads_k, headdim),
            randn(batch, seqlen, nheads_k, headdim),
            torch.randint(1, seqlen + 1, (batch,), generator=generator, dtype=torch.int32))


def test_signature_is_flash_attentions():
    parameters = list(inspect.signature(flash_attn_with_kvcache).parameters.values())
    positional = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                  for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FA_SIGNATURE
    extras = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert extras == ["backend", "out", "k_descale", "v_descale", "sinks", "cu_seqlens_q", "max_seqlen_q", "context"]


def test_flash_attention_code_runs_unchanged():
    """Positional arguments in FlashAttention's order, and its keywords, give the reference's answer."""
    q, k_cache, v_cache, lengths = inputs(seqlen_q=3)
    expected, expected_lse = reference_attention(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, None, None, None, None, lengths, None, None, None, None,
                                       True, (-1, -1), 0.0, True, None, 0, True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    assert lse.shape == (2, 8, 3)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    torch.testing.assert_close(out, expected)


def test_project_name_keeps_its_positional_lengths():
    q, k_cache, v_cache, lengths = inputs()
    torch.testing.assert_close(flash_decode_with_kvcache(q, k_cache, v_cache, lengths),
                               flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths))
    out, lse = flash_decode_with_kvcache(q, k_cache, v_cache, lengths, return_softmax_lse=True)
    assert lse.shape == (2, 8, 1) and lse.dtype == torch.float32


def test_appended_tokens_land_in_the_cache_in_place():
    q, k_cache, v_cache, lengths = inputs()
    lengths = lengths.clamp(max=30)
    k_new, v_new = torch.randn(2, 2, 2, 64).half(), torch.randn(2, 2, 2, 64).half()
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    expected = reference_attention(q, k_copy, v_copy, k_new, v_new, cache_seqlens=lengths)[0]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)
    torch.testing.assert_close(out, expected)
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
    for b, length in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[b, length:length + 2], k_new[b])


def test_plan_for_names_the_route():
    q, k_cache, v_cache, lengths = inputs()
    route = plan_for(q, k_cache, v_cache, cache_seqlens=lengths)
    assert route.backend == "reference"  # CPU tensors
    assert route.problem.batch == 2 and route.problem.group == 4
    assert route.plan.programs_per_head >= 1
    assert plan_for(q, k_cache, v_cache, cache_seqlens=lengths, backend="triton").backend == "triton"


@pytest.mark.parametrize("num_splits", [0, 3])
def test_the_reference_is_planned_as_one_pass_and_holds_no_partials(num_splits):
    """The reference has no split kernel: plan_for says one program a sequence, whatever num_splits
    asks, so the context sizes no partials for it (a long cache once planned 113 splits a head)."""
    q, k_cache, v_cache = (torch.randn(shape).half() for shape in ((2, 1, 8, 64), (2, 4096, 2, 64), (2, 4096, 2, 64)))
    lengths = torch.tensor([4096, 3000], dtype=torch.int32)
    route = plan_for(q, k_cache, v_cache, cache_seqlens=lengths, backend="reference", num_splits=num_splits)
    assert route.plan.kernel == "single_pass" and route.plan.programs_per_head == 2
    assert route.plan.workspace_rows == 0
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=num_splits)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, cache_seqlens=lengths)[0])


def test_naming_a_backend_that_cannot_take_the_call_says_which_can():
    q, k_cache, v_cache, lengths = inputs()
    with pytest.raises(flashdecode.BackendError, match="backend 'tilelang' cannot take this call: it needs .*"
                                                       "backend '(triton|reference)' can"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend="tilelang")


def test_an_explicit_context_owns_its_workspace():
    q, k_cache, v_cache, lengths = inputs()
    context = DecodeContext()
    first = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, context=context)
    torch.testing.assert_close(first, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths))
    assert context.device == torch.device("cpu")
    with pytest.raises(ValueError, match="context is bound to cpu"):
        flash_attn_with_kvcache(q.to("meta"), k_cache.to("meta"), v_cache.to("meta"),
                                cache_seqlens=lengths.to("meta"), context=context)


def test_a_context_says_why_its_calls_take_the_python_path():
    q, k_cache, v_cache, lengths = inputs()
    context = DecodeContext()
    assert context.host_path_off_because is None  # no call yet
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, context=context)
    assert context.host_path is None and context.host_path_off_because == "cpu is not a CUDA device"


def test_each_thread_has_its_own_default_context():
    from flashdecode.context import default_context

    mine = default_context(torch.zeros(1))
    assert default_context(torch.zeros(1)) is mine
    other = []
    worker = threading.Thread(target=lambda: other.append(default_context(torch.zeros(1))))
    worker.start()
    worker.join()
    assert other[0] is not mine


def test_captured_calls_take_counters_no_other_call_uses():
    """``CapturedCounters``: zeroed outside capture (never as an inference tensor), then disjoint runs
    of it for captured calls; an eager call starts a new buffer once a quarter is left, a capture that
    finds too few gets fresh zeroed counters (warned once); ``reset`` zeroes every buffer."""
    from flashdecode.workspace import CapturedCounters

    counters = CapturedCounters(8)
    device = torch.device("cpu")
    with pytest.warns(UserWarning, match="used up"):
        assert not counters.take(device, 2).any()  # before the buffer is made: fresh zeros
    with torch.inference_mode():
        counters.prepare(device)
    first, second = counters.take(device, 3), counters.take(device, 4)
    assert counters.handed_out(device) == 7 and not first.any() and not second.any()
    assert not first.is_inference()
    first.fill_(7)
    assert not second.any()  # disjoint
    assert not counters.take(device, 3).any() and counters.handed_out(device) == 7  # too few left: fresh
    counters.prepare(device)  # 7 of 8 handed out: a new buffer; the old one stays the graphs'
    third = counters.take(device, 8)
    assert counters.handed_out(device) == 8 and not third.any() and (first == 7).all()
    third.fill_(1)
    counters.reset(device)
    assert not first.any() and not third.any()


def test_lse_sink_and_workspace_are_reused_within_a_context():
    context = DecodeContext("cpu")
    route = plan_for(*inputs()[:3], cache_seqlens=16, num_splits=3, backend="triton", context=context)
    part_o, part_lse = context.workspace.partials(route.plan, route.problem, torch.device("cpu"))
    again = context.workspace.partials(route.plan, route.problem, torch.device("cpu"))
    assert again[0].data_ptr() == part_o.data_ptr() and part_lse.shape == (route.plan.workspace_rows, 8)
    sink = context.workspace.lse(route.problem, torch.device("cpu"), wanted=False)
    assert context.workspace.lse(route.problem, torch.device("cpu"), wanted=False).data_ptr() == sink.data_ptr()
    assert context.workspace.lse(route.problem, torch.device("cpu"), wanted=True).data_ptr() != sink.data_ptr()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_torch_compile_fullgraph(backend):
    """The call traces under torch.compile(fullgraph=True) through the custom ops and their fakes,
    with and without appended tokens (the append op mutates the caches)."""
    q, k_cache, v_cache, lengths = inputs(seqlen=16)
    lengths = lengths.clamp(max=15)
    k_new, v_new = torch.randn(2, 1, 2, 64).half(), torch.randn(2, 1, 2, 64).half()

    def step(q, k_cache, v_cache, lengths, k_new, v_new):
        plain = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend=backend)
        appended, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                return_softmax_lse=True, backend=backend)
        return plain, appended, lse

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = step(q, expected_k, expected_v, lengths, k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k_cache, v_cache, lengths, k_new, v_new)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_context_checks_its_tuning_and_config():
    """DecodeContext's tuning and tile config are checked when it is made, naming the field: a
    negative block_n ran, wrong (error 1.09), and 0 divided by zero, before 2026-12-07; so did a
    Tuning with min_blocks_per_split=0."""
    from flashdecode.hardware import Tuning
    from flashdecode.kernels.triton.backend import TritonConfig

    good = TritonConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, combine_step=4)
    DecodeContext("cpu", tuning=Tuning(), config=good)
    for bad, kind, message in ((dict(block_n=-16), ValueError, "config.block_n must be a power of two >= 16, got -16"),
                               (dict(block_m=3), ValueError, "config.block_m must be a power of two >= 16"),
                               (dict(num_warps=3), ValueError, "config.num_warps must be a power of two"),
                               (dict(num_stages=0), ValueError, "config.num_stages must be >= 1, got 0"),
                               (dict(block_n=16.0), TypeError, "config.block_n must be an int, got 16.0")):
        with pytest.raises(kind, match=message):
            DecodeContext("cpu", config=dataclasses.replace(good, **bad))
    with pytest.raises(TypeError, match="config must be a backend's tile config .* got int"):
        DecodeContext("cpu", config=5)
    for bad, kind, message in (
            (dict(min_blocks_per_split=0), ValueError, "tuning.min_blocks_per_split must be >= 1, got 0"),
            (dict(min_blocks_per_split=False), TypeError, "tuning.min_blocks_per_split must be an int, got False"),
            (dict(programs_per_multiprocessor=2 ** 24), ValueError,
             "tuning.programs_per_multiprocessor must be in [1, 64]"),
            (dict(split_above_blocks=-1), ValueError, "tuning.split_above_blocks must be >= 0"),
            (dict(min_blocks_per_combined_split=(("triton", 0),)), ValueError,
             "tuning.min_blocks_per_combined_split must be >= 1, got 0"),
            (dict(min_blocks_per_combined_split=("triton", 2)), TypeError,
             "tuning.min_blocks_per_combined_split must be a tuple of (backend name, 1 int) rows"),
            (dict(triton_tiles=()), TypeError, "tuning.triton_tiles must be a non-empty tuple of (head dim, 3 ints)"),
            (dict(triton_tiles=((256, 48, 4, 2),)), ValueError,
             "tuning.triton_tiles must be a power of two >= 16"),
            (dict(triton_fp8_stages=10 ** 12), ValueError, "tuning.triton_fp8_stages must be in [0, 16]"),
            (dict(triton_resident_programs=((64, 4), 5)), TypeError, "tuning.triton_resident_programs must be a"),
            (dict(underfilled_merge_caps=(8,)), TypeError, "tuning.underfilled_merge_caps must be a tuple of 2 ints"),
            (dict(dependent_combine="yes"), TypeError, "tuning.dependent_combine must be True or False")):
        with pytest.raises(kind, match=re.escape(message)):
            Tuning(**bad)
    Tuning(max_rows_merged_in_split=0, underfilled_merge_caps=(0, 256), split_above_blocks=0)  # 0: the rule off
    with pytest.raises(TypeError, match="tuning must be a flashdecode.hardware.Tuning, got int"):
        DecodeContext("cpu", tuning=5)


def test_plan_for_checks_index_values_as_the_call_does():
    """plan_for's route is validated as the call is, index values of CPU tensors included."""
    q, k_cache, v_cache, _ = inputs(seqlen=12)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 12\]"):
        plan_for(q, k_cache, v_cache, cache_seqlens=torch.tensor([5, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx must be in"):
        plan_for(q, k_cache, v_cache, cache_seqlens=4, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))


def test_torch_compile_checks_out_and_refuses_a_context():
    """Traced, the ops never see ``out`` or a context: ``out`` is checked as an eager call checks it
    (before 2026-12-07 a wrong dtype or shape was cast or broadcast into), and a DecodeContext, whose
    tuning and config the ops could not apply, is refused by name rather than ignored."""
    q, k_cache, v_cache, lengths = inputs(seqlen=16)

    def step(q, k_cache, v_cache, lengths, out=None, context=None):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, out=out, context=context)

    out = torch.empty_like(q)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, lengths, out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, step(q, k_cache, v_cache, lengths), atol=2e-3, rtol=2e-3)
    for bad, message in ((out.float(), "out must have q's dtype"),
                         (q.new_empty(2, 4, 8, 64), "out must have q's shape"),
                         ([0.0], "out must be a torch.Tensor, got list"),
                         (None, "context: under torch.compile")):
        torch._dynamo.reset()
        context = DecodeContext("cpu") if bad is None else None
        with pytest.raises(Exception, match=message):  # dynamo wraps it; its text stays
            torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, lengths, bad, context)


@pytest.mark.gpu
def test_a_context_made_for_cuda_takes_the_current_device():
    """DecodeContext("cuda") serves tensors on the current CUDA device (whose name carries an index)."""
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(2, 40, 2, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    context = DecodeContext("cuda")
    out = flash_attn_with_kvcache(q, k, v, backend="triton", context=context)
    assert torch.allclose(out.float(), reference_attention(q, k, v)[0].float(), atol=2e-2)
    assert context.device == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seqlen_cache, nheads_k, headdim, expected", [
    (16, 64, 8, 128, "tilelang"),  # 4 MiB, one block a sequence
    (16, 200, 8, 128, "triton"),  # 12.5 MiB, 4 blocks a sequence: Triton's 4-stage pipeline
    (16, 362, 8, 128, "triton"),  # case 6: 6 blocks on 128 programs, fewer than the SMs: Triton splits
    (17, 300, 8, 128, "triton"),  # 5 blocks on 136 programs: no split, Triton's 4 stages
    (1, 8192, 4, 128, "triton"),  # case 10: 16 MiB, 8192 tokens a sequence
    (16, 4096, 4, 128, "triton"),  # case 8: 128 MiB
    (8, 32768, 1, 256, "tilelang"),  # wide W10: head dim 256
])
def test_auto_routes_by_cache_size_length_and_head_dim(batch, seqlen_cache, nheads_k, headdim, expected):
    """``Tuning.auto_order`` on a Hopper GPU with both backends (docs/design.md, "Measured choices")."""
    pytest.importorskip("tilelang")
    q = torch.empty(batch, 1, nheads_k * 4, headdim, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(batch, seqlen_cache, nheads_k, headdim, dtype=torch.bfloat16, device="cuda")
    assert plan_for(q, k, k).backend == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_flashattention_layouts_on_the_gpu(backend):
    """A cache made for a larger batch (sequence b reads and appends to row b) and q, k, v and
    cache_seqlens not contiguous in their last dimension (copied) give the reference's result, call
    after call with the same metadata (a call on copies is never replayed from the host path);
    TileLang, which binds the cache to q's batch, declines the first and names Triton."""
    q, k_cache, v_cache, lengths = (t.cuda() for t in inputs(batch=3, seqlen=200, nheads_k=2, headdim=128))
    spare_k = torch.randn(7, *k_cache.shape[1:], dtype=k_cache.dtype, device="cuda")
    spare_v = torch.randn_like(spare_k)
    spare_k[:3], spare_v[:3] = k_cache, v_cache
    untouched = spare_k[3:].clone()

    lengths = lengths.clamp(max=190)
    for step in range(3):  # two tokens appended a step
        q = torch.randn_like(q)
        new_k, new_v = (torch.randn(3, 2, 2, 128, dtype=q.dtype, device="cuda") for _ in range(2))
        expected, _ = reference_attention(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths)
        out = flash_attn_with_kvcache(last_dim_strided(q), spare_k, spare_v, last_dim_strided(new_k),
                                      last_dim_strided(new_v), cache_seqlens=last_dim_strided(lengths), backend=backend)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(spare_k[:3], k_cache)  # the reference appended the same tokens
        lengths = lengths + 2
    assert torch.equal(spare_k[3:], untouched)
    assert plan_for(q, spare_k, spare_v, cache_seqlens=lengths).backend == "triton"
    if backend == "auto":
        pytest.importorskip("tilelang")
        with pytest.raises(flashdecode.BackendError, match="batch rows.*backend 'triton' can"):
            flash_attn_with_kvcache(q, spare_k, spare_v, cache_seqlens=lengths, backend="tilelang")
