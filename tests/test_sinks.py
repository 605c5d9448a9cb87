"""Attention sinks (``sinks``: a float32 logit per query head in every row's softmax denominator):
the reference's semantics, the Triton kernels on every plan kind against it (single pass, split
merged in the split kernel, split merged by the combine; CPU tensors under Triton's interpreter),
the public call on every backend, the checks of the argument, and the route; on the GPU, the public
call on Triton and TileLang.

The property every test leans on: a sink adds exp(sink) to the denominator and nothing to the
numerator, so with sinks ``lse = logaddexp(lse_plain, sink)`` and ``out = out_plain *
exp(lse_plain - lse)`` of the same call without them (a row that sees no key: out 0, lse = sink).
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import slow_except
from flashdecode import flash_attn_with_kvcache, plan_for
from flashdecode.reference import attention_ref, relative_error
from plan_launch import check_plan_against_reference, make_inputs, reference, through_plan

OUT_TOLERANCE, LSE_TOLERANCE = 5e-3, 2e-3


def sunk(out, lse, sinks):
    """(out, lse) of the same call with ``sinks`` from those of a call without them (the module
    docstring's identity); out (B, Sq, H, D) with lse (B, H, Sq), or (total_q, H, D) with (H, total_q)."""
    lse_sunk = torch.logaddexp(lse, sinks.float().view(-1, 1) if lse.dim() == 2 else sinks.float().view(1, -1, 1))
    scale = torch.exp(lse - lse_sunk)  # 0 where lse is -inf (a row that sees no key)
    per_row = scale.transpose(1, 2) if scale.dim() == 3 else scale.transpose(0, 1)
    return (out.float() * per_row.unsqueeze(-1)).to(out.dtype), lse_sunk


def test_reference_adds_the_sink_to_the_denominator_only():
    q, k_cache, v_cache, kwargs = make_inputs(seqlen_q=3, causal=True, sinks=True, lengths=[0, 40, 73])
    sinks = kwargs.pop("sinks")
    out, lse, _, _ = reference(q, k_cache, v_cache, kwargs)
    out_sinks, lse_sinks, _, _ = reference(q, k_cache, v_cache, dict(kwargs, sinks=sinks))
    expected_out, expected_lse = sunk(out, lse, sinks)
    assert torch.allclose(lse_sinks, expected_lse, atol=1e-5)
    assert relative_error(out_sinks, expected_out) < 1e-3
    assert torch.equal(lse_sinks[0], sinks.view(-1, 1).expand(-1, 3))  # no key: the sink alone
    assert not out_sinks[0].any()


def test_dense_oracle_agrees_with_the_reference():
    """attention_ref's sinks (a column of the scores, as gpt-oss writes it) against reference_attention."""
    q, k_cache, v_cache, kwargs = make_inputs(seqlen_q=2, causal=True, sinks=True, lengths=[80, 80, 80])
    out, lse, _, _ = reference(q, k_cache, v_cache, kwargs)
    dense_out, dense_lse = attention_ref(q, k_cache, v_cache, causal=True, sinks=kwargs["sinks"])
    assert relative_error(out, dense_out) < 1e-3
    assert torch.allclose(lse, dense_lse, atol=1e-4)


def test_minus_infinite_sinks_change_nothing():
    q, k_cache, v_cache, kwargs = make_inputs(sinks=True, lengths=[0, 30, 60])
    kwargs["sinks"] = torch.full_like(kwargs["sinks"], -math.inf)
    out, lse, _, _ = reference(q, k_cache, v_cache, kwargs)
    plain_out, plain_lse, _, _ = reference(q, k_cache, v_cache, {**kwargs, "sinks": None})
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    triton_out, triton_lse, _, _ = through_plan(q, k_cache, v_cache, kwargs, num_splits=3)
    assert torch.isneginf(triton_lse[0]).all() and not triton_out[0].any()



@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sink_of_plus_infinity_makes_its_heads_rows_nan(num_splits):
    """docs/api.md: sinks are not checked, and +inf makes the rows NaN, in the reference as in the
    kernels (a sequence that sees no key too); the other heads are untouched."""
    q, k_cache, v_cache, kwargs = make_inputs(sinks=True, lengths=[0, 30, 60])
    kwargs["sinks"][0] = math.inf
    finite = torch.where(kwargs["sinks"].isinf(), 0.0, kwargs["sinks"])  # head 0's sink as 0, the others as given
    finite_out, finite_lse, _, _ = reference(q, k_cache, v_cache, {**kwargs, "sinks": finite})
    for out, lse in (reference(q, k_cache, v_cache, kwargs)[:2], through_plan(q, k_cache, v_cache, kwargs,
                                                                              num_splits=num_splits)[:2]):
        assert out[:, :, 0].isnan().all() and lse[:, 0].isnan().all()
        assert torch.allclose(out[:, :, 1:], finite_out[:, :, 1:], atol=2e-3, equal_nan=False)
        assert torch.allclose(lse[:, 1:], finite_lse[:, 1:], atol=LSE_TOLERANCE)

#: (feature, make_inputs arguments, num_splits, merged in the split kernel): every plan kind
#: (single pass; split merged by the combine; split merged in the split kernel) with the features
#: that change the rows (query rows, appended tokens, windows whose rows see no key, pages, softcap).
TRITON_CASES = [
    ("plain", {}, 1, False),
    ("plain", {}, 3, False),
    ("plain", {}, 3, True),
    ("no-key rows", dict(lengths=[0, 33, 80]), 3, False),
    ("append, causal", dict(seqlen_q=3, append=True, causal=True), 3, False),
    ("window", dict(seqlen_q=3, window=(4, 0)), 2, True),
    ("window, combine", dict(seqlen_q=3, window=(20, 0)), 3, False),
    ("paged", dict(page_size=16), 2, False),
    ("softcap", dict(softcap=3.0, seqlen_q=2), 0, True),
]


@pytest.mark.parametrize("feature,arguments,num_splits,merge",
                         slow_except(TRITON_CASES, [TRITON_CASES[0]], several=True),
                         ids=[f"{case[0]}-splits{case[2]}{'-merge' if case[3] else ''}" for case in TRITON_CASES])
def test_triton_kernels_match_the_reference(feature, arguments, num_splits, merge):
    check_plan_against_reference(make_inputs(sinks=True, **arguments), num_splits, merge, OUT_TOLERANCE, LSE_TOLERANCE)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_public_call_matches_the_identity(backend):
    """The public call with sinks against the same call without them, turned by the identity."""
    q, k_cache, v_cache, kwargs = make_inputs(seqlen_q=2, causal=True, sinks=True, lengths=[5, 50, 80])
    sinks = kwargs.pop("sinks")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, return_softmax_lse=True, backend=backend)
    sunk_out, sunk_lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, sinks=sinks, return_softmax_lse=True,
                                                 backend=backend)
    assert plan_for(q, k_cache, v_cache, **kwargs, sinks=sinks, backend=backend).problem.sinks
    expected_out, expected_lse = sunk(out, lse, sinks)
    assert torch.allclose(sunk_lse, expected_lse, atol=LSE_TOLERANCE)
    assert relative_error(sunk_out, expected_out) < OUT_TOLERANCE


def test_sinks_that_require_grad_leave_no_graph():
    """A model's sinks are parameters (gpt-oss) and its forward may run with grad on: the call is no
    autograd op (the kernels' launches are none), so on the reference too neither its outputs nor the
    lse buffer it writes for later calls keep a graph (they had one, and a later call writing that
    buffer in place raised)."""
    q, k_cache, v_cache, kwargs = make_inputs(sinks=True, lengths=[5, 50, 80])
    sinks = torch.nn.Parameter(kwargs.pop("sinks"))
    for lse_wanted in (False, True):
        result = flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, **kwargs, sinks=sinks,
                                         return_softmax_lse=lse_wanted, backend="reference")
        assert not any(tensor.requires_grad for tensor in (result if lse_wanted else (result,)))


def test_sinks_are_checked():
    q, k_cache, v_cache, kwargs = make_inputs(sinks=True)
    sinks = kwargs.pop("sinks")
    for bad, error, message in ((sinks.half(), TypeError, "sinks must be float32"),
                                (sinks[:-1], ValueError, r"sinks must have shape \(4,\)"),
                                (sinks.view(1, -1), ValueError, "sinks must have 1 dimensions"),
                                (sinks.tolist(), TypeError, "sinks must be a torch.Tensor")):
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, sinks=bad)


#: ``test_gpu_sinks``' call (``make_inputs`` arguments) and its split counts (``tools/warmup_tests.py``
#: builds TileLang's kernels for them).
GPU_CALL = dict(batch=4, capacity=3000, nheads_k=4, group=8, headdim=128, seqlen_q=2, causal=True, sinks=True,
                dtype=torch.bfloat16)
GPU_SPLITS = [1, 0, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "tilelang"])
@pytest.mark.parametrize("num_splits", GPU_SPLITS)
def test_gpu_sinks(backend, num_splits):
    """On the GPU: the public call's every plan kind against the reference (TileLang: single pass,
    split and combine), auto on Triton, and a CUDA graph replay with new sink values."""
    q, k_cache, v_cache, kwargs = make_inputs(**GPU_CALL)
    route = plan_for(q, k_cache, v_cache, **kwargs, num_splits=num_splits, backend=backend)
    assert route.backend == ("tilelang" if backend == "tilelang" else "triton")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, num_splits=num_splits, return_softmax_lse=True,
                                       backend=backend)
    ref_out, ref_lse, _, _ = reference(q, k_cache, v_cache, kwargs)
    assert relative_error(out, ref_out) < 2e-2 and torch.allclose(lse, ref_lse, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, num_splits=num_splits,
                                                         return_softmax_lse=True, backend=backend)
    kwargs["sinks"].copy_(torch.randn_like(kwargs["sinks"]) * 3)
    graph.replay()
    ref_out, ref_lse, _, _ = reference(q, k_cache, v_cache, kwargs)
    assert relative_error(captured, ref_out) < 2e-2 and torch.allclose(captured_lse, ref_lse, atol=1e-2)

