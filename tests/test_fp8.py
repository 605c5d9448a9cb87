"""fp8 KV caches (float8_e4m3fn, float8_e5m2) with float16/bfloat16 q: ``k_descale``/``v_descale``,
the reference's dequantisation, quantised appends, validation, routing, and the Triton kernels
against the reference.

CPU tier: the reference, the validation, and the Triton kernels under Triton's interpreter, which
loads and converts fp8 tiles. The Triton kernels' products take float16 operands whatever q's dtype,
so bfloat16 q runs right there too (the interpreter computes bfloat16 products wrongly, as for the
other tests), but for its float32 -> bfloat16 conversion, which truncates: rotated bfloat16 keys
written to the cache differ from torch's. Its fp32 -> fp8 conversion truncates too, which is why the
kernels round onto the fp8 grid in float32 themselves (``attend.quantise``); a test here checks that
rounding against torch's on every fp8 value. GPU tier (``gpu`` marker): the same features on CUDA
in float16 and bfloat16, through ``auto`` too and on TileLang where it takes them (its split kernel
on longer caches too), and the accuracy rule of the 14 benchmark cases with an e4m3 cache.

Tolerances: the kernels compute on the fp8 values exactly (converted to float16, which holds every
fp8 value) and fold the descales into float32 factors, so their error against the float32
reference on the same cache is that of a 16-bit call (``test_triton_interpreter``'s 5e-3).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, slow_except
from flashdecode import DecodeContext, cases, flash_attn_with_kvcache, plan_for
from flashdecode.bench import peers
from flashdecode.context import default_context
from flashdecode.kernels.base import get_backend, select
from flashdecode.kernels.tilelang.backend import problem_limitation
from flashdecode.kernels.triton.attend import fp8_bits_to_f16, quantise as triton_quantise
from flashdecode.kernels.triton.workarounds import FP8_V_WORDS_MAX_BLOCK_M
from flashdecode.hardware import PROFILES
from flashdecode.reference import descale_table, quantise, reference_attention, relative_error

DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_TOLERANCE = 5e-3
LSE_TOLERANCE = 2e-3


def make_call(batch=2, capacity=100, nheads_k=2, group=3, headdim=64, seqlen_q=1, lengths=None, page_size=0,
              seqlen_new=0, rotary_dim=0, causal=False, window=(-1, -1), softcap=0.0, alibi=False, leftpad=None,
              batch_idx=False, fp8=torch.float8_e4m3fn, descale="table", dtype=torch.float16, seed=0):
    """(q, k_cache, v_cache, keyword arguments) of a call on fp8 caches: values drawn in float32 and
    ``quantise``d by the descales (``descale``: "table" (batch, nheads_k), "head" (nheads_k,),
    "tensor" a 0-d tensor, "number" a float, None: none given, i.e. 1). Paged caches: shuffled pages,
    3 spare; ``batch_idx``: 2 spare rows; lengths default to the capacity minus the appended tokens,
    then 5 fewer per sequence."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    def index(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    table = 0.5 + torch.rand(batch, nheads_k, generator=generator)
    given = {"table": table, "head": table[0], "tensor": table[0, 0], "number": float(table[0, 0]),
             None: None}[descale]
    scales = descale_table(given, batch, nheads_k, "cpu")
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    if page_size:
        max_blocks = -(-capacity // page_size)
        pages = batch * max_blocks + 3
        k_cache, v_cache = randn(pages, page_size, nheads_k, headdim), randn(pages, page_size, nheads_k, headdim)
        order = torch.randperm(pages, generator=generator)[:batch * max_blocks].view(batch, max_blocks)
        kwargs["block_table"] = index(order.tolist())
        owner = [0] * pages  # the spare pages take sequence 0's descales
        for b in range(batch):
            for page in order[b].tolist():
                owner[page] = b
        capacity = max_blocks * page_size
    else:
        rows = batch + 2 if batch_idx else batch
        k_cache, v_cache = randn(rows, capacity, nheads_k, headdim), randn(rows, capacity, nheads_k, headdim)
        owner = list(range(rows))
        if batch_idx:
            cache_rows = torch.randperm(rows, generator=generator)[:batch]
            kwargs["cache_batch_idx"] = index(cache_rows.tolist())
            owner = [0] * rows
            for b, row in enumerate(cache_rows.tolist()):
                owner[row] = b
    k_cache = torch.stack([quantise(k_cache[i], scales[b], fp8) for i, b in enumerate(owner)])
    v_cache = torch.stack([quantise(v_cache[i], scales[b], fp8) for i, b in enumerate(owner)])
    if lengths is None:
        lengths = [max(0, capacity - seqlen_new - 5 * b) for b in range(batch)]
    kwargs["cache_seqlens"] = index(lengths)
    if seqlen_new:
        kwargs.update(k=randn(batch, seqlen_new, nheads_k, headdim).to(dtype).to(DEVICE),
                      v=randn(batch, seqlen_new, nheads_k, headdim).to(dtype).to(DEVICE))
    if rotary_dim:
        frequencies = 1.0 / 10000 ** (torch.arange(rotary_dim // 2) / (rotary_dim // 2))
        angles = torch.arange(capacity)[:, None] * frequencies[None, :]
        kwargs.update(rotary_cos=angles.cos().to(dtype).to(DEVICE), rotary_sin=angles.sin().to(dtype).to(DEVICE))
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(batch, nheads_k * group, generator=generator).to(DEVICE)
    if leftpad is not None:
        kwargs["cache_leftpad"] = index(leftpad)
    if descale is not None:
        on_device = given.to(DEVICE) if isinstance(given, torch.Tensor) else given
        kwargs.update(k_descale=on_device, v_descale=on_device)
    q = randn(batch, seqlen_q, nheads_k * group, headdim).to(dtype).to(DEVICE)
    return q, k_cache.to(DEVICE), v_cache.to(DEVICE), kwargs


def run(call, backend, num_splits=0, context=None):
    """(out, lse, k_cache, v_cache) of the public call (on ``context``, if given) on copies of the caches."""
    q, k_cache, v_cache, kwargs = call
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, num_splits=num_splits,
                                       return_softmax_lse=True, backend=backend, context=context)
    return out, lse, k_cache, v_cache


def expected(call):
    """(out, lse, k_cache, v_cache) of ``reference_attention`` on copies of the caches."""
    q, k_cache, v_cache, kwargs = call
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = reference_attention(q, k_cache, v_cache, **kwargs)
    return out, lse, k_cache, v_cache


def assert_matches(got, want, out_tolerance=OUT_TOLERANCE, lse_tolerance=LSE_TOLERANCE, lse_relative=0.0):
    """out within ``out_tolerance`` (relative L2), lse within ``lse_tolerance`` plus ``lse_relative``
    of its value, rows without keys exactly 0 and -inf, and the caches after the call equal value
    for value."""
    out, lse, k_cache, v_cache = got
    want_out, want_lse, want_k, want_v = want
    assert out.dtype == want_out.dtype and k_cache.dtype == want_k.dtype
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()
    if not empty.all():
        assert relative_error(out, want_out) < out_tolerance
        torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=lse_tolerance, rtol=lse_relative)
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())


# -- the reference -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_quantise_divides_saturates_and_rounds_to_nearest_even(fp8):
    largest = torch.finfo(fp8).max
    step = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)  # between 1 and 2
    x = torch.tensor([[3 * largest, -3 * largest, 1 + step / 2, 1 + 3 * step / 2]])  # (Hk = 1, D = 4)
    assert quantise(x, torch.ones(1), fp8).float().tolist() == [[largest, -largest, 1.0, 1 + 2 * step]]
    assert quantise(x / 4, torch.tensor([0.25]), fp8).float().tolist() == [[largest, -largest, 1.0, 1 + 2 * step]]


@triton.jit
def _quantise_kernel(X, Out, descale, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Out + offsets, triton_quantise(tl.load(X + offsets), descale, Out.dtype.element_ty))


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("descale", [1.0, 0.37])
def test_triton_quantise_is_the_references(fp8, descale):
    """The kernels' rounding onto the fp8 grid in float32 equals torch's conversion on every fp8 value,
    the points halfway between neighbours, their neighbours, zero and values past the range."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[grid.isfinite()].unique()  # sorted
    halfway = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, halfway, grid * (1 + 2 ** -5), grid * (1 - 2 ** -5), grid * 1e6,
                        torch.tensor([0.0, 1e-9, -1e-9])]) * descale
    values = values.to(torch.float16).float()  # as the appended tokens come: q's dtype
    values = torch.cat([values, torch.zeros(2048 - values.numel())])
    got = torch.empty(values.numel(), dtype=fp8, device=DEVICE)
    _quantise_kernel[(1,)](values.to(DEVICE), got, descale, N=values.numel())
    want = quantise(values[:, None], torch.tensor([descale]), fp8)[:, 0]
    assert torch.equal(got.cpu().float(), want.float())


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_reference_reads_the_dequantised_cache(fp8):
    """An fp8 call is the float32 call on ``cache * descale``, its appended tokens stored quantised."""
    call = make_call(seqlen_new=3, page_size=16, seqlen_q=2, causal=True, softcap=1.5, fp8=fp8)
    q, k_cache, v_cache, kwargs = call
    out, lse, k_after, v_after = expected(call)
    scales = kwargs["k_descale"].cpu()
    table = kwargs["block_table"].cpu()
    wide = {name: value for name, value in kwargs.items() if name not in ("k_descale", "v_descale")}
    k_wide, v_wide = k_cache.float().cpu(), v_cache.float().cpu()
    for b in range(2):  # dequantise each sequence's pages by its descales
        pages = table[b].long()
        k_wide[pages] *= scales[b][:, None]
        v_wide[pages] *= scales[b][:, None]
    wide.update(k=kwargs["k"].float(), v=kwargs["v"].float())  # quantised below, by the same rule
    for b, start in enumerate(kwargs["cache_seqlens"].tolist()):
        for j in range(3):
            page, slot = table[b, (start + j) // 16], (start + j) % 16
            assert torch.equal(k_after[page, slot].float(), quantise(kwargs["k"][b, j], scales[b], fp8).float())
            wide["k"][b, j] = quantise(kwargs["k"][b, j], scales[b], fp8).float() * scales[b][:, None]
            wide["v"][b, j] = quantise(kwargs["v"][b, j], scales[b], fp8).float() * scales[b][:, None]
    want_out, want_lse = reference_attention(q.float(), k_wide, v_wide, **wide)
    assert relative_error(out, want_out) < 1e-3  # out is rounded to q's float16
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("descale", ["head", "tensor", "number", None])
def test_every_descale_form_is_a_table(descale):
    """(nheads_k,), a 0-d tensor, a number and None (1.0) read as the (batch, nheads_k) table they expand to."""
    call = make_call(descale=descale, seqlen_new=2)
    q, k_cache, v_cache, kwargs = call
    table = descale_table(kwargs.get("k_descale"), 2, 2, DEVICE).contiguous()
    as_table = (q, k_cache, v_cache, dict(kwargs, k_descale=table, v_descale=table))
    got, want = expected(call), expected(as_table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2].float(), want[2].float())


# -- validation: each argument named ----------------------------------------------------------------

def _plain(**changes):
    q, k_cache, v_cache, kwargs = make_call()
    kwargs = dict(kwargs, **changes)
    return q, k_cache, kwargs.pop("v_cache", v_cache), kwargs


BAD = [  # (changes, error, words of the message)
    (dict(k_descale=torch.ones(3, 2)), ValueError, "k_descale must have shape (2, 2), (2,) or ()"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError, "v_descale must be float32"),
    (dict(k_descale=0.0), ValueError, "k_descale must be finite and > 0"),
    (dict(v_descale=float("nan")), ValueError, "v_descale must be finite and > 0"),
    (dict(k_descale="1"), TypeError, "k_descale must be a float32 tensor"),
    (dict(k_descale=True), TypeError, "k_descale must be a float32 tensor"),
]


@pytest.mark.parametrize("changes, error, words", BAD, ids=[str(index) for index in range(len(BAD))])
def test_bad_descales_are_named(changes, error, words):
    q, k_cache, v_cache, kwargs = _plain(**changes)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_descales_as_numbers_trace_under_torch_compile(backend):
    """torch.compile(fullgraph=True) takes descales as numbers (traced as 0-d tensors), appending,
    with the eager call's results; a bad number is named as in eager calls (in Dynamo's error, which
    carries an exception raised while it traces)."""
    call = make_call(descale="number", seqlen_new=1)
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(call, backend), run(call, backend)):
        assert torch.equal(got, want)
    q, k_cache, v_cache, kwargs = call
    with pytest.raises(Exception, match="v_descale must be finite and > 0"):
        compiled((q, k_cache, v_cache, dict(kwargs, v_descale=-1.0)), backend)


def test_cache_dtypes_are_checked():
    q, k_cache, v_cache, kwargs = _plain()
    with pytest.raises(TypeError, match="v_cache must have k_cache's dtype"):
        flash_attn_with_kvcache(q, k_cache, v_cache.to(torch.float8_e5m2), **kwargs)
    with pytest.raises(TypeError, match="k_cache must have q's dtype .* or be float8_e4m3fn or float8_e5m2"):
        flash_attn_with_kvcache(q, k_cache.to(torch.int8), v_cache.to(torch.int8), **kwargs)
    with pytest.raises(TypeError, match="k must have q's dtype"):  # appended tokens come in q's dtype
        flash_attn_with_kvcache(q, k_cache, v_cache, k=k_cache[:, :1], v=v_cache[:, :1], **kwargs)


def test_descales_need_an_fp8_cache():
    q, k_cache, v_cache, kwargs = _plain()
    wide = dict(kwargs, k_descale=None)
    with pytest.raises(ValueError, match="v_descale applies to float8 caches only"):
        flash_attn_with_kvcache(q, k_cache.to(q.dtype), v_cache.to(q.dtype), **wide)


def test_the_call_without_descales_is_unchanged():
    """Without fp8 caches and descales the Problem is the one before fp8 existed: no cache dtype, no feature."""
    q, k_cache, v_cache, kwargs = _plain()
    for name in ("k_descale", "v_descale"):
        kwargs.pop(name)
    problem = plan_for(q, k_cache.to(q.dtype), v_cache.to(q.dtype), **kwargs).problem
    assert problem.cache_dtype is None and "fp8" not in problem.features()
    assert problem.cache_element_bytes == problem.element_bytes == 2


# -- the route ------------------------------------------------------------------------------------------

def test_fp8_problem_reads_one_byte_an_element_and_auto_takes_triton(monkeypatch):
    """Bytes at capacity count 1 byte an element; TileLang's kernels take fp8, but ``auto`` on a
    Hopper takes Triton until TileLang is measured with it (without one: ``select`` for a CUDA
    device TileLang deems a Hopper)."""
    q, k_cache, v_cache, kwargs = make_call()
    problem = plan_for(q, k_cache, v_cache, **kwargs).problem
    assert problem.cache_dtype == "float8_e4m3fn" and "fp8" in problem.features()
    assert problem.cache_bytes() == 2 * 2 * 100 * 2 * 64
    assert problem_limitation(problem) is None
    device = torch.device("cuda", 0)
    if not HAS_CUDA:
        monkeypatch.setitem(get_backend("tilelang")._hopper, 0, True)
    assert select("auto", problem, device, PROFILES["h200"]).name == "triton"


# -- the Triton kernels -----------------------------------------------------------------------------------

FEATURES = {
    "plain": dict(),
    "lengths": dict(batch=4, lengths=[0, 1, 65, 100]),
    "e5m2": dict(fp8=torch.float8_e5m2, seqlen_new=3),
    "head-descale": dict(descale="head", seqlen_new=2),
    "number-descale": dict(descale="number"),
    "no-descale": dict(descale=None, seqlen_new=2),
    "paged4": dict(page_size=4, lengths=[100, 33]),
    "paged32": dict(page_size=32, seqlen_new=5, lengths=[60, 33]),
    "append": dict(seqlen_new=20, lengths=[80, 7]),
    "rotary": dict(seqlen_new=6, rotary_dim=32, lengths=[70, 15]),
    "causal": dict(seqlen_q=3, causal=True, seqlen_new=3, lengths=[97, 2]),
    "window": dict(seqlen_q=4, window=(20, 3), lengths=[100, 30]),
    "softcap": dict(softcap=0.7, seqlen_new=4, lengths=[90, 44]),
    "alibi": dict(alibi=True, seqlen_q=2, causal=True),
    "leftpad": dict(leftpad=[37, 16], lengths=[100, 30]),
    "batch-idx": dict(batch_idx=True, seqlen_new=4, lengths=[96, 7]),
    "head-dim-59": dict(headdim=59, seqlen_new=3, rotary_dim=32, lengths=[90, 12]),
    "rows-64": dict(group=4, seqlen_q=16, capacity=200, lengths=[190, 77]),  # a 64-row tile (head dim 64)
    "everything": dict(page_size=4, seqlen_new=5, seqlen_q=5, rotary_dim=32, causal=True, window=(9, -1),
                       softcap=1.5, alibi=True, leftpad=[3, 0], lengths=[70, 5], fp8=torch.float8_e5m2),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("num_splits", [0, 3])
def test_triton_matches_the_reference(feature, num_splits):
    call = make_call(**FEATURES[feature])
    assert_matches(run(call, "triton", num_splits), expected(call))


#: fp8 V read as 16-bit words (``TritonConfig.fp8_v_words``, Hopper's default) and the plain cast;
#: under the interpreter the words' inline assembly is replaced by integer ops with the same values
#: (``attend.fp8_bits_to_f16``). Every feature, and longer caches whose main loop takes several blocks.
FP8_V_FEATURES = {**FEATURES, "long-d128": dict(capacity=700, headdim=128, group=4, lengths=[700, 389]),
                  "long-d80-e5m2-pages": dict(capacity=512, headdim=80, page_size=16, fp8=torch.float8_e5m2)}


def run_fp8_v(call, words, num_splits):
    """``run`` on Triton with the plan's own tile config but ``fp8_v_words`` = ``words`` (on a GPU
    not in tiles the default steers off words: there Triton miscompiles them, which
    ``tests/test_triton_workarounds.py`` checks)."""
    q, k_cache, v_cache, kwargs = call
    config = plan_for(q, k_cache, v_cache, **kwargs, num_splits=num_splits, backend="triton").plan.config
    if words and HAS_CUDA and config.block_m > FP8_V_WORDS_MAX_BLOCK_M:
        pytest.skip(f"a {config.block_m}-row tile: Triton miscompiles fp8 V words there (workarounds)")
    return run(call, "triton", num_splits, DecodeContext(DEVICE, config=dataclasses.replace(config, fp8_v_words=words)))


@pytest.mark.parametrize("words", [False, True], ids=["cast", "words"])
@pytest.mark.parametrize("feature", slow_except(list(FP8_V_FEATURES),
                                                ("plain", "lengths", "e5m2", "paged4", "long-d128",
                                                 "long-d80-e5m2-pages", "everything")))
@pytest.mark.parametrize("num_splits", [0, 3])
def test_fp8_v_words_and_cast_match_the_reference(words, feature, num_splits):
    call = make_call(**FP8_V_FEATURES[feature])
    assert_matches(run_fp8_v(call, words, num_splits), expected(call))


@pytest.mark.parametrize("layout", ["aligned", "offset-8-bytes", "odd-strides"])
def test_fp8_v_words_fall_back_to_the_cast_where_v_is_not_aligned(monkeypatch, layout):
    """A V cache whose words would straddle elements (odd strides) or that is not 16-byte aligned
    (the host path's key) takes the cast; both match the reference."""
    from flashdecode.kernels.triton.backend import TritonBackend

    q, k_cache, v_cache, kwargs = call = make_call(capacity=300, headdim=64)
    room = {"aligned": 0, "offset-8-bytes": 16, "odd-strides": 1}[layout]
    store = torch.zeros(*v_cache.shape[:-1], v_cache.shape[-1] + room, dtype=v_cache.dtype, device=DEVICE)
    v_view = store[..., 8:8 + v_cache.shape[-1]] if layout == "offset-8-bytes" else store[..., :v_cache.shape[-1]]
    v_view.copy_(v_cache)
    words = []
    launches = TritonBackend.launches

    def recording(self, plan, problem, args):
        result = launches(self, plan, problem, args)
        words.append(result[0][4]["FP8_V_WORDS"])
        return result

    monkeypatch.setattr(TritonBackend, "launches", recording)
    config = plan_for(q, k_cache, v_view, **kwargs, backend="triton").plan.config
    context = DecodeContext(DEVICE, config=dataclasses.replace(config, fp8_v_words=True))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_view, **kwargs, return_softmax_lse=True, backend="triton",
                                       context=context)
    assert words == [layout == "aligned"]
    assert_matches((out, lse, k_cache, v_view), expected(call))


@triton.jit
def _fp8_bits_kernel(X, Out, E5M2: tl.constexpr):
    offsets = tl.arange(0, 256)
    tl.store(Out + offsets, fp8_bits_to_f16(tl.load(X + offsets), E5M2))


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_fp8_bits_to_f16_is_the_conversion(fp8):
    """The integer conversion that stands for fp8_v_words' inline assembly under the interpreter gives
    torch's float16 of every fp8 byte, NaN for NaN (e4m3: 0x7f, 0xff; e5m2: its NaNs and infs)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.int16)
    got = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _fp8_bits_kernel[(1,)](bits.to(DEVICE), got, E5M2=fp8 == torch.float8_e5m2)
    want = torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float16)
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))  # -0.0


#: Features whose appended keys are rotated: in bfloat16 the interpreter truncates them where torch
#: rounds (the GPU tier covers them).
ROTATED = ("rotary", "head-dim-59", "everything")


@pytest.mark.parametrize("feature", slow_except([name for name in FEATURES if name not in ROTATED],
                                                ("plain", "append", "softcap")))
def test_bfloat16_q_matches_the_reference(feature):
    """A bfloat16 q is converted to float16 for the products (``attend.fp16_rows``), split or not."""
    call = make_call(**FEATURES[feature], dtype=torch.bfloat16)
    assert_matches(run(call, "triton", 3), expected(call))


@pytest.mark.parametrize("changes", [dict(), dict(softcap=0.7, seqlen_new=4, lengths=[90, 44])],
                         ids=["plain", "softcap-append"])
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # the softcap's tanh of huge scores: 1
def test_bfloat16_q_rows_past_float16s_range(changes, num_splits):
    """bfloat16 q rows whose values pass float16's largest (65504), up to 1e30, give the reference's
    output and lse, no inf or NaN: each row goes into float16 scaled by a power of two that its
    scores undo (``attend.fp16_rows``); without it they would be inf."""
    q, k_cache, v_cache, kwargs = make_call(dtype=torch.bfloat16, **changes)
    for (sequence, head), largest in {(0, 1): 1e6, (1, 4): 6e4, (1, 0): 1e30}.items():
        q[sequence, :, head] *= largest / q[sequence, :, head].float().abs().max()
    call = (q, k_cache, v_cache, kwargs)
    assert_matches(run(call, "triton", num_splits), expected(call), lse_relative=1e-5)


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_error_within_twice_a_16_bit_calls(fp8):
    """The accuracy rule: the fp8 call's error against the float32 reference on the dequantised cache
    is within 2x the error of the same call in q's dtype on that cache rounded to q's dtype (float16
    here; bfloat16 on the GPU)."""
    call = make_call(batch=3, capacity=300, lengths=[300, 157, 33], fp8=fp8, seed=3)
    q, k_cache, v_cache, kwargs = call
    want, _, _, _ = expected(call)
    scales = kwargs["k_descale"][:, None, :, None]
    narrow = {name: value for name, value in kwargs.items() if name not in ("k_descale", "v_descale")}
    sixteen, _ = flash_attn_with_kvcache(q, (k_cache.float() * scales).to(q.dtype),
                                         (v_cache.float() * scales).to(q.dtype), **narrow,
                                         return_softmax_lse=True, backend="triton")
    out, _, _, _ = run(call, "triton")
    assert relative_error(out, want) <= 2 * relative_error(sixteen, want)


#: Compiles the Triton kernels of fp8 plans for sm_90a (Triton's own ptxas, no GPU) and prints, per
#: launch, the fp8 conversions in its PTX and cuobjdump's resource line (None without cuobjdump).
COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, "tools")
    from triton_resources import CUOBJDUMP, compile_for_hopper, plan_launches, resource_usage
    from flashdecode.hardware import PROFILES
    from flashdecode.kernels import get_backend
    from flashdecode.kernels.triton.launch import _without_ceiling
    from flashdecode.planner import plan
    from flashdecode.problem import Problem
    problems = {
        "case 7": Problem(64, 2048, 32, 8, 128, "bfloat16", cache_dtype="float8_e4m3fn"),
        "pages of 16, e5m2, float16": Problem(16, 4096, 32, 8, 128, "float16", page_size=16, offsets_32=True,
                                              cache_dtype="float8_e5m2"),
        "append, rotary, window, softcap": Problem(4, 2048, 16, 4, 128, "bfloat16", seqlen_q=4, seqlen_new=4,
                                                   rotary_dim=64, window_left=100, window_right=0, softcap=True,
                                                   cache_dtype="float8_e4m3fn"),
    }
    found = {}
    for name, problem in problems.items():
        the_plan = plan(problem, PROFILES["h200"], get_backend("triton"))
        for index, (kernel, _, tensors, scalars, constexprs, options) in enumerate(plan_launches(problem, the_plan)):
            compiled = compile_for_hopper(kernel, tensors, scalars, constexprs, _without_ceiling(options))
            conversions = sorted({line.split()[0] for line in compiled.asm["ptx"].splitlines()
                                  if line.strip().startswith("cvt") and ("e4m3" in line or "e5m2" in line)})
            found[f"{name} {index}"] = [conversions, resource_usage(compiled) if os.path.exists(CUOBJDUMP) else None]
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_fp8_kernels_compile_for_hopper():
    """The fp8 plans' kernels compile for sm_90a: the split kernels convert fp8 pairs to float16 in
    registers (cvt ...f16x2.e4m3x2 / e5m2x2), the appending one also stores with the saturating
    conversion (exact there: the value is on the grid already), and none spills (no stack)."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=pathlib.Path(__file__).resolve().parents[1],
                          env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["case 7 0"][0] == ["cvt.rn.f16x2.e4m3x2"]
    assert found["pages of 16, e5m2, float16 0"][0] == ["cvt.rn.f16x2.e5m2x2"]
    assert found["append, rotary, window, softcap 0"][0] == ["cvt.rn.f16x2.e4m3x2", "cvt.rn.satfinite.e4m3x2.f32"]
    for name, (_, resources) in found.items():
        assert resources is None or "STACK:0" in resources.replace(" ", ""), (name, resources)


# -- the benchmark's fp8 variant and FlashInfer's fp8 decode ---------------------------------------------

SMALL = cases.Case(0, 3, 40, 2, 4, 64, lengths="uniform")


def test_fp8_variant_is_the_plain_cache_quantised():
    """The ``fp8`` variant: the plain call's cache in e4m3 with one amax / 448 descale in every KV head,
    1 byte a K/V element in the bytes moved, and a reference close to the plain call's."""
    plain = cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float32)
    fp8 = cases.make_call(SMALL, cases.VARIANTS["fp8"], dtype=torch.float32)
    assert fp8.k_cache.dtype == torch.float8_e4m3fn and fp8.k_descale.shape == (SMALL.nheads_k,)
    torch.testing.assert_close(fp8.k_descale, (plain.k_cache.abs().amax() / 448).expand(2))
    assert fp8.k_cache.float().abs().max() == 448  # the largest element lands on the range's end
    assert cases.VARIANTS["fp8"].problem(SMALL).cache_dtype == "float8_e4m3fn"
    row = SMALL.nheads_k * 64
    assert plain.bytes_moved() - fp8.bytes_moved() == sum(fp8.lengths) * row * 2 * (4 - 1)
    want = reference_attention(plain.q, plain.k_cache, plain.v_cache, cache_seqlens=plain.cache_seqlens)[0]
    got = reference_attention(fp8.q, fp8.k_cache, fp8.v_cache, **fp8.kwargs())[0]
    assert 0 < relative_error(got, want) < 0.1


def _fake_flashinfer_fp8(scales):
    """A stand-in flashinfer whose decode wrapper records the kv dtype it is planned with and the
    scales it runs with, and dequantises as FlashInfer does (scores by k_scale, output by v_scale)."""
    module = types.ModuleType("flashinfer")

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                     paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
            self.buffers = paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer

        def plan(self, indptr, indices, last, nheads, nheads_k, headdim, page_size, q_data_type, kv_data_type):
            scales["kv_data_type"], self.page_size = kv_data_type, page_size

        def run(self, q, caches, k_scale=None, v_scale=None):
            scales.update(k_scale=k_scale, v_scale=v_scale)
            indptr, indices, last = (t.tolist() for t in self.buffers)
            outs = []
            for b in range(q.shape[0]):
                pages = indices[indptr[b]:indptr[b + 1]]
                length = (len(pages) - 1) * self.page_size + last[b]
                k, v = (cache[pages].flatten(0, 1)[:length].float() for cache in caches)
                outs.append(reference_attention(q[b][None, None], k[None] * k_scale, v[None] * v_scale)[0][0, 0])
            return torch.stack(outs)

    module.BatchDecodeWithPagedKVCacheWrapper = Wrapper
    return module


def test_flashinfer_fp8_decode_is_the_fp8_variants_peer(monkeypatch):
    """FlashInfer's wrapper is planned with the fp8 kv dtype and run with the descales as its float
    k_scale/v_scale; calls with per-head descales of several values, and the other peers, say why not."""
    scales = {}
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer_fp8(scales))
    call = cases.make_call(SMALL, cases.VARIANTS["fp8"], dtype=torch.float32)
    peer = peers.PEERS["flashinfer-tc"]
    assert peer.limitation(call) is None
    out = peer.setup([call])[0]()
    assert scales == dict(kv_data_type=torch.float8_e4m3fn, k_scale=float(call.k_descale[0]),
                          v_scale=float(call.v_descale[0]))
    want = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())[0]
    assert relative_error(out, want) < 1e-6
    call.k_descale = torch.tensor([0.5, 0.25])
    assert "one float k_scale" in peer.limitation(call)
    for name in ("fa2", "sdpa", "flex"):
        assert "fp8" in peers.PEERS[name].limitation(call), name


# -- GPU tier ---------------------------------------------------------------------------------------------

#: The features of ``FEATURES`` TileLang's kernels take (``test_tilelang_takes_the_listed_features``).
TILELANG_FEATURES = ["plain", "lengths", "e5m2", "head-descale", "number-descale", "no-descale", "paged32",
                     "append", "causal", "window", "softcap", "leftpad", "rows-64"]


def test_tilelang_takes_the_listed_features():
    taken = []
    for name, features in FEATURES.items():
        q, k_cache, v_cache, kwargs = make_call(**features)
        if problem_limitation(plan_for(q, k_cache, v_cache, **kwargs, backend="reference").problem) is None:
            taken.append(name)
    assert taken == TILELANG_FEATURES


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend,feature", [(backend, feature) for backend in ("triton", "auto")
                                             for feature in FEATURES]
                         + [("tilelang", feature) for feature in TILELANG_FEATURES])
def test_fp8_on_the_gpu(backend, feature, dtype):
    call = make_call(**FEATURES[feature], dtype=dtype)
    tolerance = OUT_TOLERANCE if dtype == torch.float16 else 1e-2  # out rounded to bfloat16: 8x float16's step
    assert_matches(run(call, backend), expected(call), tolerance, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("words", [False, True], ids=["cast", "words"])
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("feature", FP8_V_FEATURES)
def test_fp8_v_words_and_cast_on_the_gpu(feature, num_splits, words, dtype):
    call = make_call(**FP8_V_FEATURES[feature], dtype=dtype)
    tolerance = OUT_TOLERANCE if dtype == torch.float16 else 1e-2
    assert_matches(run_fp8_v(call, words, num_splits), expected(call), tolerance, 1e-2)


#: TileLang's kernels on caches of several tiles (``FEATURES``' 100 keys mostly take its short-cache
#: kernel): the split kernel's pipeline of 1-byte tiles (contiguous, pages of a tile, pages gathered
#: into a tile, the wide-head tile), appended tokens in its tail, masks and softcap.
TILELANG_SPLIT_FEATURES = {
    "e4m3": dict(capacity=1000, headdim=128, group=4),
    "e5m2-append-pages-64": dict(capacity=1024, headdim=128, group=4, page_size=64, seqlen_new=3,
                                 fp8=torch.float8_e5m2),
    "pages-16": dict(capacity=512, headdim=128, group=8, page_size=16, descale="head"),
    "d256": dict(capacity=1000, headdim=256, group=4),
    "d64-window-softcap": dict(capacity=700, headdim=64, seqlen_q=3, causal=True, window=(50, 0), softcap=0.7),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("feature", TILELANG_SPLIT_FEATURES)
def test_tilelang_fp8_split_kernels_on_the_gpu(feature, num_splits, dtype):
    call = make_call(**TILELANG_SPLIT_FEATURES[feature], dtype=dtype)
    tolerance = OUT_TOLERANCE if dtype == torch.float16 else 1e-2
    assert_matches(run(call, "tilelang", num_splits), expected(call), tolerance, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case_number", range(1, 15))
def test_benchmark_cases_in_e4m3_keep_the_accuracy_rule(case_number):
    """The 14 benchmark cases with an e4m3 cache and per-head descales (the bench's ``fp8`` variant):
    the error against the reference on the dequantised cache is within 2x the bf16 call's on it."""
    from flashdecode.cases import CASES, VARIANTS, make_call as make_case_call

    call = make_case_call(CASES[case_number - 1], VARIANTS["fp8"], "cuda")
    want, _ = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())
    k_wide, v_wide = call.k_cache.float() * call.k_descale[:, None], call.v_cache.float() * call.v_descale[:, None]
    bf16 = flash_attn_with_kvcache(call.q, k_wide.to(call.q.dtype), v_wide.to(call.q.dtype),
                                   cache_seqlens=call.cache_seqlens)
    out = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs())
    live = call.cache_seqlens.cpu() > 0
    assert relative_error(out[live], want[live]) <= 2 * relative_error(bf16[live], want[live])


@pytest.mark.gpu
@pytest.mark.parametrize("descale", ["table", "head", "tensor", "number", None])
def test_fp8_repeats_take_the_compiled_host_path(descale):
    """An fp8 call repeats through the compiled host path with the same result, whatever form its
    descales take (one tensor for both here): tensors are keyed by metadata and patched per call, so
    new values in a new tensor hit with the Python path's result; a number is keyed by value, so
    another number misses."""
    q, k_cache, v_cache, kwargs = make_call(descale=descale, dtype=torch.bfloat16)
    first = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    host = default_context(q).host_path
    if host is None:
        pytest.skip(default_context(q).host_path_off_because)
    hits = host.hits
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs), first) and host.hits == hits + 1
    if descale is None:
        return
    doubled = kwargs["k_descale"] * 2
    scaled = dict(kwargs, k_descale=doubled, v_descale=doubled)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, **scaled)
    assert torch.equal(got, flash_attn_with_kvcache(q, k_cache, v_cache, **scaled, context=DecodeContext()))
    assert not torch.equal(got, first)
    assert host.hits == hits + (1 if descale == "number" else 2)


def test_loop_floor_tables_read_the_same_pages_one_way_from_l2(monkeypatch):
    """tools/loop_floor.py: its L2 table cycles over the resident pages, its DRAM table is every
    page once, and both calls (fp8, a tile of its own on Triton's interpreter) agree with the
    reference; without a GPU the times are NaN."""
    monkeypatch.setattr(sys, "path", ["tools", *sys.path])
    import loop_floor

    case = cases.CASES_BY_LABEL["3"]
    call, tables = loop_floor.paged_call(case, "float8_e4m3fn", page_size=8, resident_pages=5, device="cpu")
    assert call.k_cache.dtype == torch.float8_e4m3fn and call.k_descale is not None
    assert sorted(tables["dram"].flatten().tolist()) == list(range(call.k_cache.shape[0]))
    assert set(tables["l2"].flatten().tolist()) == set(range(5))
    report = loop_floor.main(["--cases", "3", "--kv", "float8_e4m3fn", "--page-size", "8", "--resident-pages", "5",
                              "--block-n", "32", "--device", "cpu"])
    row = report.splitlines()[-1].split("|")
    assert row[1].strip() == "3" and row[4].strip() == "nan" and float(row[7]) < 2e-2
