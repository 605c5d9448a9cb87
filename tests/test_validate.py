"""Every bad input raises the documented error, naming the argument (CPU tier: the reference runs)."""
import numpy as np
import pytest
import torch

import flashdecode
from conftest import last_dim_strided
from flashdecode import flash_attn_with_kvcache, flash_decode_with_kvcache


def good(batch=2, seqlen=16, nheads=8, nheads_k=2, headdim=64, dtype=torch.float16, seqlen_q=1):
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype)
    k = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype)
    v = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype)
    return q, k, v, torch.full((batch,), seqlen, dtype=torch.int32)


def call(q, k_cache, v_cache, seqlens=None, **kwargs):
    return flash_decode_with_kvcache(q, k_cache, v_cache, seqlens, **kwargs)


def new_tokens(q, k, count=1):
    return (torch.randn(q.shape[0], count, k.shape[2], k.shape[3], dtype=q.dtype),
            torch.randn(q.shape[0], count, k.shape[2], k.shape[3], dtype=q.dtype))


def paged(k, page_size=4):
    """k's cache as pages of ``page_size`` tokens (consecutive) and its block table."""
    batch, seqlen, heads, dim = k.shape
    pages = k.reshape(batch * seqlen // page_size, page_size, heads, dim)
    return pages, torch.arange(pages.shape[0], dtype=torch.int32).reshape(batch, -1)


def rotary(rows, dim, dtype=torch.float16):
    angle = torch.rand(rows, dim // 2) * 6.28
    return angle.cos().to(dtype), angle.sin().to(dtype)


BAD_INPUTS = {
    "q not a tensor": (lambda q, k, v, s: call(q.tolist(), k, v, s), TypeError, "q must be a torch.Tensor"),
    "q float32": (lambda q, k, v, s: call(q.float(), k, v, s), TypeError, "q must be float16 or bfloat16"),
    "mixed dtypes": (lambda q, k, v, s: call(q, k.bfloat16(), v, s), TypeError, "k_cache must have q's dtype"),
    "v dtype": (lambda q, k, v, s: call(q, k, v.bfloat16(), s), TypeError, "v_cache must have q's dtype"),
    "q rank": (lambda q, k, v, s: call(q[:, 0], k, v, s), ValueError, "q must have 4 dimensions"),
    "k rank": (lambda q, k, v, s: call(q, k[0], v, s), ValueError, "k_cache must have 4 dimensions"),
    "seqlen_q 0": (lambda q, k, v, s: call(q[:, :0], k, v, s), ValueError, "seqlen_q and nheads >= 1"),
    "head dim 512": (lambda q, k, v, s: call(q.repeat(1, 1, 1, 8), k.repeat(1, 1, 1, 8), v.repeat(1, 1, 1, 8), s),
                     ValueError, r"head dim must be in \[1, 256\]"),
    "k batch": (lambda q, k, v, s: call(q, k[:1], v[:1], s), ValueError,
                r"k_cache must have at least 2 rows in dimension 0 \(q's batch\)"),
    "k headdim": (lambda q, k, v, s: call(q, torch.cat([k, k], -1), torch.cat([v, v], -1), s), ValueError,
                  "k_cache must have q's head dim"),
    "v shape": (lambda q, k, v, s: call(q, k, v[:, :8], s), ValueError, "v_cache must have k_cache's shape"),
    "gqa ratio": (lambda q, k, v, s: call(q[:, :, :7], k, v, s), ValueError, "multiple of k_cache's nheads_k"),
    "k last dim strided": (lambda q, k, v, s: call(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, s),
                           ValueError, "k_cache must be contiguous in its last dimension"),
    "seqlens dtype": (lambda q, k, v, s: call(q, k, v, s.long()), TypeError, "cache_seqlens must be int32"),
    "seqlens shape": (lambda q, k, v, s: call(q, k, v, s[:1]), ValueError, r"cache_seqlens must have shape \(2,\)"),
    "seqlens type": (lambda q, k, v, s: call(q, k, v, 16.0), TypeError, "cache_seqlens must be an int"),
    "seqlens list": (lambda q, k, v, s: call(q, k, v, [16, 16]), TypeError,
                     r"cache_seqlens must be an int32 tensor of shape \(2,\), an int or None, got list \[16, 16\]"),
    "seqlens above": (lambda q, k, v, s: call(q, k, v, s + 1), ValueError, r"cache_seqlens must be in \[0, 16\]"),
    "seqlens below": (lambda q, k, v, s: call(q, k, v, s - 17), ValueError, "cache_seqlens must be in"),
    "seqlens int above": (lambda q, k, v, s: call(q, k, v, 17), ValueError, "cache_seqlens must be in"),
    "num_splits": (lambda q, k, v, s: call(q, k, v, s, num_splits=-1), ValueError, "num_splits must be >= 0"),
    "backend": (lambda q, k, v, s: call(q, k, v, s, backend="cuda"), ValueError, "backend must be one of"),
    "scale": (lambda q, k, v, s: call(q, k, v, s, softmax_scale="x"), TypeError, "softmax_scale"),
    "out shape": (lambda q, k, v, s: call(q, k, v, s, out=torch.empty(2, 1, 8, 32, dtype=torch.float16)),
                  ValueError, "out must have q's shape"),
    "batch 0": (lambda q, k, v, s: call(q[:0], k[:0], v[:0], s[:0]), ValueError, "batch, seqlen_q and nheads >= 1"),
    # FlashAttention's surface
    "k without v": (lambda q, k, v, s: call(q, k, v, s - 1, k=new_tokens(q, k)[0]), ValueError,
                    "k and v must be given together"),
    "k without seqlens": (lambda q, k, v, s: call(q, k, v, None, k=new_tokens(q, k)[0], v=new_tokens(q, k)[1]),
                          ValueError, "cache_seqlens is required with k and v"),
    "k shape": (lambda q, k, v, s: call(q, k, v, s - 1, k=new_tokens(q, k)[0][:, :, :1], v=new_tokens(q, k)[1]),
                ValueError, "k and v must have shape"),
    "append past capacity": (lambda q, k, v, s: call(q, k, v, s, k=new_tokens(q, k)[0], v=new_tokens(q, k)[1]),
                             ValueError, r"cache_seqlens must be in \[0, 15\] \(capacity 16 minus 1 appended"),
    "rotary without k": (lambda q, k, v, s: call(q, k, v, s, rotary_cos=rotary(16, 32)[0], rotary_sin=rotary(16, 32)[1]),
                         ValueError, "rotary_cos/rotary_sin need k and v"),
    "rotary too short": (lambda q, k, v, s: call(q, k, v, s - 1, k=new_tokens(q, k)[0], v=new_tokens(q, k)[1],
                                                 rotary_cos=rotary(8, 32)[0], rotary_sin=rotary(8, 32)[1]),
                         ValueError, "at least 16 rows"),
    "rotary too wide": (lambda q, k, v, s: call(q, k, v, s - 1, k=new_tokens(q, k)[0], v=new_tokens(q, k)[1],
                                                rotary_cos=rotary(16, 128)[0], rotary_sin=rotary(16, 128)[1]),
                        ValueError, "rotary_dim <= headdim"),
    "rotary cos only": (lambda q, k, v, s: call(q, k, v, s - 1, k=new_tokens(q, k)[0], v=new_tokens(q, k)[1],
                                                rotary_cos=rotary(16, 32)[0]), ValueError, "given together"),
    "page size 3": (lambda q, k, v, s: call(q, k[:, :15].reshape(10, 3, 2, 64), k[:, :15].reshape(10, 3, 2, 64), 12,
                                            block_table=torch.arange(10, dtype=torch.int32).reshape(2, 5)),
                    ValueError, "page size .* must be a power of two or a multiple of 256, got 3"),
    "page size 384": (lambda q, k, v, s: call(q, torch.zeros(2, 384, 2, 64, dtype=q.dtype),
                                              torch.zeros(2, 384, 2, 64, dtype=q.dtype), 12,
                                              block_table=torch.arange(2, dtype=torch.int32).reshape(2, 1)),
                      ValueError, "page size .* must be a power of two or a multiple of 256, got 384"),
    "block table dtype": (lambda q, k, v, s: call(q, *paged(k)[:1], paged(v)[0], s,
                                                  block_table=paged(k)[1].long()), TypeError, "block_table must be int32"),
    "block table shape": (lambda q, k, v, s: call(q, paged(k)[0], paged(v)[0], s, block_table=paged(k)[1][:1]),
                          ValueError, r"block_table must have shape \(2, 4\)"),
    "block id out of range": (lambda q, k, v, s: call(q, paged(k)[0], paged(v)[0], s,
                                                      block_table=paged(k)[1].clone().fill_(8)),
                              ValueError, r"block_table must be in \[0, 7\]"),
    "paged with batch idx": (lambda q, k, v, s: call(q, paged(k)[0], paged(v)[0], s, block_table=paged(k)[1],
                                                     cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
                             ValueError, "cache_batch_idx cannot be used with block_table"),
    "batch idx out of range": (lambda q, k, v, s: call(q, k, v, s, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
                               ValueError, r"cache_batch_idx must be in \[0, 1\]"),
    "leftpad past length": (lambda q, k, v, s: call(q, k, v, s - 4, cache_leftpad=torch.tensor([0, 13], dtype=torch.int32)),
                            ValueError, "cache_leftpad must be in"),
    "window below -1": (lambda q, k, v, s: call(q, k, v, s, window_size=(-2, -1)), ValueError,
                        r"window_size\[0\] must be >= -1"),
    "window not a pair": (lambda q, k, v, s: call(q, k, v, s, window_size=5), TypeError, "window_size must be a pair"),
    "window of three": (lambda q, k, v, s: call(q, k, v, s, window_size=(1, 2, 3)), TypeError,
                        r"window_size must be a pair \(left, right\) of ints, got tuple \(1, 2, 3\)$"),
    "rotary of no columns": (lambda q, k, v, s: call(q, k, v, s - 1, k=k[:, :1], v=v[:, :1],
                                                     rotary_cos=torch.ones(16, 0), rotary_sin=torch.ones(16, 0)),
                             ValueError, "rotary_cos must have 1 to headdim/2 = 32 columns .* got 0"),
    "out expanded": (lambda q, k, v, s: call(q, k, v, s, out=torch.empty_like(q[:1]).expand_as(q)), ValueError,
                     "out must not repeat its memory .* strides \\(0, "),
    "append into an expanded cache": (lambda q, k, v, s: call(q, k[:1].expand_as(k), v, s - 1, k=k[:, :1], v=v[:, :1]),
                                      ValueError, "k_cache must not repeat its memory \\(k and v are appended"),
    "ragged batch from cu_seqlens_q": (lambda q, k, v, s: call(q[0], k, v, s, cu_seqlens_q=torch.tensor(
        [0, 1, 1, 1], dtype=torch.int32), max_seqlen_q=1), ValueError,
        r"k_cache must have at least 3 rows in dimension 0 \(batch: cu_seqlens_q's entries less one\)"),
    "softcap negative": (lambda q, k, v, s: call(q, k, v, s, softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    "alibi dtype": (lambda q, k, v, s: call(q, k, v, s, alibi_slopes=torch.rand(8, dtype=torch.float16)), TypeError,
                    "alibi_slopes must be float32"),
    "alibi shape": (lambda q, k, v, s: call(q, k, v, s, alibi_slopes=torch.rand(3)), ValueError,
                    r"alibi_slopes must have shape \(8,\) or \(2, 8\)"),
    "causal not bool": (lambda q, k, v, s: call(q, k, v, s, causal="yes"), TypeError, "causal must be a bool, got str"),
    "window of floats": (lambda q, k, v, s: call(q, k, v, s, window_size=(np.float64(2), 0)), TypeError,
                         r"window_size\[0\] must be an int, got numpy.float64"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises(name):
    make_call, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        make_call(*good())


def test_device_mismatch_named():
    q, k, v, s = good()
    with pytest.raises(ValueError, match="k_cache must be on q's device"):
        call(q, k.to("meta"), v, s)
    with pytest.raises(ValueError, match="cache_seqlens must be on q's device"):
        call(q, k, v, s.to("meta"))


def test_value_checks_switch():
    """The host check of CUDA index values is off by default (it syncs) and can be switched on."""
    assert not flashdecode.validate.value_checks_enabled()
    flashdecode.set_value_checks(True)
    assert flashdecode.validate.value_checks_enabled()
    flashdecode.set_value_checks(False)
    assert not flashdecode.validate.value_checks_enabled()


def test_good_input_accepted_in_every_form():
    q, k, v, s = good()
    expected = call(q, k, v, s)
    for seqlens in (None, 16, torch.tensor(16)):
        torch.testing.assert_close(call(q, k, v, seqlens if not isinstance(seqlens, torch.Tensor) else int(seqlens)),
                                   expected)
    out = torch.empty_like(q)
    assert call(q, k, v, s, out=out) is out
    window = (torch.tensor(3), torch.tensor(0))  # FlashAttention's own tests pass 0-d tensors
    torch.testing.assert_close(flash_attn_with_kvcache(q, k, v, cache_seqlens=s, window_size=window),
                               flash_attn_with_kvcache(q, k, v, cache_seqlens=s, window_size=(3, 0)))


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError)])
def test_softmax_scale_must_be_a_finite_number(scale, error):
    with pytest.raises(error, match="softmax_scale"):
        call(*good(), softmax_scale=scale)


def test_zero_query_heads_rejected():
    q, k, v, s = good()
    with pytest.raises(ValueError, match="nheads"):
        call(q[:, :, :0], k, v, s)


def test_numpy_scalars_accepted():
    q, k, v, s = good()
    torch.testing.assert_close(call(q, k, v, s, softmax_scale=np.float32(0.125), num_splits=np.int64(2)),
                               call(q, k, v, s, softmax_scale=0.125))


def test_checks_see_new_metadata_and_new_values():
    """Validation is memoized per metadata: a second call with other values of the same metadata
    passes, other metadata is checked again, and CPU index values are read on every call."""
    q, k, v, s = good()
    context = flashdecode.DecodeContext()
    call(q, k, v, s, context=context)
    call(torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), s.clone(), context=context)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        call(q, k.float(), v, s, context=context)
    with pytest.raises(ValueError, match="cache_seqlens must be in"):
        call(q, k, v, s.clone().fill_(k.shape[1] + 1), context=context)


META = dict(dtype=torch.float16, device="meta")  # shapes and strides without memory


def _offsets_32(k_cache, v_cache, block_table=None) -> bool:
    """``Problem.offsets_32`` of a one-sequence call on these (meta) caches."""
    q = torch.empty(1, 1, 8, 128, **META)
    lengths = torch.zeros(1, dtype=torch.int32, device="meta")
    return flashdecode.plan_for(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table,
                                backend="reference").problem.offsets_32


@pytest.mark.parametrize("rows, paged", [(2 ** 17, True), (2 ** 17 + 1, True), (2 ** 21, False), (2 ** 21 + 1, False)])
def test_caches_past_2_to_the_31_elements_are_addressed_in_64_bits(rows, paged):
    """``Problem.offsets_32`` holds exactly while every cache element lies within 2^31 - 1 of the
    cache's start."""
    k_cache = torch.empty(*((rows, 16) if paged else (1, rows)), 8, 128, **META)  # pages of 16, or one sequence
    table = torch.zeros(1, 4, dtype=torch.int32, device="meta") if paged else None
    assert _offsets_32(k_cache, k_cache, table) == (k_cache.numel() <= 2 ** 31)


def test_strided_caches_are_addressed_by_their_furthest_element():
    """A view's strides, not its element count, decide ``Problem.offsets_32``, for k and v alike:
    4 of 32 heads of a cache whose rows span 2^31 elements need 64 bits; the same heads alone do not."""
    wide = torch.empty(1, 2 ** 19 + 1, 32, 128, **META)[:, :, :4]  # 2^28 + 512 elements, offsets past 2^31
    narrow = torch.empty(1, 2 ** 19 + 1, 4, 128, **META)
    assert _offsets_32(narrow, narrow)
    assert not _offsets_32(wide, narrow) and not _offsets_32(narrow, wide)


def test_numpy_bools_accepted_as_flashattention_takes_them():
    q, k, v, s = good(seqlen_q=3)
    torch.testing.assert_close(call(q, k, v, s, causal=np.bool_(True)), call(q, k, v, s, causal=True))


def test_scalars_converted_as_flashattentions_bindings_convert_them():
    """What converts to the C++ bool and float of FlashAttention's bindings: ints and None for the
    flags, one-element tensors for the scale, causal and softcap. A tensor's value is read, so a
    later call with another value of the same tensor metadata gets that value (a context repeats
    calls by metadata)."""
    q, k, v, s = good(seqlen_q=3)
    context = flashdecode.DecodeContext()
    causal = call(q, k, v, s, causal=True, context=context)
    for flag in (1, torch.tensor(True), torch.tensor([1])):
        torch.testing.assert_close(call(q, k, v, s, causal=flag, context=context), causal)
    plain = call(q, k, v, s, causal=False, context=context)
    for flag in (0, None, torch.tensor(False)):
        torch.testing.assert_close(call(q, k, v, s, causal=flag, context=context), plain)
    for scale in (0.3, 0.05):
        torch.testing.assert_close(call(q, k, v, s, softmax_scale=torch.tensor(scale), context=context),
                                   call(q, k, v, s, softmax_scale=scale, context=context))
    torch.testing.assert_close(call(q, k, v, s, softcap=torch.tensor(2.0), context=context),
                               call(q, k, v, s, softcap=2.0, context=context))
    route = flashdecode.plan_for(q, k, v, cache_seqlens=s, causal=torch.tensor(True), backend="reference")
    assert route.problem.window_right == 0
    with pytest.raises(TypeError, match=r"softmax_scale must be a number or a one-element tensor, got a tensor of "
                                        r"shape \(2,\)"):
        call(q, k, v, s, softmax_scale=torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool, got str"):
        call(q, k, v, s, rotary_interleaved="no")


def test_the_host_path_sees_numbers_never_scalar_tensors(monkeypatch):
    """What a call hands the compiled host path (which keys tensors by metadata, not value): the
    one-element tensors given for scalars, read as numbers."""
    from flashdecode import host_path

    seen = []

    class Recording:
        def run(self, *call):
            seen.append(call)
            return None  # a miss: the Python path runs the call

    monkeypatch.setattr(host_path, "for_device", lambda device: Recording())
    q, k, v, s = good()
    call(q, k, v, s, softmax_scale=torch.tensor(0.25), causal=torch.tensor(1), softcap=torch.tensor(3.0),
         rotary_interleaved=torch.tensor(False), num_splits=torch.tensor(2), context=flashdecode.DecodeContext())
    scale, causal, window, softcap, interleaved, alibi, num_splits = seen[0][11:18]
    assert (scale, causal, softcap, interleaved, num_splits) == (0.25, True, 3.0, False, 2)
    assert [type(value) for value in (scale, causal, softcap, interleaved, num_splits)] == \
        [float, bool, float, bool, int]


def test_cache_with_more_rows_than_the_batch_reads_row_b():
    """FlashAttention sizes a contiguous cache by its own rows: sequence b reads (and appends to)
    row b of a cache made for a larger batch. The kernels that need exactly q's batch rows decline."""
    q, k, v, s = good(batch=2)
    spare_k, spare_v = torch.randn(5, *k.shape[1:], dtype=k.dtype), torch.randn(5, *v.shape[1:], dtype=v.dtype)
    spare_k[:2], spare_v[:2] = k, v
    untouched = spare_k[2:].clone()
    new_k, new_v = new_tokens(q, k)
    expected = call(q, k, v, s - 1, k=new_k, v=new_v)
    torch.testing.assert_close(call(q, spare_k, spare_v, s - 1, k=new_k, v=new_v), expected)
    torch.testing.assert_close(spare_k[:2], k)  # the same tokens appended in place, rows 0 and 1
    assert torch.equal(spare_k[2:], untouched)
    assert not flashdecode.plan_for(q, spare_k, spare_v, cache_seqlens=s, backend="reference").problem.dense


def test_heads_first_caches_and_size_one_strides_are_dense():
    """transformers' caches, (batch, Hk, T, D) seen through transpose(1, 2), are dense and heads-first
    (the layout TileLang's kernels are specialised on); so is a decode step's q, whose size-1 query
    dimension has another stride; a mix of layouts, or a strided cache, is not dense."""
    q, k, v, s = good()
    stored_k, stored_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    decode_q = q.as_strided(q.shape, (8 * 64, 64, 64, 1))  # as transformers' query.transpose(1, 2)
    assert decode_q.stride() != q.stride()
    problem = flashdecode.plan_for(decode_q, stored_k.transpose(1, 2), stored_v.transpose(1, 2), cache_seqlens=s,
                                   backend="reference").problem
    assert problem.dense and problem.heads_first and "heads_first" in problem.features()
    assert not flashdecode.plan_for(q, k, v, cache_seqlens=s, backend="reference").problem.heads_first
    mixed = flashdecode.plan_for(q, stored_k.transpose(1, 2), v, cache_seqlens=s, backend="reference").problem
    assert not mixed.dense
    torch.testing.assert_close(call(decode_q, stored_k.transpose(1, 2), stored_v.transpose(1, 2), s), call(q, k, v, s))
    one_head = good(nheads_k=1)  # one KV head: both layouts at once, taken as the plain one
    transposed = one_head[1].transpose(1, 2).contiguous().transpose(1, 2)
    assert not flashdecode.plan_for(one_head[0], transposed, transposed, backend="reference").problem.heads_first


def test_strided_q_new_tokens_and_index_tensors_are_copied_as_flashattention_does():
    """FlashAttention's wrapper makes q, k, v and the index tensors contiguous in their last
    dimension; the caches must be so already (they are written in place)."""
    q, k, v, s = good()
    new_k, new_v = new_tokens(q, k)
    k_copy, v_copy = k.clone(), v.clone()
    expected = call(q, k_copy, v_copy, s - 1, k=new_k, v=new_v, cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))

    index = torch.tensor([1, 9, 0, 9], dtype=torch.int32)[::2]
    got = call(last_dim_strided(q), k, v, last_dim_strided(s - 1), k=last_dim_strided(new_k),
               v=last_dim_strided(new_v), cache_batch_idx=index)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(k, k_copy)
    route = flashdecode.plan_for(last_dim_strided(q), k, v, cache_seqlens=last_dim_strided(s), backend="reference")
    assert route.problem == flashdecode.plan_for(q, k, v, cache_seqlens=s, backend="reference").problem


def test_block_table_entries_no_visible_key_uses_may_hold_anything():
    """The host check reads the pages of the keys each sequence's rows can see (after its left pad
    or window, up to its length) and of its appended tokens: entries outside may hold anything."""
    q, k, v, s = good()
    pages, table = paged(k)
    v_pages = paged(v)[0]
    expected = call(q, pages, v_pages, s, block_table=table, window_size=(5, 0))
    garbage = table.clone()
    garbage[:, :2] = -1  # keys 0-7: before every row's window of 6 keys ending at key 15
    torch.testing.assert_close(call(q, pages, v_pages, s, block_table=garbage, window_size=(5, 0)), expected)
    leftpad = torch.tensor([8, 4], dtype=torch.int32)
    garbage = table.clone()
    garbage[0, :2], garbage[1, 0] = 99, -7
    torch.testing.assert_close(call(q, pages, v_pages, s, block_table=garbage, cache_leftpad=leftpad),
                               call(q, pages, v_pages, s, block_table=table, cache_leftpad=leftpad))
    garbage[1, 1] = 99  # keys 4-7, after sequence 1's left pad: read
    with pytest.raises(ValueError, match=r"block_table must be in \[0, 7\]"):
        call(q, pages, v_pages, s, block_table=garbage, cache_leftpad=leftpad)
    new_k, new_v = new_tokens(q, k, count=8)
    garbage = table.clone()
    garbage[:, 2] = 99  # keys 8-11: appended to (tokens 8-15), though a window of 0 sees only key 15
    with pytest.raises(ValueError, match="block_table must be in"):
        call(q, pages, v_pages, s - 8, k=new_k, v=new_v, block_table=garbage, window_size=(0, 0))


def test_a_call_under_inference_mode_leaves_later_calls_working():
    """The context's reused lse buffer is never an inference tensor: a first call under
    torch.inference_mode must not make later ordinary calls fail to write into it."""
    context = flashdecode.DecodeContext()
    with torch.inference_mode():
        q, k, v, s = good()
        first = call(q, k, v, s, context=context)
    q, k, v, s = good()
    call(q, k, v, s, context=context)
    with torch.inference_mode():
        call(q, k, v, s, context=context)
    assert first.is_inference()


def test_the_block_id_check_reads_the_entries_the_backend_reads():
    """TileLang scans the block ids of whole tiles (``Backend.block_ids_read_from``): with its tile
    of 64 keys the host check also refuses a bad id below the window in the first visible tile."""
    from flashdecode.validate import check_values

    q, k, v, s = good(seqlen=128)
    pages, table = paged(k)  # pages of 4 keys
    problem = flashdecode.plan_for(q, pages, paged(v)[0], cache_seqlens=s, block_table=table, window_size=(5, 0),
                                   backend="reference").problem
    garbage = table.clone()
    garbage[:, 27] = -1  # keys 108-111: below every row's window (keys 122-127), in the tile of keys 64-127
    check_values(problem, pages, s, None, None, garbage, force=True)
    with pytest.raises(ValueError, match="block_table must be in"):
        check_values(problem, pages, s, None, None, garbage, force=True, block_ids_from=64)
