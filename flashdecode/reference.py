"""PyTorch references: the oracle of every test and the CPU fallback.

``reference_attention`` computes the whole ``flash_attn_with_kvcache`` surface exactly as
``docs/design.md`` ("Semantics") defines it, one sequence at a time over only the keys that
sequence can see, in float32 and in key chunks (a 128k-token cache costs no padded blow-up).
``attention_ref`` is the dense masked formulation of FlashAttention's own test, the independent
oracle that ``reference_attention`` and the kernels are checked against. Rows that see no key
give output 0 and lse -inf in both.
"""
from __future__ import annotations

import math

import torch

#: Keys converted to float32 at a time by ``reference_attention`` (bounds its temporary memory).
KEY_CHUNK = 8192


def reference_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """Returns (out, lse): out (batch, 1, nheads, headdim) in q's dtype, lse (batch, nheads, 1) fp32.

    ``cache_seqlens`` is an int32 tensor (batch,) on any device; it is read on the host.
    """
    batch, _, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, nheads, headdim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads), float("-inf"), dtype=torch.float32, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        if length == 0:
            continue
        qb = q[b, 0].float().view(nheads_k, group, headdim)
        kb = k_cache[b, :length].float()  # (length, nheads_k, headdim)
        vb = v_cache[b, :length].float()
        scores = torch.einsum("hgd,shd->hgs", qb, kb) * scale
        row_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - row_lse)
        out[b] = torch.einsum("hgs,shd->hgd", probs, vb).reshape(nheads, headdim)
        lse[b] = row_lse.reshape(nheads)
    return out.to(q.dtype).unsqueeze(1), lse.unsqueeze(-1)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference|| in float32 (NaN anywhere gives NaN, which fails)."""
    if out.shape != reference.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(reference.shape)}")
    reference = reference.float()
    return float(torch.linalg.vector_norm(out.float() - reference) / torch.linalg.vector_norm(reference))


def window_mask(positions_q, positions_k, window_left, window_right):
    """Bool (..., Sq, Sk): key position t is inside the window of the query at position p
    (``t <= p + window_right``, ``t >= p - window_left``; a side < 0 is unbounded)."""
    distance = positions_k.unsqueeze(-2) - positions_q.unsqueeze(-1)  # t - p
    inside = torch.ones_like(distance, dtype=torch.bool)
    if window_right >= 0:
        inside &= distance <= window_right
    if window_left >= 0:
        inside &= distance >= -window_left
    return inside


def masked_softmax(scores, visible, sinks=None):
    """(probs, lse) of masked scores; a row with no visible key has probs 0 and lse -inf. ``sinks``
    (broadcastable to scores[..., 0]): a logit per row that joins the denominator and the lse but
    weighs no value (a row with no visible key then has lse = its sink)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1, keepdim=True), 0.0)
        return probs, torch.logsumexp(scores.float(), dim=-1)
    # as the kernels fold the sink: under the max of the scores and the sink, so a sink of +inf makes
    # the row NaN (exp(inf - inf)), and a row of -inf logits only has probs 0 and lse -inf
    sinks = sinks.float().expand_as(scores[..., 0])
    top = torch.maximum(scores.float().amax(-1), sinks)
    top = torch.where(torch.isneginf(top), 0.0, top)
    weights = torch.exp(scores.float() - top.unsqueeze(-1))
    denominator = weights.sum(-1) + torch.exp(sinks - top)
    probs = weights / torch.where(denominator == 0, 1.0, denominator).unsqueeze(-1)
    return probs.to(scores.dtype), top + torch.log(denominator)


def attention_ref(q, k, v, key_padding_mask=None, attn_bias=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, upcast=True, reorder_ops=False, key_leftpad=None, softmax_scale=None, sinks=None):
    """Dense masked attention, the oracle formulation of FlashAttention's test. Returns (out, lse).

    q (B, Sq, H, D); k, v (B, Sk, Hk, D) with H a multiple of Hk; key_padding_mask (B, Sk) bool,
    True for real keys, which must be one run ``[key_leftpad[b], end_b)``; the query row i sits at
    position ``end_b - Sq + i`` (bottom-right alignment) for the window and ``causal`` (= right
    window 0). ``attn_bias`` (broadcastable to (B, H, Sq, Sk)) is added after softcap and masking.
    ``upcast=False`` computes in the inputs' dtype and ``reorder_ops`` scales k instead of q: the
    two together estimate a same-dtype implementation's rounding error. ``sinks`` (H,) float32: each
    head's sink logit, in the units of the scaled scores (no softcap), joins every row's softmax
    denominator (gpt-oss). out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32; rows with no
    visible key give 0 and -inf (their sink's value with sinks).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    if reorder_ops:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    else:
        scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    device = q.device
    start = torch.zeros(batch, dtype=torch.long, device=device) if key_leftpad is None else key_leftpad.long()
    if key_padding_mask is None:
        visible = torch.ones(batch, seqlen_k, dtype=torch.bool, device=device)
        end = start + seqlen_k
    else:
        visible = key_padding_mask.bool()
        end = start + visible.sum(-1)
    visible = visible[:, None, None, :]  # (B, 1, 1, Sk)
    window_left, window_right = int(window_size[0]), 0 if causal else int(window_size[1])
    if window_left >= 0 or window_right >= 0:
        positions_q = end[:, None] - seqlen_q + torch.arange(seqlen_q, device=device)
        positions_k = torch.arange(seqlen_k, device=device).expand(batch, seqlen_k)
        visible = visible & window_mask(positions_q, positions_k, window_left, window_right)[:, None]
    visible = visible.expand(batch, nheads, seqlen_q, seqlen_k)
    if attn_bias is not None:
        scores = scores + attn_bias
    probs, lse = masked_softmax(scores, visible, None if sinks is None else sinks.view(1, nheads, 1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)
    return out.to(dtype), lse


def apply_rotary(x, cos, sin, offsets, interleaved):
    """Rotary embedding of x (B, S, H, D) in float32, returned in x's dtype: the first
    ``2 * cos.shape[1]`` dims rotate, token s of sequence b at position ``offsets[b] + s``
    (``offsets`` an int or a (B,) tensor); the rest pass through. Interleaved pairs dims
    (2c, 2c + 1), otherwise (c, c + rotary_dim / 2) (``docs/design.md``, "Semantics"). Positions
    past the table's end take its last row, as the kernels do (FlashAttention reads past it)."""
    batch, seqlen = x.shape[:2]
    half = cos.shape[1]
    offsets = torch.as_tensor(offsets, device=x.device).long().reshape(-1, 1).expand(batch, 1)
    positions = offsets + torch.arange(seqlen, device=x.device)  # (B, S)
    table_rows = positions.clamp(0, cos.shape[0] - 1)
    cos_rows = cos.float()[table_rows].unsqueeze(2)  # (B, S, 1, half)
    sin_rows = sin.float()[table_rows].unsqueeze(2)
    rotated = x[..., :2 * half].float()
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        first, second = rotated[..., :half], rotated[..., half:]
    new_first = first * cos_rows - second * sin_rows
    new_second = first * sin_rows + second * cos_rows
    if interleaved:
        rotated = torch.stack((new_first, new_second), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((new_first, new_second), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def per_sequence(value, batch, default):
    """A per-sequence int list from None (``default``), an int (numpy's too), or a (B,) tensor."""
    if value is None:
        return [default] * batch
    if not isinstance(value, torch.Tensor):
        return [int(value)] * batch
    return [int(item) for item in value.tolist()]


def descale_table(descale, batch: int, nheads_k: int, device) -> torch.Tensor:
    """A descale argument as float32 (batch, nheads_k) (an expanded view: no copy): None (1.0), a
    number, or a float32 tensor of shape (), (nheads_k,) or (batch, nheads_k), FA3's."""
    if descale is None:
        descale = 1.0
    table = torch.as_tensor(descale, dtype=torch.float32, device=device)
    return table.expand(batch, nheads_k)


def quantise(x, descale, dtype) -> torch.Tensor:
    """``x`` (..., Hk, D) stored in an fp8 cache of ``dtype``: ``x / descale`` (descale (Hk,)) in
    float32, saturated to the dtype's finite range, rounded to nearest even (FA3's and vLLM's
    convention: the cache holds x / descale, read back as cache * descale)."""
    largest = torch.finfo(dtype).max
    return (x.float() / descale[:, None]).clamp(-largest, largest).to(dtype)


def _key_slots(b, positions, cache_rows, block_table, page_size):
    """Index tuple into a cache for sequence b's key positions: (row, position) of a contiguous
    cache, (page, slot) of a paged one (``docs/design.md``, "Semantics", Keys)."""
    if block_table is None:
        return cache_rows[b], positions
    return block_table[b].long()[positions // page_size], positions % page_size


def reference_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        rotary_interleaved=True, alibi_slopes=None, compute_dtype=torch.float32, *,
                        k_descale=None, v_descale=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None):
    """``flash_attn_with_kvcache``'s whole surface in float32 (``docs/design.md``, "Semantics").

    Appends ``k`` (rotated) and ``v`` into the caches in place, at positions ``[cache_seqlens[b],
    + seqlen_new)`` of cache row ``cache_batch_idx[b]`` or of the pages of ``block_table[b]``, then
    attends each sequence over only the keys it can see. ``cache_seqlens``: None (every row at
    capacity), an int, or a (B,) tensor. ``sinks`` (H,) float32: each head's sink logit joins every
    row's softmax denominator and lse. Assumes validated arguments. Returns out (B, Sq, H, D) in q's
    dtype and lse (B, H, Sq) float32; with ``cu_seqlens_q`` see ``_reference_ragged`` (``max_seqlen_q``
    is taken for the public call's sake: the rows come from ``cu_seqlens_q``).
    ``compute_dtype=q.dtype`` computes scores, probabilities and values in the inputs' dtype instead:
    a same-dtype run whose error sets the benchmark's tolerance (``bench.correctness``), as
    ``attention_ref(upcast=False)`` does in the tests.
    """
    if cu_seqlens_q is not None:
        return _reference_ragged(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                 rotary_interleaved, alibi_slopes, sinks, cu_seqlens_q, compute_dtype=compute_dtype,
                                 k_descale=k_descale, v_descale=v_descale)
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    page_size = k_cache.shape[1] if block_table is not None else 0
    capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    lengths = per_sequence(cache_seqlens, batch, capacity)
    leftpads = per_sequence(cache_leftpad, batch, 0)
    cache_rows = list(range(batch)) if cache_batch_idx is None else per_sequence(cache_batch_idx, batch, 0)
    window_left, window_right = (int(side) for side in window_size)
    if causal:
        window_right = 0
    window_left = -1 if window_left >= capacity else window_left
    window_right = -1 if window_right >= capacity else window_right
    windowed = window_left >= 0 or window_right >= 0
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    device = q.device
    starts = torch.tensor(lengths, device=device)
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_scales = descale_table(k_descale, batch, nheads_k, device) if fp8 else None
    v_scales = descale_table(v_descale, batch, nheads_k, device) if fp8 else None

    if rotary_cos is not None:
        if windowed:  # query row i at cache_seqlens[b] + i, else every row at cache_seqlens[b]
            q = apply_rotary(q, rotary_cos, rotary_sin, starts, rotary_interleaved)
        else:
            rows = q.reshape(batch, 1, seqlen_q * nheads, headdim)
            q = apply_rotary(rows, rotary_cos, rotary_sin, starts, rotary_interleaved).view_as(q)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, starts, rotary_interleaved)
    if k is not None:
        for b in range(batch):
            positions = torch.arange(lengths[b], lengths[b] + seqlen_new, device=device)
            kept = positions < capacity  # writes past the capacity are skipped
            slots = _key_slots(b, positions[kept], cache_rows, block_table, page_size)
            if fp8:
                k_cache[slots] = quantise(k[b][kept], k_scales[b], k_cache.dtype)
                v_cache[slots] = quantise(v[b][kept], v_scales[b], v_cache.dtype)
            else:
                k_cache[slots] = k[b][kept]
                v_cache[slots] = v[b][kept]

    out = torch.zeros(batch, seqlen_q, nheads, headdim, dtype=torch.float32, device=device)
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=device)
    for b in range(batch):
        end = min(lengths[b] + seqlen_new, capacity)
        first = max(leftpads[b], end - seqlen_q - window_left if window_left >= 0 else 0, 0)
        if first >= end:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]).float().view(nheads_k, group, 1, 1)
        query = q[b].to(compute_dtype).permute(1, 0, 2).reshape(nheads_k, group * seqlen_q, headdim)
        positions_q = end - seqlen_q + torch.arange(seqlen_q, device=device)
        descales = None if not fp8 else (k_scales[b].view(nheads_k, 1, 1), v_scales[b].view(nheads_k, 1, 1))
        out[b], lse[b] = _attend_sequence(query, k_cache, v_cache, b, first, end, positions_q, cache_rows,
                                          block_table, page_size, scale, softcap, window_left, window_right, slopes,
                                          descales, sinks)
    if sinks is not None:  # rows that see no key: the sink alone (out stays 0; a sink of +inf: NaN, as above)
        sink = sinks.float().view(1, nheads, 1).expand_as(lse)
        alone = torch.isneginf(lse)
        lse = torch.where(alone, torch.where(sink.isposinf(), float("nan"), sink), lse)
        out[(alone & sink.isposinf()).transpose(1, 2)] = float("nan")
    return out.to(q.dtype), lse


def _reference_ragged(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                      alibi_slopes, sinks, cu_seqlens_q, *, compute_dtype, k_descale, v_descale):
    """Ragged queries: q (total_q, H, D), sequence b's rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])``
    (bottom-right aligned to its own keys) and, with ``k``/``v`` (total_q, Hk, D), as many appended
    tokens from the same rows; each sequence is the padded call of batch 1 over its own rows.
    Returns out (total_q, H, D) in q's dtype and lse (H, total_q) float32 (rows of no sequence: 0
    and -inf), as FlashAttention 3's kvcache call with cu_seqlens_q."""
    total_q, nheads, _ = q.shape
    bounds = [int(item) for item in cu_seqlens_q.tolist()]
    batch = len(bounds) - 1
    lengths = per_sequence(cache_seqlens, batch, None)
    leftpads = None if cache_leftpad is None else per_sequence(cache_leftpad, batch, 0)
    cache_rows = list(range(batch)) if cache_batch_idx is None else per_sequence(cache_batch_idx, batch, 0)
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    nheads_k = k_cache.shape[2]
    k_scales = descale_table(k_descale, batch, nheads_k, q.device) if fp8 else None
    v_scales = descale_table(v_descale, batch, nheads_k, q.device) if fp8 else None
    out = torch.zeros_like(q)
    lse = torch.full((nheads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        first, last = bounds[b], bounds[b + 1]
        if last <= first:
            continue
        rows = slice(first, last)
        if block_table is None:  # the sequence's own cache row
            caches, table = (k_cache[cache_rows[b]:cache_rows[b] + 1], v_cache[cache_rows[b]:cache_rows[b] + 1]), None
        else:
            caches, table = (k_cache, v_cache), block_table[b:b + 1]
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        out_b, lse_b = reference_attention(
            q[rows].unsqueeze(0), *caches, None if k is None else k[rows].unsqueeze(0),
            None if v is None else v[rows].unsqueeze(0), rotary_cos, rotary_sin, lengths[b],
            None, None if leftpads is None else leftpads[b], table, softmax_scale, causal, window_size, softcap,
            rotary_interleaved, slopes, compute_dtype, sinks=sinks,
            k_descale=None if k_scales is None else k_scales[b:b + 1],
            v_descale=None if v_scales is None else v_scales[b:b + 1])
        out[rows], lse[:, rows] = out_b[0], lse_b[0]
    return out, lse


def _attend_sequence(query, k_cache, v_cache, b, first, end, positions_q, cache_rows, block_table, page_size,
                     scale, softcap, window_left, window_right, slopes, descales=None, sinks=None):
    """(out (Sq, H, D), lse (H, Sq)) of one sequence over its keys [first, end): scores chunk by
    chunk, one masked softmax, then the values chunk by chunk, in query's dtype. query: (Hk, G * Sq, D);
    descales: None, or the (k, v) descales (Hk, 1, 1) of an fp8 cache, which each chunk is
    dequantised by (in float32, before the cast to query's dtype)."""
    nheads_k, rows, headdim = query.shape
    seqlen_q = positions_q.shape[0]
    group = rows // seqlen_q
    chunks = [(lo, min(lo + KEY_CHUNK, end)) for lo in range(first, end, KEY_CHUNK)]
    device = query.device

    def keys(cache, lo, hi, descale):  # (Hk, hi - lo, D) in query's dtype
        if block_table is None:
            chunk = cache[cache_rows[b], lo:hi].float().permute(1, 0, 2)
        else:
            slots = _key_slots(b, torch.arange(lo, hi, device=device), cache_rows, block_table, page_size)
            chunk = cache[slots].float().permute(1, 0, 2)
        return (chunk if descale is None else chunk * descale).to(query.dtype)

    k_descale, v_descale = (None, None) if descales is None else descales
    scores = torch.cat([query @ keys(k_cache, lo, hi, k_descale).transpose(1, 2) for lo, hi in chunks], dim=-1)
    scores = scores.view(nheads_k, group, seqlen_q, end - first) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    positions_k = torch.arange(first, end, device=device)
    if slopes is not None:
        scores = scores - slopes * (positions_q[:, None] - positions_k[None, :]).abs()
    visible = window_mask(positions_q, positions_k, window_left, window_right).expand_as(scores)
    probs, lse = masked_softmax(scores, visible, None if sinks is None else sinks.view(nheads_k, group, 1))
    probs = probs.view(nheads_k, rows, end - first).to(query.dtype)  # ALiBi's float32 slopes promote the scores
    out = sum(probs[..., lo - first:hi - first] @ keys(v_cache, lo, hi, v_descale) for lo, hi in chunks)
    out = out.view(nheads_k * group, seqlen_q, headdim).transpose(0, 1)
    return out, lse.reshape(nheads_k * group, seqlen_q)
