"""The references against independent formulations.

``reference_decode`` and ``attention_ref`` against naive float64 loops; ``apply_rotary`` against
complex multiplication; ``reference_attention`` (per sequence, only the keys it sees) against
``attention_ref`` on caches materialized the way FlashAttention's test builds them, for every
feature, and its in-place appends row by row.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fa_grid import alibi_bias, materialize_pages, padding_mask
from flashdecode.reference import (KEY_CHUNK, apply_rotary, attention_ref, reference_attention,
                                   reference_decode)


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


def naive_attention_float64(q, k, v, visible, scale, softcap=0.0, bias=None):
    """Row-by-row float64 attention over explicitly listed visible keys (visible: (B, Sq, Sk) bool)."""
    batch, seqlen_q, nheads, headdim = q.shape
    group = nheads // k.shape[2]
    out = torch.zeros(batch, seqlen_q, nheads, headdim, dtype=torch.float64)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(nheads):
            for i in range(seqlen_q):
                keys = [t for t in range(k.shape[1]) if visible[b, i, t]]
                if not keys:
                    continue
                scores = []
                for t in keys:
                    score = float(q[b, i, h].double() @ k[b, t, h // group].double()) * scale
                    if softcap > 0:
                        score = softcap * math.tanh(score / softcap)
                    scores.append(score + (0.0 if bias is None else float(bias[b, h, i, t])))
                top = max(scores)
                weights = [math.exp(score - top) for score in scores]
                total = sum(weights)
                out[b, i, h] = sum(w * v[b, t, h // group].double() for t, w in zip(keys, weights)) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1)), (False, (2, -1)),
                                           (True, (4, -1))])
def test_attention_ref_matches_naive_float64(causal, window):
    generator = torch.Generator().manual_seed(3)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = 3, 3, 12, 4, 2, 16
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=generator)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=generator)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=generator)
    leftpad, ends = torch.tensor([0, 2, 5]), torch.tensor([12, 9, 6])
    mask = padding_mask(seqlen_k, ends, leftpad)
    slopes = torch.rand(batch, nheads, generator=generator)
    bias = alibi_bias(slopes, seqlen_q, mask, leftpad)
    visible = torch.zeros(batch, seqlen_q, seqlen_k, dtype=torch.bool)
    right = 0 if causal else window[1]
    for b in range(batch):
        for i in range(seqlen_q):
            position = int(ends[b]) - seqlen_q + i
            for t in range(int(leftpad[b]), int(ends[b])):
                visible[b, i, t] = (right < 0 or t <= position + right) and (window[0] < 0 or t >= position - window[0])
    out, lse = attention_ref(q, k, v, mask, bias, causal=causal, window_size=window, softcap=2.0, key_leftpad=leftpad)
    expected_out, expected_lse = naive_attention_float64(q, k, v, visible, headdim ** -0.5, 2.0, bias)
    assert torch.isneginf(lse).equal(torch.isneginf(expected_lse))
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_is_complex_multiplication(interleaved):
    generator = torch.Generator().manual_seed(5)
    batch, seqlen, nheads, headdim, half, table = 2, 5, 3, 40, 16, 9
    x = torch.randn(batch, seqlen, nheads, headdim, generator=generator)
    angle = torch.rand(table, half, generator=generator) * 2 * math.pi
    offsets = torch.tensor([0, 6])  # the second sequence runs past the table: positions 9, 10 take its last row
    rotated = apply_rotary(x, angle.cos(), angle.sin(), offsets, interleaved)
    for b in range(batch):
        for s in range(seqlen):
            position = int(offsets[b]) + s
            turn = torch.polar(torch.ones(half), angle[min(position, table - 1)])
            pairs = x[b, s, :, :2 * half]
            first, second = (pairs[:, 0::2], pairs[:, 1::2]) if interleaved else (pairs[:, :half], pairs[:, half:])
            turned = torch.complex(first, second) * turn
            got = rotated[b, s, :, :2 * half]
            got_first, got_second = (got[:, 0::2], got[:, 1::2]) if interleaved else (got[:, :half], got[:, half:])
            torch.testing.assert_close(got_first, turned.real)
            torch.testing.assert_close(got_second, turned.imag)
    assert torch.equal(rotated[..., 2 * half:], x[..., 2 * half:])


BATCH, NHEADS_K, GROUP, HEADDIM, CAPACITY = 4, 2, 3, 32, 40

#: Feature sets of reference_attention calls: seqlen_q, seqlen_new, page_size, rotary (None: off,
#: else interleaved), causal, window, softcap, alibi (None, "heads": (H,), "batch": (B, H)), leftpad,
#: batch_idx, softmax_scale, cache_seqlens ("tensor", "int", "none").
FEATURES = {
    "plain": {},
    "seqlen_q": dict(seqlen_q=4),
    "causal": dict(seqlen_q=4, causal=True),
    "window": dict(seqlen_q=4, window=(5, 2)),
    "window_left": dict(seqlen_q=3, window=(7, -1)),
    "window_past_capacity": dict(seqlen_q=3, seqlen_new=3, rotary=True, window=(CAPACITY, CAPACITY + 5)),
    "softcap": dict(seqlen_q=2, softcap=1.5),
    "alibi_heads": dict(seqlen_q=3, alibi="heads"),
    "alibi_batch_causal": dict(seqlen_q=3, causal=True, alibi="batch"),
    "leftpad": dict(seqlen_q=2, leftpad=True, window=(6, 0)),
    "batch_idx": dict(seqlen_q=2, seqlen_new=2, batch_idx=True),
    "scale": dict(softmax_scale=0.3),
    "seqlens_int": dict(seqlen_q=2, cache_seqlens="int"),
    "seqlens_none": dict(seqlen_q=2, causal=True, cache_seqlens="none"),
    "paged": dict(page_size=16),
    "paged_append_rotary": dict(page_size=8, seqlen_q=3, seqlen_new=3, rotary=True, causal=True),
    "append_rotary_halves": dict(seqlen_q=3, seqlen_new=2, rotary=False, causal=True),
    "rotary_not_windowed": dict(seqlen_q=3, seqlen_new=3, rotary=True),
    "everything": dict(seqlen_q=3, seqlen_new=3, rotary=False, leftpad=True, batch_idx=True, window=(9, 1),
                       softcap=8.0, alibi="batch"),
    "everything_paged": dict(page_size=4, seqlen_q=2, seqlen_new=1, rotary=True, leftpad=True, window=(9, -1),
                             softcap=8.0, alibi="heads"),
}


def random_call(seed, dtype=torch.float16, seqlen_q=1, seqlen_new=0, page_size=0, rotary=None, causal=False,
                window=(-1, -1), softcap=0.0, alibi=None, leftpad=False, batch_idx=False, softmax_scale=None,
                cache_seqlens="tensor"):
    """Keyword arguments of one reference_attention call; lengths 0 (when nothing is appended), 1,
    full, and one random."""
    generator = torch.Generator().manual_seed(seed)
    nheads = NHEADS_K * GROUP

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    call = dict(q=randn(BATCH, seqlen_q, nheads, HEADDIM), causal=causal, window_size=window, softcap=softcap,
                softmax_scale=softmax_scale)
    room = CAPACITY - seqlen_new
    random_length = int(torch.randint(2, room, (1,), generator=generator))
    lengths = torch.tensor([0, 1, room, random_length], dtype=torch.int32)
    call["cache_seqlens"] = {"tensor": lengths, "int": 17, "none": None}[cache_seqlens]
    if page_size:
        blocks = CAPACITY // page_size
        num_pages = BATCH * blocks + 2
        call["k_cache"], call["v_cache"] = (randn(num_pages, page_size, NHEADS_K, HEADDIM) for _ in range(2))
        call["block_table"] = torch.randperm(num_pages, generator=generator)[:BATCH * blocks].int().view(BATCH, blocks)
    else:
        rows = 2 * BATCH if batch_idx else BATCH
        call["k_cache"], call["v_cache"] = (randn(rows, CAPACITY, NHEADS_K, HEADDIM) for _ in range(2))
    if batch_idx:
        call["cache_batch_idx"] = torch.randperm(2 * BATCH, generator=generator)[:BATCH].int()
    if leftpad:
        call["cache_leftpad"] = (torch.rand(BATCH, generator=generator) * (lengths + 1)).int()
    if seqlen_new:
        call["k"], call["v"] = randn(BATCH, seqlen_new, NHEADS_K, HEADDIM), randn(BATCH, seqlen_new, NHEADS_K, HEADDIM)
    if rotary is not None:
        angle = torch.rand(CAPACITY, HEADDIM // 4, generator=generator) * 2 * math.pi
        call.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=rotary)
    if alibi is not None:
        call["alibi_slopes"] = torch.rand(nheads if alibi == "heads" else (BATCH, nheads), generator=generator)
    return call


def dense_expectation(call):
    """What ``call`` must return and leave in each sequence's cache, built as FlashAttention's test
    builds it: caches materialized per sequence, appends written into that copy, a key padding mask,
    ALiBi as a bias, the dense ``attention_ref``. Returns (out, lse, keys, values)."""
    q = call["q"]
    batch, seqlen_q, nheads, headdim = q.shape
    if call.get("block_table") is not None:
        capacity = call["block_table"].shape[1] * call["k_cache"].shape[1]
        keys = materialize_pages(call["k_cache"], call["block_table"], capacity).clone()
        values = materialize_pages(call["v_cache"], call["block_table"], capacity).clone()
    else:
        rows = call.get("cache_batch_idx", torch.arange(batch))
        keys, values = call["k_cache"][rows.long()].clone(), call["v_cache"][rows.long()].clone()
        capacity = keys.shape[1]
    lengths = call["cache_seqlens"]
    if not torch.is_tensor(lengths):
        lengths = torch.full((batch,), capacity if lengths is None else lengths)
    k, seqlen_new = call.get("k"), 0 if call.get("k") is None else call["k"].shape[1]
    window, causal = call["window_size"], call["causal"]
    windowed = causal or any(0 <= side < capacity for side in window)
    q_ro = q
    if call.get("rotary_cos") is not None:
        rotate = dict(cos=call["rotary_cos"], sin=call["rotary_sin"], offsets=lengths,
                      interleaved=call["rotary_interleaved"])
        if windowed:
            q_ro = apply_rotary(q, **rotate)
        else:
            q_ro = apply_rotary(q.reshape(batch, 1, -1, headdim), **rotate).view_as(q)
        k = apply_rotary(k, **rotate)
    for b, start in enumerate(lengths.tolist()):
        if seqlen_new:
            keys[b, start:start + seqlen_new] = k[b]
            values[b, start:start + seqlen_new] = call["v"][b]
    leftpad = call.get("cache_leftpad")
    mask = padding_mask(capacity, lengths + seqlen_new, leftpad)
    slopes = call.get("alibi_slopes")
    bias = None if slopes is None else alibi_bias(slopes, seqlen_q, mask, leftpad)
    out, lse = attention_ref(q_ro, keys, values, mask, bias, causal, window, call["softcap"], key_leftpad=leftpad,
                             softmax_scale=call["softmax_scale"])
    return out, lse, keys, values


def materialized_caches(call):
    """(keys, values) per sequence, read back from the call's caches (pages or rows)."""
    if call.get("block_table") is not None:
        capacity = call["block_table"].shape[1] * call["k_cache"].shape[1]
        return (materialize_pages(call[name], call["block_table"], capacity) for name in ("k_cache", "v_cache"))
    rows = call.get("cache_batch_idx", torch.arange(call["q"].shape[0])).long()
    return call["k_cache"][rows], call["v_cache"][rows]


def check_against_dense(call):
    expected_out, expected_lse, expected_keys, expected_values = dense_expectation(call)
    out, lse = reference_attention(**call)
    assert out.dtype == call["q"].dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    torch.testing.assert_close(out.float(), expected_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)
    keys, values = materialized_caches(call)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    return out, lse


@pytest.mark.parametrize("features", FEATURES)
def test_reference_attention_matches_dense_attention_ref(features):
    check_against_dense(random_call(seed=len(features), **FEATURES[features]))


def test_reference_attention_bfloat16_everything():
    check_against_dense(random_call(seed=11, dtype=torch.bfloat16, **FEATURES["everything"]))


def test_sequences_without_keys_give_zero_and_minus_inf():
    """Length 0, and rows whose window holds no key (query row 0 of length 1 sits at position -1)."""
    call = random_call(seed=1, seqlen_q=2, window=(3, 0))
    out, lse = check_against_dense(call)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (out[1, 0] == 0).all() and torch.isneginf(lse[1, :, 0]).all() and torch.isfinite(lse[1, :, 1]).all()


@pytest.mark.parametrize("interleaved", [False, True])
def test_paged_equals_contiguous(interleaved):
    """The same keys in shuffled pages of 8 or in rows picked by cache_batch_idx: same outputs, and
    the same keys in place after the append."""
    paged = random_call(seed=4, page_size=8, seqlen_q=3, seqlen_new=2, rotary=interleaved, causal=True, alibi="heads")
    keys, values = materialized_caches(paged)
    rows = torch.tensor([5, 0, 7, 2], dtype=torch.int32)

    def spread(per_sequence):  # into rows `rows` of a larger cache whose other rows are noise
        return torch.randn(2 * BATCH, CAPACITY, NHEADS_K, HEADDIM).half().index_copy(0, rows.long(), per_sequence)

    contiguous = dict(paged, block_table=None, cache_batch_idx=rows, k_cache=spread(keys), v_cache=spread(values))
    out_paged, lse_paged = reference_attention(**paged)
    out_contiguous, lse_contiguous = reference_attention(**contiguous)
    assert torch.equal(out_paged, out_contiguous) and torch.equal(lse_paged, lse_contiguous)
    for after_paged, after_contiguous in zip(materialized_caches(paged), materialized_caches(contiguous)):
        assert torch.equal(after_paged, after_contiguous)


@pytest.mark.parametrize("page_size", [0, 4])
def test_append_writes_exactly_the_new_rows(page_size):
    """Slots [cache_seqlens[b], + seqlen_new) of sequence b's row or pages hold the new v (and the
    rotated k); every other slot, spare rows and pages included, keeps its value."""
    call = random_call(seed=6, page_size=page_size, seqlen_q=2, seqlen_new=3, rotary=True, batch_idx=not page_size)
    before_k, before_v = call["k_cache"].clone(), call["v_cache"].clone()
    reference_attention(**call)
    expected = torch.zeros(before_v.shape[:2], dtype=torch.bool)  # per (row or page, slot)
    for b, start in enumerate(call["cache_seqlens"].tolist()):
        for j in range(3):
            position = start + j
            if page_size:
                slot = call["block_table"][b, position // page_size], position % page_size
            else:
                slot = call["cache_batch_idx"][b], position
            expected[slot] = True
            assert torch.equal(call["v_cache"][slot], call["v"][b, j])
    for after, before in ((call["k_cache"], before_k), (call["v_cache"], before_v)):
        assert torch.equal((after != before).flatten(2).any(-1), expected)


def test_keys_across_chunks():
    """A sequence longer than KEY_CHUNK, under a left window reaching back across a chunk edge."""
    generator = torch.Generator().manual_seed(8)
    length = KEY_CHUNK + 70
    q = torch.randn(1, 4, 2, 16, generator=generator).half()
    k_cache = torch.randn(1, length + 5, 1, 16, generator=generator).half()
    v_cache = torch.randn(1, length + 5, 1, 16, generator=generator).half()
    for window in ((-1, -1), (100, 0)):
        call = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=torch.tensor([length], dtype=torch.int32),
                    causal=False, window_size=window, softcap=0.0, softmax_scale=None)
        check_against_dense(call)
