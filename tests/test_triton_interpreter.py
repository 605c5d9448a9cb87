"""The Triton backend against ``flashdecode.reference.reference_attention``, feature by feature, on
CPU tensors under TRITON_INTERPRET=1 (CUDA tensors on a GPU).

Most calls go through the public ``flash_attn_with_kvcache``; those that need what it does not allow
(a small tile config so short caches span many blocks and splits, float32, values the public call
rejects) launch the backend with a plan from ``flashdecode.plan_for`` / ``planner.plan``. Triton's
interpreter computes bfloat16 wrongly (it has no bf16 numpy type), so these use float16 and float32.

Tolerances: the kernel rounds P to the input dtype before the PV product and accumulates in float32,
so its relative L2 error against the float32 reference is ~1e-3; we allow 5e-3. A real bug (a block
read twice or skipped, a wrong row or head, a mask off by one, a token not rotated) moves the output
of these unit-variance inputs far more, and the lse by more than its 2e-3.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import HAS_CUDA, slow_except
from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.hardware import PROFILES, profile_for
from flashdecode.kernels.base import LaunchArgs
from flashdecode.kernels.triton.backend import TritonBackend, TritonConfig
from flashdecode.kernels.triton.launch import REGISTER_CEILING
from flashdecode.planner import SINGLE_PASS, SPLIT, key_range, plan
from flashdecode.problem import Problem
from flashdecode.reference import reference_attention, relative_error

DEVICE = "cuda" if HAS_CUDA else "cpu"
OUT_TOLERANCE = 5e-3
LSE_TOLERANCE = 2e-3
#: Short caches span many blocks and splits: 16-key blocks, 16-row tiles, 2 partials per combine step.
SMALL = TritonConfig(block_n=16, block_m=16, num_warps=4, num_stages=2, combine_step=2)
BACKEND = TritonBackend()


@dataclasses.dataclass
class Call:
    """One call's arguments: q, the caches, and the keyword arguments of flash_attn_with_kvcache."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kwargs: dict


def make_call(batch=2, capacity=100, nheads_k=2, group=3, headdim=64, seqlen_q=1, lengths=None, page_size=0,
              seqlen_new=0, rotary_dim=0, interleaved=False, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              leftpad=None, batch_idx=False, dtype=torch.float16, seed=0) -> Call:
    """Random inputs (never zeros). Paged caches hold ``capacity`` tokens per sequence in shuffled
    pages (3 spare); ``batch_idx`` gives 2 spare cache rows in shuffled order; ``lengths`` default
    to the capacity minus the appended tokens, then 5 fewer per sequence."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    def index(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    if page_size:
        max_blocks = -(-capacity // page_size)
        pages = batch * max_blocks + 3
        k_cache, v_cache = randn(pages, page_size, nheads_k, headdim), randn(pages, page_size, nheads_k, headdim)
        order = torch.randperm(pages, generator=generator)[:batch * max_blocks]
        kwargs["block_table"] = index(order.view(batch, max_blocks).tolist())
        capacity = max_blocks * page_size
    else:
        rows = batch + 2 if batch_idx else batch
        k_cache, v_cache = randn(rows, capacity, nheads_k, headdim), randn(rows, capacity, nheads_k, headdim)
        if batch_idx:
            kwargs["cache_batch_idx"] = index(torch.randperm(rows, generator=generator)[:batch].tolist())
    if lengths is None:
        lengths = [max(0, capacity - seqlen_new - 5 * b) for b in range(batch)]
    kwargs["cache_seqlens"] = index(lengths)
    if seqlen_new:
        kwargs.update(k=randn(batch, seqlen_new, nheads_k, headdim), v=randn(batch, seqlen_new, nheads_k, headdim))
    if rotary_dim:
        frequencies = 1.0 / 10000 ** (torch.arange(rotary_dim // 2) / (rotary_dim // 2))
        angles = torch.arange(capacity)[:, None] * frequencies[None, :]
        kwargs.update(rotary_cos=angles.cos().to(dtype).to(DEVICE), rotary_sin=angles.sin().to(dtype).to(DEVICE),
                      rotary_interleaved=interleaved)
    nheads = nheads_k * group
    if alibi == "head":
        kwargs["alibi_slopes"] = torch.rand(nheads, generator=generator).to(DEVICE)
    elif alibi == "sequence":
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, generator=generator).to(DEVICE)
    if leftpad is not None:
        kwargs["cache_leftpad"] = index(leftpad)
    return Call(randn(batch, seqlen_q, nheads, headdim), k_cache, v_cache, kwargs)


def reference(call: Call):
    """(out, lse, k_cache, v_cache) of the reference, on copies of the caches."""
    k_cache, v_cache = call.k_cache.clone(), call.v_cache.clone()
    out, lse = reference_attention(call.q, k_cache, v_cache, **call.kwargs)
    return out, lse, k_cache, v_cache


def through_api(call: Call, num_splits=0, **extra):
    """(out, lse, k_cache, v_cache) of the public call with backend "triton", on copies of the caches."""
    k_cache, v_cache = call.k_cache.clone(), call.v_cache.clone()
    out, lse = flash_attn_with_kvcache(call.q, k_cache, v_cache, **call.kwargs, num_splits=num_splits,
                                       return_softmax_lse=True, backend="triton", **extra)
    return out, lse, k_cache, v_cache


def through_backend(call: Call, num_splits=0, config=SMALL, problem=None, merge=False, **replaced):
    """(out, lse, k_cache, v_cache) of ``TritonBackend.launch`` with a plan of ``config``; ``replaced``
    swaps index tensors after the call was validated (values the public call rejects). ``merge``: the
    split kernel merges the partials itself (``Plan.merge_in_split``), twice on the same counters,
    which must be back at zero after each launch; otherwise a split plan runs the combine kernel."""
    if problem is None:
        problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, num_splits=num_splits,
                           backend="triton").problem
    chosen = plan(problem, PROFILES["h200"], BACKEND, num_splits, config=config)
    if merge and chosen.kernel != SPLIT:
        pytest.skip("nothing to merge: the plan does not split")
    if chosen.kernel == SPLIT:  # the combine kernel unless ``merge``, whatever the tuning allows
        chosen = dataclasses.replace(chosen, merge_in_split=merge)
    tickets = torch.zeros(chosen.ticket_count(problem), dtype=torch.int32, device=DEVICE) if merge else None
    kwargs = dict(call.kwargs, **replaced)
    out = torch.empty_like(call.q)
    lse = torch.empty(problem.batch, problem.nheads, problem.seqlen_q, device=DEVICE)
    rows = problem.nheads_k * problem.q_rows
    part_o = torch.empty(chosen.workspace_rows, rows, problem.headdim, device=DEVICE)
    part_lse = torch.empty(chosen.workspace_rows, rows, device=DEVICE)
    for _ in range(2 if merge else 1):
        k_cache, v_cache = call.k_cache.clone(), call.v_cache.clone()
        out.fill_(7.0)
        BACKEND.launch(chosen, problem, LaunchArgs(
            call.q, k_cache, v_cache, kwargs["cache_seqlens"], out, lse, part_o, part_lse, problem.headdim ** -0.5,
            kwargs["softcap"], kwargs.get("k"), kwargs.get("v"), kwargs.get("rotary_cos"), kwargs.get("rotary_sin"),
            kwargs.get("cache_batch_idx"), kwargs.get("cache_leftpad"), kwargs.get("block_table"),
            kwargs.get("alibi_slopes"), tickets))
        assert tickets is None or not tickets.any()
    return out, lse, k_cache, v_cache


def assert_matches(got, expected, sequences=slice(None)):
    """out and lse of ``sequences`` within tolerance (rows that see no key: exactly 0 and -inf), and
    the caches after the call exactly equal."""
    out, lse, k_cache, v_cache = got
    want_out, want_lse, want_k, want_v = expected
    out, lse, want_out, want_lse = out[sequences], lse[sequences], want_out[sequences], want_lse[sequences]
    assert out.shape == want_out.shape and out.dtype == want_out.dtype and lse.shape == want_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()
    if not empty.all():
        assert relative_error(out, want_out) < OUT_TOLERANCE
        torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=LSE_TOLERANCE, rtol=0)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# -- plain decode through the public call (default tiles: 64-key blocks) -----------------------------

SHAPES = [  # (batch, capacity, nheads_k, group, headdim, lengths)
    (4, 130, 2, 3, 64, [0, 1, 63, 130]),
    (3, 129, 1, 8, 32, [64, 65, 129]),
    (2, 70, 2, 1, 59, [70, 5]),
    (2, 70, 1, 3, 80, [1, 69]),
]


@pytest.mark.parametrize("shape", slow_except(SHAPES, SHAPES[:1]), ids=lambda s: "b{}-s{}-hk{}-g{}-d{}".format(*s[:5]))
@pytest.mark.parametrize("num_splits", [0, 3])
def test_plain_decode(shape, num_splits):
    batch, capacity, nheads_k, group, headdim, lengths = shape
    call = make_call(batch, capacity, nheads_k, group, headdim, lengths=lengths)
    assert_matches(through_api(call, num_splits), reference(call))


# -- every feature, 16-key blocks so that short caches cross blocks and splits ------------------------

FEATURES = {
    "lengths": dict(batch=6, lengths=[0, 1, 15, 16, 17, 100]),
    "paged1": dict(page_size=1, capacity=40, lengths=[40, 23]),
    "paged4": dict(page_size=4, lengths=[100, 33]),
    "paged16": dict(page_size=16, lengths=[95, 16]),
    "paged32": dict(page_size=32, lengths=[96, 47]),
    "append1": dict(seqlen_new=1, lengths=[99, 0]),
    "append20": dict(seqlen_new=20, lengths=[80, 7]),
    "append-full": dict(seqlen_new=3, lengths=[97, 13]),
    "rotary": dict(seqlen_new=18, rotary_dim=32, lengths=[70, 15]),
    "rotary-interleaved": dict(seqlen_new=2, rotary_dim=64, interleaved=True),
    "rotary-causal-rows": dict(seqlen_new=4, seqlen_q=4, rotary_dim=16, causal=True, lengths=[60, 0]),
    "causal": dict(seqlen_q=3, causal=True, lengths=[100, 2]),
    "window": dict(seqlen_q=4, window=(20, 3), lengths=[100, 30]),
    "window-left": dict(window=(33, -1), lengths=[100, 30]),
    "window-right": dict(seqlen_q=2, window=(-1, 5), lengths=[100, 30]),
    "window-zero": dict(seqlen_q=4, window=(0, 0), lengths=[100, 30]),
    "softcap": dict(softcap=0.7, lengths=[100, 44]),
    "alibi-head": dict(alibi="head", seqlen_q=2, causal=True),
    "alibi-sequence": dict(alibi="sequence", lengths=[31, 90]),
    "leftpad": dict(leftpad=[37, 16], lengths=[100, 30]),
    "leftpad-at-length": dict(leftpad=[30, 0], lengths=[30, 30]),
    "leftpad-hides-rows": dict(leftpad=[49, 0], seqlen_q=4, causal=True, lengths=[50, 9]),
    "batch-idx": dict(batch_idx=True, seqlen_new=4, lengths=[96, 7]),
    "head-dim-59": dict(headdim=59, seqlen_new=3, rotary_dim=32, lengths=[90, 12]),
    "head-dim-32-group-1": dict(headdim=32, group=1, lengths=[90, 12]),
    "head-dim-80-group-8": dict(headdim=80, group=8, seqlen_q=2, lengths=[90, 12]),
    "row-tiles": dict(group=8, seqlen_q=5, seqlen_new=5, causal=True, lengths=[60, 20]),
    "everything": dict(page_size=4, seqlen_new=5, seqlen_q=5, rotary_dim=32, causal=True, window=(9, -1),
                       softcap=1.5, alibi="sequence", leftpad=[3, 0], lengths=[70, 5]),
}


#: The plan kinds a feature runs under: (num_splits, merged in the split kernel).
PLAN_KINDS = {"auto": (0, False), "split": (3, False), "merge": (3, True)}
#: Each feature under one plan kind, in turn (every kind meets a third of the features); "everything"
#: under all three in the fast tier.
FEATURE_PLANS = [("everything", kind) for kind in PLAN_KINDS] + [
    (feature, list(PLAN_KINDS)[index % len(PLAN_KINDS)]) for index, feature in enumerate(FEATURES)
    if feature != "everything"]


@pytest.mark.parametrize("feature, kind", slow_except(FEATURE_PLANS, FEATURE_PLANS[:3], several=True),
                         ids=[f"{kind}-{feature}" for feature, kind in FEATURE_PLANS])
def test_feature(feature, kind):
    num_splits, merge = PLAN_KINDS[kind]
    call = make_call(**FEATURES[feature])
    got = through_backend(call, num_splits, merge=merge)
    assert_matches(got, reference(call))


@pytest.mark.parametrize("feature", slow_except(["paged1", "paged4", "paged32", "everything"], {"paged1"}))
def test_pages_addressed_in_64_bits(feature):
    """Caches of more than 2^31 elements address pages in 64 bits (``Problem.offsets_32`` False):
    the same results as the 32-bit addressing small caches take."""
    call = make_call(**FEATURES[feature])
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton").problem
    assert problem.offsets_32
    wide = dataclasses.replace(problem, offsets_32=False)
    assert_matches(through_backend(call, num_splits=3, problem=wide), reference(call))


@pytest.mark.parametrize("seqlen_q", slow_except([1, 2, 3, 4, 5], {3}))
def test_query_rows(seqlen_q):
    """seqlen_q rows per head packed with the group (r = i * group + g), causal, split."""
    call = make_call(seqlen_q=seqlen_q, causal=True, lengths=[100, 37], seed=seqlen_q)
    assert_matches(through_backend(call, num_splits=3), reference(call))


def test_features_through_the_public_call():
    """The public call's default tiles and schedule on a call that uses most features."""
    call = make_call(capacity=200, page_size=16, seqlen_new=3, seqlen_q=3, rotary_dim=32, causal=True,
                     alibi="head", softcap=2.0, lengths=[197, 70])
    assert_matches(through_api(call, num_splits=2), reference(call))


@pytest.mark.slow
@pytest.mark.parametrize("block_m", [16, 32])
def test_merge_steps(block_m):
    """The merging program takes its partials ``merge_step_for(block_m)`` at a time (4 from tiles of
    16 rows, 2 from 32): sequence 0's 7 splits leave a partial last step for both (windows, where a
    split can hold no key of a row, are in ``test_feature``)."""
    call = make_call(capacity=120, seqlen_q=3, causal=True, lengths=[117, 70], seed=block_m)
    config = dataclasses.replace(SMALL, block_m=block_m)
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, num_splits=7, backend="triton").problem
    assert plan(problem, PROFILES["h200"], BACKEND, 7, config=config).max_splits(problem) == 7
    assert_matches(through_backend(call, num_splits=7, config=config, merge=True), reference(call))


@pytest.mark.parametrize("combine_dims", slow_except([16, 32, 64], {32}))
@pytest.mark.parametrize("feature", slow_except(["lengths", "head-dim-59", "head-dim-80-group-8", "window"],
                                                {"head-dim-59"}))
def test_combine_head_chunks(feature, combine_dims):
    """The combine kernel merging combine_dims head dims a program (padded head dims of 59 and 80
    included, rows no split saw a key of, several query rows): the whole head's results."""
    call = make_call(**FEATURES[feature])
    config = dataclasses.replace(SMALL, combine_dims=combine_dims)
    assert_matches(through_backend(call, num_splits=3, config=config), reference(call))


def test_combine_head_chunk_of_a_whole_small_head():
    """Head dim 8 pads to 16: chunks of 8 dims are the head's size, and the second chunk's dims
    are padding that must not be written."""
    call = make_call(headdim=8, lengths=[100, 37])
    config = dataclasses.replace(SMALL, combine_dims=8)
    assert_matches(through_backend(call, num_splits=3, config=config), reference(call))


@pytest.mark.parametrize("combine_dims", [3, 256])
def test_combine_head_chunk_must_fit_the_head(combine_dims):
    call = make_call(**FEATURES["lengths"])
    with pytest.raises(ValueError, match="combine_dims must be a power of two"):
        through_backend(call, num_splits=3, config=dataclasses.replace(SMALL, combine_dims=combine_dims))


def test_merge_in_split_through_the_public_call():
    """A context whose tuning lets the split kernel merge: its plan merges, repeated calls (new
    lengths, on the context's counters) match the reference, and the counters end at zero."""
    tuning = dataclasses.replace(profile_for(torch.device(DEVICE)).tuning, max_splits_merged_in_split=1000)
    context = DecodeContext(DEVICE, tuning=tuning)
    for seed, lengths in enumerate(([197, 70, 0], [1, 198, 129])):
        call = make_call(batch=3, capacity=200, seqlen_new=2, seqlen_q=2, causal=True, lengths=lengths, seed=seed)
        route = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, num_splits=3, backend="triton",
                         context=context)
        assert route.plan.merge_in_split and not route.plan.needs_combine
        assert_matches(through_api(call, num_splits=3, context=context), reference(call))
        assert not context.workspace.tickets(route.plan, route.problem, torch.device(DEVICE)).any()


def test_counters_left_over_are_caught_by_the_value_checks():
    """With value checks on, a merging call that leaves its ticket counters non-zero (here: left
    over before it) fails with an error naming them and resets them; the next call is right."""
    import flashdecode

    tuning = dataclasses.replace(profile_for(torch.device(DEVICE)).tuning, max_splits_merged_in_split=1000)
    context = DecodeContext(DEVICE, tuning=tuning)
    call = make_call(batch=2, capacity=200, lengths=[197, 70])
    route = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, num_splits=3, backend="triton",
                     context=context)
    counters = context.workspace.tickets(route.plan, route.problem, torch.device(DEVICE))
    counters.fill_(1)
    flashdecode.set_value_checks(True)
    try:
        with pytest.raises(RuntimeError, match="tickets: the split kernel left its ticket counters non-zero"):
            through_api(call, num_splits=3, context=context)
        assert not counters.any()
        assert_matches(through_api(call, num_splits=3, context=context), reference(call))
    finally:
        flashdecode.set_value_checks(False)


def test_float32():
    call = make_call(seqlen_new=3, seqlen_q=2, causal=True, rotary_dim=16, lengths=[97, 20])
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton").problem
    wide = Call(call.q.float(), call.k_cache.float(), call.v_cache.float(),
                dict(call.kwargs, k=call.kwargs["k"].float(), v=call.kwargs["v"].float(),
                     rotary_cos=call.kwargs["rotary_cos"].float(), rotary_sin=call.kwargs["rotary_sin"].float()))
    got = through_backend(wide, num_splits=3, problem=dataclasses.replace(problem, dtype="float32"))
    assert_matches(got, reference(wide))


def test_strided_tensors():
    """q, the caches, k/v and out as views with larger strides (last dimension contiguous)."""
    call = make_call(nheads_k=2, group=2, seqlen_new=2, lengths=[60, 98])
    wide = make_call(nheads_k=4, group=2, headdim=80, seqlen_new=2, seed=1)

    def inside(big, small):  # small's values in a view of big
        view = big[..., :small.shape[-2], :small.shape[-1]]
        view.copy_(small)
        return view

    strided = Call(inside(wide.q, call.q), inside(wide.k_cache, call.k_cache), inside(wide.v_cache, call.v_cache),
                   dict(call.kwargs, k=inside(wide.kwargs["k"], call.kwargs["k"]),
                        v=inside(wide.kwargs["v"], call.kwargs["v"])))
    out = torch.empty(2, 1, 8, 96, dtype=torch.float16, device=DEVICE)[..., :4, :64]
    got = through_api(strided, num_splits=2, out=out)
    assert got[0].data_ptr() == out.data_ptr()
    expected = reference(call)
    assert_matches((got[0], got[1], got[2].contiguous(), got[3].contiguous()), expected)


@pytest.mark.slow
def test_balanced_split_of_skewed_lengths():
    """The planner's own rule (balanced chunks over a long sequence among short ones) and the combine."""
    call = make_call(batch=4, capacity=300, nheads_k=1, group=4, lengths=[300, 3, 64, 0])
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton").problem
    assert plan(problem, PROFILES["h200"], BACKEND, config=SMALL).kernel == SPLIT
    assert_matches(through_backend(call, config=SMALL), reference(call))


@pytest.mark.parametrize("num_splits", slow_except([0, 2], {2}))
def test_nan_in_the_cache_comes_out_as_nan(num_splits):
    """A NaN among a sequence's keys is not mistaken for an empty row, nor weighted away."""
    call = make_call(capacity=130, lengths=[130, 7])
    call.k_cache[0, 5, 0, 0] = float("nan")
    out = through_api(call, num_splits)[0]
    assert out[0, :, :3].isnan().all() and not out[0, :, 3:].isnan().any() and not out[1].isnan().any()


def test_out_without_lse_matches_out_with_it():
    """Without return_softmax_lse the kernels write the lse to the context's sink: out is the same."""
    call = make_call(capacity=130, lengths=[130, 5])
    k_cache, v_cache = call.k_cache.clone(), call.v_cache.clone()
    alone = flash_attn_with_kvcache(call.q, k_cache, v_cache, **call.kwargs, num_splits=3, backend="triton")
    assert torch.equal(alone, through_api(call, num_splits=3)[0])


# -- values out of range: clamped (nothing read or written out of bounds), NaN rows ------------------

BAD_VALUES = {  # make_call arguments, the index tensor, sequence 0's bad value in it, at column 0 unless a
    # fourth entry names another (sequence 1 stays good)
    "length-negative": (dict(), "cache_seqlens", -1),
    "length-past-capacity": (dict(), "cache_seqlens", 101),
    "append-past-capacity": (dict(seqlen_new=3), "cache_seqlens", 99),
    "leftpad-past-length": (dict(leftpad=[0, 3]), "cache_leftpad", 51),
    "leftpad-negative": (dict(leftpad=[0, 3]), "cache_leftpad", -2),
    "batch-idx": (dict(batch_idx=True, seqlen_new=2), "cache_batch_idx", 4),
    "block-id": (dict(page_size=16, seqlen_new=2), "block_table", 2 * 7 + 3),  # first block: past the pages
    "block-id-later-block": (dict(page_size=16, lengths=[100, 40]), "block_table", -5, 5),  # tokens 80-95
    # pages smaller than a block (16): every token looks its page up
    "block-id-small-pages": (dict(page_size=4, lengths=[100, 40]), "block_table", 10 ** 6, 7),  # tokens 28-31
    "block-id-large-pages": (dict(page_size=32, lengths=[100, 40]), "block_table", -1, 2),  # tokens 64-95
    "block-id-last-page": (dict(page_size=4, lengths=[50, 40]), "block_table", -1, 12),  # tokens 48-49 of 48-51
    "block-id-last-large-page": (dict(page_size=32, lengths=[50, 40]), "block_table", -1, 1),  # tokens 32-49
    # rows 0-34 of sequence 0 see no key (left pad 45 of 50, causal): NaN too, after a split's merge
    "batch-idx-rows-without-keys": (dict(batch_idx=True, seqlen_q=40, causal=True, leftpad=[45, 0]),
                                    "cache_batch_idx", 4),
}


#: Every bad value under the split plan; the fast tier's two under the other plan kinds too.
BAD_VALUE_PLANS = [(case, kind) for case in BAD_VALUES for kind in PLAN_KINDS
                   if kind == "split" or case in ("block-id-last-page", "batch-idx")]


@pytest.mark.parametrize("case, kind", slow_except(
    BAD_VALUE_PLANS, {("block-id-last-page", "split"), ("batch-idx", "split")}, several=True),
    ids=[f"{kind}-{case}" for case, kind in BAD_VALUE_PLANS])
def test_bad_value_makes_its_sequence_nan(case, kind):
    num_splits, merge = PLAN_KINDS[kind]
    arguments, name, value, *column = BAD_VALUES[case]
    call = make_call(**{"lengths": [50, 40], **arguments})
    bad = call.kwargs[name].clone()
    bad.view(2, -1)[0, column[0] if column else 0] = value
    got = through_backend(call, num_splits, merge=merge, **{name: bad})
    assert got[0][0].isnan().all()
    expected = reference(call)
    assert_matches(got[:2] + expected[2:], expected, sequences=slice(1, 2))
    k_cache, want = got[2], expected[2]
    if case == "append-past-capacity":  # positions 99, 100, 101: the first is written, the others skipped
        assert torch.equal(k_cache[1], want[1])  # nothing spilled into the next row
        assert torch.equal(k_cache[0, :99], call.k_cache[0, :99])
        assert torch.equal(k_cache[0, 99], call.kwargs["k"][0, 0])
    elif case == "batch-idx":  # sequence 0's row index is bad: it writes nowhere
        row = int(call.kwargs["cache_batch_idx"][1])
        assert torch.equal(k_cache[row], want[row])
        others = [r for r in range(k_cache.shape[0]) if r != row]
        assert torch.equal(k_cache[others], call.k_cache[others])
    else:
        assert torch.equal(k_cache, want) and torch.equal(got[3], expected[3])


@pytest.mark.parametrize("page_size", slow_except([4, 16, 32], {4}))
@pytest.mark.parametrize("num_splits", slow_except([0, 3], {3}))
@pytest.mark.parametrize("keys", slow_except(["lengths", "leftpad", "window"], {"leftpad"}))
def test_block_table_entries_no_key_uses_are_never_read(page_size, num_splits, keys):
    """Serving engines leave the table past a sequence's last page unset, and pages before a left
    pad or a left window may be freed: bad ids there flag nothing."""
    extra = {"lengths": {}, "leftpad": dict(leftpad=[37, 16]), "window": dict(window=(20, -1))}[keys]
    call = make_call(page_size=page_size, lengths=[50, 17], **extra)
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton").problem
    table = call.kwargs["block_table"].clone()
    garbage = torch.tensor([-1, 10 ** 6], dtype=torch.int32).repeat(table.shape[1])
    for seq, length in enumerate(call.kwargs["cache_seqlens"].tolist()):
        leftpad = int(call.kwargs["cache_leftpad"][seq]) if "cache_leftpad" in call.kwargs else 0
        lo, hi = key_range(problem, length, leftpad)
        first, past = lo // page_size, -(-hi // page_size)  # the entries the keys [lo, hi) use
        table[seq, :first] = garbage[:first]
        table[seq, past:] = garbage[:table.shape[1] - past]
    assert_matches(through_backend(call, num_splits, block_table=table), reference(call))


# -- the backend's answers to the planner ---------------------------------------------------------------

def test_default_config():
    h200 = PROFILES["h200"]
    plain = Problem(4, 4096, 32, 8, 128, "float16")
    config = BACKEND.default_config(plain, h200, SPLIT)
    assert config == TritonConfig(block_n=64, block_m=16, num_warps=4, num_stages=2, combine_step=16,
                                  max_registers=128)
    wide = BACKEND.default_config(Problem(1, 4096, 32, 8, 256, "bfloat16"), h200, SINGLE_PASS)
    assert (wide.block_n, wide.num_warps, wide.num_stages, wide.combine_step, wide.combine_dims) == (64, 4, 3, 128, 32)
    assert BACKEND.default_config(Problem(1, 4096, 8, 8, 16, "float16"), h200, SPLIT).combine_dims == 16
    assert BACKEND.default_config(Problem(2, 64, 8, 1, 59, "float16"), h200, SPLIT).block_n == 128
    # a device with less shared memory gets tiles whose stages fit it (C500: 64 KiB)
    small = [BACKEND.default_config(Problem(1, 4096, 8, 8, d, "bfloat16"), PROFILES["c500"], SPLIT).block_n
             for d in (64, 128, 256)]
    assert small == [128, 64, 16]
    assert BACKEND.default_config(Problem(1, 4096, 8, 8, 32, "float16"), h200, SPLIT).block_n == 64
    # pages of any size take the contiguous cache's tile; on Hopper at head dim 128 with a register
    # cap that fits 5 programs an SM (96), unless the 32-row output tile needs the contiguous cap
    tiles = {p: BACKEND.default_config(Problem(4, 4096, 32, 8, 128, "bfloat16", page_size=p), h200, SPLIT)
             for p in (0, 1, 16, 64, 256)}
    assert {dataclasses.replace(tile, max_registers=None) for tile in tiles.values()} == {
        dataclasses.replace(config, max_registers=None)}
    assert [tiles[p].max_registers for p in (0, 1, 16, 64, 256)] == [128, 96, 96, 96, 96]
    caps = [BACKEND.default_config(Problem(4, 4096, 32, heads_k, d, "bfloat16", page_size=16), profile,
                                   SPLIT).max_registers
            for heads_k, d, profile in ((1, 128, h200), (8, 64, h200), (8, 128, PROFILES["c500"]))]
    assert caps == [128, 128, BACKEND.default_config(Problem(4, 4096, 32, 8, 128, "bfloat16"), PROFILES["c500"],
                                                     SPLIT).max_registers]
    # head dim 256: 4 warps up to 32 query rows, 8 for a 64-row tile (its fp32 output past 64 values a thread)
    warps = [BACKEND.default_config(Problem(1, 4096, rows, 1, 256, "bfloat16"), h200, SPLIT).num_warps
             for rows in (8, 32, 64)]
    assert warps == [4, 4, 8]
    rows = [BACKEND.default_config(Problem(2, 64, 64, 8, 64, "float16", seqlen_q=sq), h200, SPLIT).block_m
            for sq in (1, 2, 3, 9)]
    assert rows == [16, 16, 32, 64]  # 8, 16, 24, 72 rows per KV head: up to 64, then row tiles
    with pytest.raises(ValueError, match="kernel must be one of"):
        BACKEND.default_config(plain, h200, "short_cache")


@pytest.mark.parametrize("headdim", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("profile", ["h200", "c500"])
def test_register_cap_lets_the_planned_programs_fit(headdim, rows, profile):
    """The cap leaves room for the resident programs the planner sizes its grid with, and is only
    set where it binds below the compiler's limit and leaves the output tile three quarters of it
    and the output and score tiles half of it."""
    hardware = PROFILES[profile]
    problem = Problem(2, 4096, rows, 1, headdim, "bfloat16")
    config = BACKEND.default_config(problem, hardware, SPLIT)
    threads = hardware.wave_width * config.num_warps
    resident = BACKEND.resident_programs(problem, config, hardware)
    share = hardware.registers_per_multiprocessor // (resident * threads) // 8 * 8  # registers a thread may have
    if config.max_registers is None:
        assert (share >= hardware.max_registers_per_thread or config.block_m * max(16, headdim) * 4 > threads * share
                or config.block_m * (max(16, headdim) + config.block_n) * 2 > threads * share)
    else:
        assert config.max_registers % 8 == 0 and config.max_registers < hardware.max_registers_per_thread
        assert resident * threads * config.max_registers <= hardware.registers_per_multiprocessor
        assert config.block_m * max(16, headdim) <= threads * config.max_registers // 4
        assert config.block_m * (max(16, headdim) + config.block_n) <= threads * config.max_registers // 2
    q = torch.empty(2, 1, rows, headdim, dtype=torch.bfloat16)
    cache = torch.empty(2, 4096, 1, headdim, dtype=torch.bfloat16)
    chosen = plan(problem, hardware, BACKEND, num_splits=2)
    args = LaunchArgs(q, cache, cache, torch.empty(2, dtype=torch.int32), torch.empty_like(q),
                      torch.empty(2, rows, 1), torch.empty(4, rows, headdim), torch.empty(4, rows), 0.1,
                      tickets=torch.zeros(chosen.ticket_count(problem), dtype=torch.int32))
    split_launch = BACKEND.launches(chosen, problem, args)[0]
    assert split_launch[5].get(REGISTER_CEILING) == config.max_registers  # absent where there is none


def test_resident_programs_and_kernels():
    h200 = PROFILES["h200"]
    counts = [BACKEND.resident_programs(Problem(1, 64, 8, 1, d, "float16"), None, h200) for d in (32, 59, 128, 256)]
    assert counts == [4, 4, 4, 1]
    assert BACKEND.kernels(Problem(1, 64, 8, 1, 64, "float16")) == {SINGLE_PASS, SPLIT}


def test_limitation():
    problem = Problem(1, 64, 8, 1, 64, "float16")
    assert BACKEND.limitation(problem, torch.device("cuda", 0)) is None
    assert BACKEND.limitation(problem, torch.device("meta")) == "a CUDA device, or TRITON_INTERPRET=1 for CPU tensors"
    if not HAS_CUDA:  # the interpreter is on (conftest)
        assert BACKEND.limitation(problem, torch.device("cpu")) is None


def test_plan_grid_has_row_tiles():
    problem = Problem(2, 64, 72, 8, 64, "float16", seqlen_q=9)  # 81 rows per KV head
    chosen = plan(problem, profile_for(torch.device(DEVICE)), BACKEND)
    assert chosen.grid(problem) == (2, 8, 2)


@pytest.mark.parametrize("seqlen_q, merge_step", [(1, 4), (4, 2)])
def test_merge_step_by_row_tile(seqlen_q, merge_step):
    """A merging program loads 4 partials at a time from tiles of 16 rows, 2 from 32 (4 spill there)."""
    problem = Problem(4, 4096, 8, 1, 128, "float16", seqlen_q=seqlen_q)
    chosen = plan(problem, PROFILES["h200"], BACKEND, 3)
    assert chosen.merge_in_split
    q = torch.empty(4, seqlen_q, 8, 128, dtype=torch.float16)
    cache = torch.empty(4, 4096, 1, 128, dtype=torch.float16)
    args = LaunchArgs(q, cache, cache, torch.empty(4, dtype=torch.int32), torch.empty_like(q), None, None, None, 0.1,
                      tickets=torch.zeros(chosen.ticket_count(problem), dtype=torch.int32))
    assert BACKEND.launches(chosen, problem, args)[0][4]["MERGE_STEP"] == merge_step


def test_merging_plan_without_counters_is_refused():
    """A plan that merges in the split kernel, launched without its ticket counters: a clear error
    naming them, not a compile error deep in Triton."""
    call = make_call(capacity=128, lengths=[117, 70])
    problem = plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton").problem
    chosen = dataclasses.replace(plan(problem, PROFILES["h200"], BACKEND, 3, config=SMALL), merge_in_split=True)
    args = LaunchArgs(call.q, call.k_cache, call.v_cache, call.kwargs["cache_seqlens"], torch.empty_like(call.q),
                      None, None, None, 0.1)
    with pytest.raises(ValueError, match="tickets: .* needs 4 zeroed int32 counters"):
        BACKEND.launch(chosen, problem, args)


def test_a_tile_that_would_straddle_pages_is_refused():
    """A caller's block_n that does not divide a page of 768 tokens (a block would span two pages,
    which the kernels look up once a block) raises instead of reading the wrong rows."""
    call = make_call(batch=1, capacity=1536, page_size=768, lengths=[1000])
    config = dataclasses.replace(SMALL, block_n=512)
    with pytest.raises(ValueError, match="block_n 512 must divide the page size 768"):
        flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs, backend="triton",
                                context=DecodeContext(DEVICE, config=config))
