"""The reference against a naive float64 implementation written independently (loops, no masking)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashdecode.reference import reference_decode


def naive_float64(q, k_cache, v_cache, lengths, scale):
    batch, _, nheads, headdim = q.shape
    group = nheads // k_cache.shape[2]
    out = torch.zeros(batch, nheads, headdim, dtype=torch.float64)
    lse = torch.full((batch, nheads), -math.inf, dtype=torch.float64)
    for b, length in enumerate(lengths):
        for h in range(nheads):
            if length == 0:
                continue
            scores = [float(q[b, 0, h].double() @ k_cache[b, t, h // group].double()) * scale for t in range(length)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[b, h] = sum(w * v_cache[b, t, h // group].double() for t, w in enumerate(weights)) / total
            lse[b, h] = top + math.log(total)
    return out, lse


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    seqlen_cache=st.integers(1, 80),
    nheads_k=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 4]),
    headdim=st.sampled_from([8, 64]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    data=st.data(),
)
def test_reference_matches_naive_float64(batch, seqlen_cache, nheads_k, group, headdim, dtype, data):
    lengths = data.draw(st.lists(st.integers(0, seqlen_cache), min_size=batch, max_size=batch))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    q = torch.randn(batch, 1, nheads_k * group, headdim, generator=generator).to(dtype)
    k = torch.randn(batch, seqlen_cache, nheads_k, headdim, generator=generator).to(dtype)
    v = torch.randn(batch, seqlen_cache, nheads_k, headdim, generator=generator).to(dtype)
    scale = 1 / math.sqrt(headdim)
    out, lse = reference_decode(q, k, v, torch.tensor(lengths, dtype=torch.int32), scale)
    expected_out, expected_lse = naive_float64(q, k, v, lengths, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, nheads_k * group, 1) and lse.dtype == torch.float32
    # The output is rounded once to the input dtype: within one ulp of bf16/fp16 (2^-8 / 2^-11).
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    torch.testing.assert_close(out[:, 0].double(), expected_out, atol=ulp * 2, rtol=ulp)
    torch.testing.assert_close(lse[..., 0].double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_empty_rows_are_zero_and_minus_inf():
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    k = torch.randn(2, 5, 2, 64, dtype=torch.float16)
    out, lse = reference_decode(q, k, k, torch.tensor([0, 5], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    assert not out.isnan().any()


@pytest.mark.parametrize("lengths", [[1, 1], [17, 3], [100, 1]])
def test_rows_of_very_different_lengths(lengths):
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    k = torch.randn(2, 100, 2, 64, dtype=torch.float16)
    v = torch.randn(2, 100, 2, 64, dtype=torch.float16)
    out, lse = reference_decode(q, k, v, torch.tensor(lengths, dtype=torch.int32), 0.125)
    expected_out, expected_lse = naive_float64(q, k, v, lengths, 0.125)
    torch.testing.assert_close(out[:, 0].double(), expected_out, atol=2**-10, rtol=2**-11)
    torch.testing.assert_close(lse[..., 0].double(), expected_lse, atol=1e-5, rtol=1e-5)
