"""Tests at the edges: each validation rule with the value just inside (passes) and just outside
(raises, naming the argument), and each kernel feature on inputs where an off-by-one shows.

Validation runs the public call with backend "reference" on CPU tensors, whose index values the
host check always reads. The features run the public call on "reference" and on "triton" (its
interpreter without CUDA) with q = 0, so every visible key weighs the same, and each key's value
a one-hot vector at its own position: output column t is 1/n where key t is visible to the row
(n visible keys), else 0, and lse is log(n). One key too many or too few (the last key, the first
after a left pad, a window's boundary keys, the last token of the last page, an appended token)
moves a column by 1/n and the lse by about 1/n. The expected sets come from ``docs/design.md``
("Semantics"), not from the reference.
"""
import math

import pytest
import torch

from conftest import HAS_CUDA
from flashdecode import flash_attn_with_kvcache, plan_for

DEVICE = "cuda" if HAS_CUDA else "cpu"


def index(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


# -- validation: every rule at its edge ------------------------------------------------------------

def call(batch=2, capacity=16, nheads=4, nheads_k=2, headdim=8, seqlen_q=1, page_size=0, rows=None, pages=None,
         lengths=None, seqlen_new=0, rotary=None, **keywords):
    """The public call (backend "reference") on random CPU inputs: a contiguous cache of ``rows``
    rows (default batch), or with ``page_size`` ``pages`` pages (default batch * capacity /
    page_size, sequence b owning pages b * blocks onward in order). ``lengths`` default to the
    capacity less the appended tokens; ``rotary``: (table rows, rotary_dim). Returns the output."""
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=torch.float16)
    if page_size:
        blocks = capacity // page_size
        pages = batch * blocks if pages is None else pages
        k_cache = torch.randn(pages, page_size, nheads_k, headdim, dtype=torch.float16)
        table = torch.arange(batch * blocks, dtype=torch.int32).remainder(max(pages, 1)).view(batch, blocks)
        keywords.setdefault("block_table", table)
    else:
        k_cache = torch.randn(batch if rows is None else rows, capacity, nheads_k, headdim, dtype=torch.float16)
    if seqlen_new:
        keywords.update(k=torch.randn(batch, seqlen_new, nheads_k, headdim, dtype=torch.float16),
                        v=torch.randn(batch, seqlen_new, nheads_k, headdim, dtype=torch.float16))
    if rotary is not None:
        table_rows, rotary_dim = rotary
        keywords.update(rotary_cos=torch.ones(table_rows, rotary_dim // 2, dtype=torch.float16),
                        rotary_sin=torch.zeros(table_rows, rotary_dim // 2, dtype=torch.float16))
    keywords.setdefault("cache_seqlens", index([capacity - seqlen_new] * batch) if lengths is None else lengths)
    return flash_attn_with_kvcache(q, k_cache, torch.randn_like(k_cache), **keywords, backend="reference")


def table_with(entry, value, batch=2, blocks=5):
    """The default block table of ``call`` (pages of sequence b in order) with ``entry`` = value."""
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    table[entry] = value
    return table


#: Pages of 4, 5 per sequence (capacity 20), 10 pages in all; sequence 0 is 14 long: its page 3
#: holds 2 tokens (12, 13), its page 4 none.
PAGED = dict(capacity=20, page_size=4)

EDGES = {  # name: (the call's arguments just inside, just outside, the error, a pattern of its message)
    "head dim 256": (dict(headdim=256), dict(headdim=257), ValueError, r"q's head dim must be in \[1, 256\]"),
    "nheads a multiple of nheads_k": (dict(nheads=6, nheads_k=3), dict(nheads=6, nheads_k=4), ValueError,
                                      r"q's nheads \(6\) must be a multiple of k_cache's nheads_k \(4\)"),
    "cache rows at the batch": (dict(rows=2), dict(rows=1), ValueError,
                                r"k_cache must have at least 2 rows in dimension 0 \(q's batch\)"),
    "page size 256": (dict(capacity=256, page_size=256), dict(capacity=257, page_size=257), ValueError,
                      "k_cache's page size .* got 257"),
    "page size 768": (dict(capacity=768, page_size=768), dict(capacity=640, page_size=640), ValueError,
                      "k_cache's page size .* got 640"),
    "page size 1": (dict(capacity=4, page_size=1), dict(capacity=3, page_size=3), ValueError,
                    "k_cache's page size .* got 3"),
    "one page": (dict(PAGED, pages=1), dict(PAGED, pages=0), ValueError, "k_cache must hold at least one page"),
    "lengths at capacity": (dict(lengths=index([16, 16])), dict(lengths=index([16, 17])), ValueError,
                            r"cache_seqlens must be in \[0, 16\] .* got values in \[16, 17\]"),
    "lengths at 0": (dict(lengths=index([0, 0])), dict(lengths=index([0, -1])), ValueError,
                     r"cache_seqlens must be in \[0, 16\]"),
    "int length at capacity": (dict(lengths=16), dict(lengths=17), ValueError, r"cache_seqlens must be in \[0, 16\]"),
    "int length at 0": (dict(lengths=0), dict(lengths=-1), ValueError, r"cache_seqlens must be in \[0, 16\]"),
    "lengths at capacity less appended": (dict(seqlen_new=3, lengths=index([13, 0])),
                                          dict(seqlen_new=3, lengths=index([14, 0])), ValueError,
                                          r"cache_seqlens must be in \[0, 13\] \(capacity 16 minus 3 appended"),
    "appended tokens at capacity": (dict(seqlen_new=16, lengths=index([0, 0])),
                                    dict(seqlen_new=17, lengths=index([0, 0])), ValueError,
                                    "k must have at most the cache's capacity 16 tokens, got 17"),
    "paged lengths at capacity": (dict(PAGED, lengths=index([20, 20])), dict(PAGED, lengths=index([21, 20])),
                                  ValueError, r"cache_seqlens must be in \[0, 20\]"),
    "batch index at batch_cache - 1": (dict(rows=3, cache_batch_idx=index([2, 0])),
                                       dict(rows=3, cache_batch_idx=index([3, 0])), ValueError,
                                       r"cache_batch_idx must be in \[0, 2\] \(rows of k_cache\)"),
    "batch index at 0": (dict(rows=3, cache_batch_idx=index([0, 0])), dict(rows=3, cache_batch_idx=index([-1, 0])),
                         ValueError, r"cache_batch_idx must be in \[0, 2\]"),
    "left pad at the length": (dict(lengths=index([9, 16]), cache_leftpad=index([9, 0])),
                               dict(lengths=index([9, 16]), cache_leftpad=index([10, 0])), ValueError,
                               r"cache_leftpad must be in \[0, cache_seqlens\[b\]\]"),
    "left pad at 0": (dict(cache_leftpad=index([0, 0])), dict(cache_leftpad=index([-1, 0])), ValueError,
                      "cache_leftpad must be in"),
    "left pad at an int length": (dict(lengths=9, cache_leftpad=index([9, 9])),
                                  dict(lengths=9, cache_leftpad=index([9, 10])), ValueError,
                                  "cache_leftpad must be in"),
    "block id at num_pages - 1": (dict(PAGED, block_table=table_with((0, 0), 9)),
                                  dict(PAGED, block_table=table_with((0, 0), 10)), ValueError,
                                  r"block_table must be in \[0, 9\] \(pages of k_cache.*got values in \[1, 10\]"),
    "block id at 0": (dict(PAGED, block_table=table_with((1, 4), 0)), dict(PAGED, block_table=table_with((1, 4), -1)),
                      ValueError, r"block_table must be in \[0, 9\]"),
    # the last page, partly used: length 14 uses page 3 (tokens 12, 13), length 12 does not
    "bad block id past a length of 12": (dict(PAGED, lengths=index([12, 20]), block_table=table_with((0, 3), -1)),
                                         dict(PAGED, lengths=index([13, 20]), block_table=table_with((0, 3), -1)),
                                         ValueError, r"block_table must be in \[0, 9\].*got values in \[-1, 9\]"),
    "bad block id in the partly used last page": (
        dict(PAGED, lengths=index([14, 20]), block_table=table_with((0, 4), 10)),
        dict(PAGED, lengths=index([14, 20]), block_table=table_with((0, 3), 10)), ValueError,
        r"block_table must be in \[0, 9\].*got values in \[0, 10\]"),
    "bad block id under an appended token": (
        dict(PAGED, seqlen_new=1, lengths=index([11, 19]), block_table=table_with((0, 3), 99)),
        dict(PAGED, seqlen_new=1, lengths=index([12, 19]), block_table=table_with((0, 3), 99)), ValueError,
        r"block_table must be in \[0, 9\]"),
    "bad block id before the left pad": (
        dict(PAGED, lengths=index([14, 20]), cache_leftpad=index([4, 0]), block_table=table_with((0, 0), -1)),
        dict(PAGED, lengths=index([14, 20]), cache_leftpad=index([3, 0]), block_table=table_with((0, 0), -1)),
        ValueError, r"block_table must be in \[0, 9\]"),
    "bad block id before the window": (  # the row at 13 sees keys 13 - window_left on
        dict(PAGED, lengths=index([14, 20]), window_size=(9, -1), block_table=table_with((0, 0), -1)),
        dict(PAGED, lengths=index([14, 20]), window_size=(10, -1), block_table=table_with((0, 0), -1)),
        ValueError, r"block_table must be in \[0, 9\]"),
    "window left at -1": (dict(window_size=(-1, 2)), dict(window_size=(-2, 2)), ValueError,
                          r"window_size\[0\] must be >= -1, got -2"),
    "window right at -1": (dict(window_size=(2, -1)), dict(window_size=(2, -2)), ValueError,
                           r"window_size\[1\] must be >= -1, got -2"),
    "num_splits at 0": (dict(num_splits=0), dict(num_splits=-1), ValueError, "num_splits must be >= 0, got -1"),
    "softcap at 0": (dict(softcap=0.0), dict(softcap=-1e-6), ValueError, "softcap must be a finite float >= 0"),
    "softcap finite": (dict(softcap=1e30), dict(softcap=math.inf), ValueError, "softcap must be a finite float"),
    "rotary_dim at the head dim": (dict(seqlen_new=1, lengths=3, rotary=(16, 8)),
                                   dict(seqlen_new=1, lengths=3, rotary=(16, 10)), ValueError,
                                   r"rotary_cos must have 1 to headdim/2 = 4 columns"),
    "rotary rows at capacity": (dict(seqlen_new=1, lengths=3, rotary=(16, 4)),
                                dict(seqlen_new=1, lengths=3, rotary=(15, 4)), ValueError,
                                "rotary_cos/rotary_sin must have a row for every cache position: at least 16 rows"),
    "paged rotary rows at capacity": (dict(PAGED, seqlen_new=1, lengths=3, rotary=(20, 4)),
                                      dict(PAGED, seqlen_new=1, lengths=3, rotary=(19, 4)), ValueError,
                                      "at least 20 rows"),
}


@pytest.mark.parametrize("name", EDGES)
def test_rule_at_its_edge(name):
    inside, outside, error, message = EDGES[name]
    call(**inside)
    with pytest.raises(error, match=message):
        call(**outside)


@pytest.mark.parametrize("side", [0, 1])
def test_window_at_the_capacity_is_unbounded(side):
    """A window side of capacity - 1 binds; one of the capacity is -1 (FlashAttention's rule)."""
    q = torch.zeros(1, 2, 2, 8, dtype=torch.float16)
    cache = torch.zeros(1, 16, 1, 8, dtype=torch.float16)

    def normal_form(window):
        problem = plan_for(q, cache, cache, window_size=window, backend="reference").problem
        return (problem.window_left, problem.window_right)[side]

    assert normal_form((15, 15)) == 15 and normal_form((16, 16)) == -1


# -- features: which keys each row sees ------------------------------------------------------------

#: Head dim = capacity: key t's value is the one-hot vector e_t. Two query heads on one KV head.
CAPACITY = 160
NHEADS = 2


def visible_keys(length, seqlen_q, leftpad=0, window=(-1, -1), causal=False):
    """Bool (seqlen_q, CAPACITY): key t is visible to query row i (``docs/design.md``, "Semantics"):
    leftpad <= t < length, and within the window of the row's position length - seqlen_q + i."""
    left, right = window
    right = 0 if causal else right
    rows = []
    for i in range(seqlen_q):
        position = length - seqlen_q + i
        rows.append([leftpad <= t < length and (left < 0 or t >= position - left)
                     and (right < 0 or t <= position + right) for t in range(CAPACITY)])
    return torch.tensor(rows)


def one_hot_call(lengths, seqlen_q=1, page_size=0, seqlen_new=0, leftpad=None, window=(-1, -1), causal=False,
                 batch_idx=False, alibi=None):
    """(call arguments, expected visibility (batch, seqlen_q, CAPACITY)). Cache positions hold
    e_position in v; pages no sequence owns and cache rows no sequence reads hold 100 everywhere;
    the cache slots of appended tokens hold 100 before the call (the new tokens' values are
    e_position, read from v)."""
    batch = len(lengths)
    shape = (1, CAPACITY)  # (nheads_k, head dim)
    generator = torch.Generator().manual_seed(len(lengths) + seqlen_q + page_size)
    one_hot = torch.eye(CAPACITY).view(CAPACITY, 1, CAPACITY).expand(CAPACITY, *shape).to(torch.float16)
    arguments = dict(causal=causal, window_size=window)
    if page_size:
        blocks = CAPACITY // page_size
        pages = batch * blocks + 2
        order = torch.randperm(pages, generator=generator)[:batch * blocks].view(batch, blocks)
        v_cache = torch.full((pages, page_size, *shape), 100.0, dtype=torch.float16)
        for b in range(batch):
            v_cache[order[b]] = one_hot.reshape(blocks, page_size, *shape)
        arguments["block_table"] = order.to(torch.int32)
    else:
        rows = list(range(batch))
        if batch_idx:  # rows batch, ..., 1 (the last row of the cache read, row 0 spare)
            rows = [batch - b for b in range(batch)]
            arguments["cache_batch_idx"] = index(rows)
        v_cache = torch.full((batch + 1 if batch_idx else batch, CAPACITY, *shape), 100.0, dtype=torch.float16)
        v_cache[rows] = one_hot
    k_cache = torch.randn(v_cache.shape, generator=generator).to(torch.float16)
    arguments["cache_seqlens"] = index(lengths)
    if seqlen_new:
        positions = [[length + j for j in range(seqlen_new)] for length in lengths]
        arguments["k"] = torch.randn(batch, seqlen_new, *shape, generator=generator).to(torch.float16)
        arguments["v"] = torch.stack([one_hot[row] for row in positions])
        for b, row in enumerate(positions):  # the slots they go to hold 100 until the call writes them
            for position in row:
                if page_size:
                    v_cache[order[b, position // page_size], position % page_size] = 100.0
                else:
                    v_cache[rows[b], position] = 100.0
    if leftpad is not None:
        arguments["cache_leftpad"] = index(leftpad)
    if alibi is not None:
        arguments["alibi_slopes"] = torch.tensor(alibi, dtype=torch.float32)
    q = torch.zeros(batch, seqlen_q, NHEADS, CAPACITY, dtype=torch.float16)
    visible = torch.stack([visible_keys(length + seqlen_new, seqlen_q, (leftpad or [0] * batch)[b], window, causal)
                           for b, length in enumerate(lengths)])
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, **arguments), visible


ONE_HOT_CASES = {
    # the last key: lengths at the capacity, one below, across the 128-key block edge, 1 and 0
    "last-key": dict(lengths=[160, 159, 129, 128, 1, 0]),
    # the first key after a left pad (one past the block edge, at the edge, the last key, none)
    "leftpad": dict(lengths=[160, 160, 50, 14], leftpad=[129, 128, 49, 14]),
    # the keys at each window edge; left edges across the block edge
    "window-left": dict(lengths=[160, 138, 11], window=(10, -1)),
    "window-both": dict(lengths=[160, 131], seqlen_q=4, window=(3, 1)),
    "window-zero": dict(lengths=[160, 129], seqlen_q=3, window=(0, 0)),
    "causal": dict(lengths=[160, 130, 2], seqlen_q=4, causal=True),
    "causal-leftpad": dict(lengths=[160, 130], seqlen_q=4, causal=True, leftpad=[158, 128]),
    # the last token of the last page, full or partly used; pages smaller and larger than a block
    "pages-of-4": dict(lengths=[14, 16, 160, 129], page_size=4),
    "pages-of-32": dict(lengths=[14, 32, 160, 129], page_size=32),
    "pages-of-32-window": dict(lengths=[150, 70], page_size=32, window=(31, -1), leftpad=[0, 33]),
    # appended tokens at their positions (one of them the capacity's last), read from v
    "append": dict(lengths=[11, 157, 126, 0], seqlen_new=3),
    "append-pages-of-4": dict(lengths=[11, 157, 126, 0], seqlen_new=3, page_size=4),
    "append-causal": dict(lengths=[11, 156], seqlen_new=4, seqlen_q=4, causal=True),
    "batch-idx": dict(lengths=[158, 14, 130], batch_idx=True, seqlen_new=2),
}


def check_one_hot(got_out, got_lse, visible):
    """Column t of each row is 1/n where key t is visible to it, else 0; lse is log(n) (-inf for none)."""
    count = visible.sum(-1, keepdim=True)  # (batch, seqlen_q, 1)
    expected = (visible / count.clamp(min=1)).unsqueeze(2).expand(-1, -1, NHEADS, -1)
    torch.testing.assert_close(got_out.float().cpu(), expected, atol=1e-3, rtol=0)
    want_lse = count.squeeze(-1).float().log().unsqueeze(1).expand(-1, NHEADS, -1)  # (batch, nheads, seqlen_q)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=1e-3, rtol=0)


def run_one_hot(case, backend, num_splits=0):
    """(out, lse, visible, the caches before the call, the call's arguments after it) of a case."""
    arguments, visible = one_hot_call(**case)
    before = (arguments["k_cache"].clone(), arguments["v_cache"].clone())
    arguments = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                 for name, value in arguments.items()}
    out, lse = flash_attn_with_kvcache(**arguments, num_splits=num_splits, return_softmax_lse=True, backend=backend)
    return out, lse, visible, before, arguments


@pytest.mark.parametrize("name", ONE_HOT_CASES)
def test_reference_sees_exactly_the_visible_keys(name):
    out, lse, visible, _, _ = run_one_hot(ONE_HOT_CASES[name], "reference")
    check_one_hot(out, lse, visible)


#: Interpreter cases of the fast tier (each feature's edge once); the rest run with ``-m slow``.
FAST_TRITON = {"last-key", "leftpad", "window-both", "pages-of-4", "append-pages-of-4", "batch-idx"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in FAST_TRITON else pytest.mark.slow)
                                  for name in ONE_HOT_CASES])
@pytest.mark.parametrize("num_splits", [0, 2])
def test_triton_sees_exactly_the_visible_keys(name, num_splits):
    """Single pass and split into two (the 128-key blocks of the interpreter's tiles)."""
    out, lse, visible, (k_before, v_before), arguments = run_one_hot(ONE_HOT_CASES[name], "triton", num_splits)
    check_one_hot(out, lse, visible)
    if "k" in arguments:  # the appended tokens landed in their slots, and nothing else changed
        expected = {**arguments, "k_cache": k_before.to(DEVICE), "v_cache": v_before.to(DEVICE)}
        flash_attn_with_kvcache(**expected, backend="reference")
        assert torch.equal(arguments["k_cache"], expected["k_cache"])
        assert torch.equal(arguments["v_cache"], expected["v_cache"])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_alibi_weighs_each_key_by_its_distance(backend):
    """With q = 0 a row's weights are exp(-slope * |p - t|) normalized: column t of the output."""
    slopes = [0.5, 0.25]
    lengths, seqlen_q = [160, 131], 3
    out, lse, visible, _, _ = run_one_hot(dict(lengths=lengths, seqlen_q=seqlen_q, causal=True, alibi=slopes), backend)
    keys = torch.arange(CAPACITY)
    for b, length in enumerate(lengths):
        for i in range(seqlen_q):
            for h, slope in enumerate(slopes):
                weights = torch.exp(-slope * (length - seqlen_q + i - keys).abs()) * visible[b, i]
                torch.testing.assert_close(out[b, i, h].float().cpu(), weights / weights.sum(), atol=2e-3, rtol=0)
                assert abs(float(lse[b, h, i]) - math.log(float(weights.sum()))) < 2e-3


# -- rotary: appended keys and query rows at their positions ---------------------------------------

def rotated(x, position, rotary_dim, interleaved):
    """x (..., D) float32 rotated by angle position * 10000 ** (-c / (rotary_dim / 2)) in pair c."""
    half = rotary_dim // 2
    angle = position * 10000.0 ** (-torch.arange(half) / half)
    cos, sin = angle.cos(), angle.sin()
    if interleaved:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    else:
        first, second = x[..., :half], x[..., half:rotary_dim]
    new_first, new_second = first * cos - second * sin, first * sin + second * cos
    if interleaved:
        pairs = torch.stack((new_first, new_second), -1).flatten(-2)
    else:
        pairs = torch.cat((new_first, new_second), -1)
    return torch.cat((pairs, x[..., rotary_dim:]), -1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("interleaved, causal", [(False, True), (True, False)])
def test_rotary_positions(backend, interleaved, causal):
    """New key j of sequence b is rotated at cache_seqlens[b] + j; query row i at cache_seqlens[b]
    + i when causal, else every row at cache_seqlens[b]. The output against a dense oracle on
    inputs rotated here."""
    from flashdecode.reference import attention_ref

    capacity, headdim, rotary_dim, seqlen_new, seqlen_q = 40, 32, 16, 3, 3
    lengths = [37, 9]  # the first appends up to the last position
    generator = torch.Generator().manual_seed(5)
    half = rotary_dim // 2
    angle = torch.arange(capacity)[:, None] * 10000.0 ** (-torch.arange(half) / half)
    q = torch.randn(2, seqlen_q, 4, headdim, generator=generator).to(torch.float16)
    k_cache = torch.randn(2, capacity, 2, headdim, generator=generator).to(torch.float16)
    v_cache = torch.randn(2, capacity, 2, headdim, generator=generator).to(torch.float16)
    k = torch.randn(2, seqlen_new, 2, headdim, generator=generator).to(torch.float16)
    v = torch.randn(2, seqlen_new, 2, headdim, generator=generator).to(torch.float16)
    keys = k_cache.clone().to(DEVICE)
    out = flash_attn_with_kvcache(q.to(DEVICE), keys, v_cache.clone().to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                  angle.cos().to(DEVICE), angle.sin().to(DEVICE), cache_seqlens=index(lengths, DEVICE),
                                  causal=causal, rotary_interleaved=interleaved, backend=backend)
    keys = keys.cpu()
    want_keys, want_q = k_cache.float(), q.float()
    for b, length in enumerate(lengths):
        for j in range(seqlen_new):
            want_keys[b, length + j] = rotated(k[b, j].float(), length + j, rotary_dim, interleaved)
        for i in range(seqlen_q):
            want_q[b, i] = rotated(q[b, i].float(), length + (i if causal else 0), rotary_dim, interleaved)
    torch.testing.assert_close(keys.float(), want_keys, atol=2e-3, rtol=2e-3)
    mask = torch.arange(capacity)[None, :] < torch.tensor(lengths)[:, None] + seqlen_new
    want_values = v_cache.clone()
    for b, length in enumerate(lengths):
        want_values[b, length:length + seqlen_new] = v[b]
    want, _ = attention_ref(want_q, want_keys, want_values.float(), key_padding_mask=mask, causal=causal)
    error = (out.float().cpu() - want).norm() / want.norm()
    assert error < 5e-3


# -- a bad block id in the partly used last page, without the host check --------------------------

@pytest.mark.parametrize("page, bad", [(3, True), (4, False)], ids=["used", "unused"])
def test_bad_block_id_in_the_partly_used_last_page_makes_nan_rows(page, bad):
    """Length 14, pages of 4: page 3 holds tokens 12 and 13. The kernels' own check (what runs on
    the device with value checks off) flags a bad id there with NaN rows; page 4 is never read.
    The Triton backend launched on a validated plan, the bad id swapped in after the host check."""
    from test_triton_interpreter import make_call, through_backend

    call = make_call(capacity=20, page_size=4, lengths=[14, 20])
    table = call.kwargs["block_table"].clone()
    table[0, page] = -1
    out = through_backend(call, block_table=table)[0]
    assert bool(out[0].isnan().all()) == bad and bool(out[0].isnan().any()) == bad
    assert not out[1].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend, page_size, length", [("triton", 4, 14), ("tilelang", 16, 50)])
def test_bad_block_id_in_the_partly_used_last_page_on_the_gpu(backend, page_size, length):
    """The public call on CUDA tensors, value checks off (the default): a bad id in the page that
    holds the last tokens gives that sequence NaN rows; one in the page after them is never read."""
    from flashdecode.kernels.base import BackendError

    blocks, last = 5, length // page_size
    q = torch.randn(2, 1, 8, 128, dtype=torch.float16, device="cuda")
    pages = torch.randn(2 * blocks, page_size, 2, 128, dtype=torch.float16, device="cuda")
    lengths = index([length, blocks * page_size], "cuda")
    for page, bad in ((last, True), (last + 1, False)):
        table = torch.arange(2 * blocks, dtype=torch.int32, device="cuda").view(2, blocks)
        table[0, page] = -1
        try:
            out = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lengths, block_table=table, backend=backend)
        except BackendError as error:
            pytest.skip(f"{backend}: {error}")
        assert bool(out[0].isnan().all()) == bad and bool(out[0].isnan().any()) == bad
        assert not out[1].isnan().any()
