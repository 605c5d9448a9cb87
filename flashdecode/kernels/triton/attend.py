"""The split kernel's building blocks: packed query rows, rotary, where a key lives, one KV block.

Every feature is a constexpr flag, so the plain specialization compiles none of their code
(``docs/design.md``, "Semantics", defines each feature). Scores are kept in base 2 (log2(e) folded
into the scale, the softcap and the ALiBi slopes) with float32 accumulators. fp8 caches (FP8) are
converted to float16 in registers, one instruction a pair (the caller converts q once,
``fp16_rows``); their k descale is folded into the scale by the caller and their v descale into the
output, and appended tokens are ``quantise``d as the cache stores them.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

LOG2E = tl.constexpr(1.0 / math.log(2.0))


@triton.jit
def row_offsets(rows, head_k, stride_i, stride_h, GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr):
    """Offset of packed row r = i * GROUP + g in a (batch, seqlen_q, nheads, ...) tensor: query
    position i of head head_k * GROUP + g."""
    if SEQLEN_Q == 1:
        return (head_k * GROUP + rows) * stride_h
    else:
        return (rows // GROUP) * stride_i + (head_k * GROUP + rows % GROUP) * stride_h


@triton.jit
def rotary_columns(ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, HEAD_PAD: tl.constexpr):
    """For each head dimension d: its rotary partner, its column in the cos/sin tables, the sign of
    the partner's term, and whether d is rotated (d < rotary_dim)."""
    d = tl.arange(0, HEAD_PAD)
    if ROTARY_INTERLEAVED:  # pairs (2c, 2c + 1)
        partner = d ^ 1
        column = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:  # pairs (c, c + rotary_dim / 2)
        first_half = d < ROTARY_DIM // 2
        partner = tl.where(first_half, d + ROTARY_DIM // 2, d - ROTARY_DIM // 2)
        column = tl.where(first_half, d, d - ROTARY_DIM // 2)
        sign = tl.where(first_half, -1.0, 1.0)
    return partner, column, sign, d < ROTARY_DIM


@triton.jit
def rotate(x, x_partner, positions, Cos, Sin, rotary_rows, column, sign, rotating, ROTARY_DIM: tl.constexpr):
    """x rotated at ``positions`` (one per row, clamped into the tables), in float32, where
    ``rotating`` (rows x dims) holds; elsewhere (dimensions past rotary_dim, rows not rotated) x
    passes through."""
    positions = tl.minimum(tl.maximum(positions, 0), rotary_rows - 1)
    table = positions[:, None] * (ROTARY_DIM // 2) + column[None, :]
    cos = tl.load(Cos + table, mask=rotating, other=1.0).to(tl.float32)
    sin = tl.load(Sin + table, mask=rotating, other=0.0).to(tl.float32)
    return x.to(tl.float32) * cos + x_partner.to(tl.float32) * (sin * sign[None, :])


@triton.jit
def quantise(x, descale, dtype: tl.constexpr):
    """``x / descale`` in float32, saturated to the fp8 ``dtype``'s finite range and rounded to the
    nearest even value of its grid, as ``dtype`` (``reference.quantise``). The rounding is done in
    float32 (adding and taking away 1.5 * 2^(23 + e) rounds to multiples of 2^e, e the grid step
    at the value): the conversion then only changes the type, exact whether compiled or interpreted
    (Triton 3.9's interpreter rounds its fp8 conversions wrongly: 125 to 64, 100 to 104)."""
    if dtype.is_fp8e4nv():
        largest: tl.constexpr = 448.0
    else:
        largest: tl.constexpr = 57344.0
    y = tl.clamp(tl.div_rn(x.to(tl.float32), descale), -largest, largest, propagate_nan=tl.PropagateNan.ALL)
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(exponent, 1 - dtype.exponent_bias) - dtype.fp_mantissa_width  # log2 of the grid step
    magic = ((step + 150) << 23 | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 * 2^(23 + step)
    return ((y + magic) - magic).to(dtype)


@triton.jit
def fp16_rows(q):
    """(q in float16, each row's factor 2^e): row r scaled by 2^-e, e = max(0, exponent of its
    largest |value| - 14), so its values stay below 2^15 (float16's largest is 65504: a bfloat16 row
    past it would turn inf) and the scaling is exact; the row's scores are multiplied by 2^e. Rows
    within float16's range (every realistic q) take e = 0: the conversion alone. The factors are
    built from their bits (e <= 114 for any row, inf and NaN included: finite, no rounding)."""
    wide = q.to(tl.float32)
    largest = tl.max(tl.abs(wide), 1)
    e = tl.maximum(((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 14, 0)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    return (wide * down[:, None]).to(tl.float16), up


#: fp8 V tiles read as 16-bit words (``TritonConfig.fp8_v_words``; iterations.md entries 46-47): a
#: plain cast (``v.to``) lets Triton hoist the dot operand's layout conversion above it, so each
#: thread reads its operand bytes from shared memory one at a time (``ld.shared.b8``: V is
#: contracted over keys, a head dim's bytes lie a row apart). Two adjacent head dims of a key as one
#: 16-bit word load with ``ldmatrix.trans`` (a register holds keys k, k + 1 of a dim pair); a byte
#: permute and a ``cvt`` give the float16 operands of the even and of the odd head dims, two
#: products into two accumulators, interleaved after the loop. The interpreter runs no inline
#: assembly: there integer ops convert (``fp8_bits_to_f16``), to the same values.


@triton.jit
def fp8_bits_to_f16(bits, E5M2: tl.constexpr):
    """Float16 of the fp8 values whose bytes are the low 8 bits of ``bits`` (an integer tile), by
    integer ops: exact for e4m3fn (NaN kept) and e5m2. e4m3: its exponent and mantissa shifted into
    float16's fields read as 2^-8 of the value (subnormals included), times 2^8 in float16."""
    bits = bits.to(tl.uint16, bitcast=True) & 0xFF
    if E5M2:
        return (bits << 8).to(tl.float16, bitcast=True)
    else:
        sign = (bits & 0x80) << 8
        magnitude = bits & 0x7F
        scaled = ((magnitude << 7) | sign).to(tl.float16, bitcast=True) * 256.0
        return tl.where(magnitude == 0x7F, (sign | 0x7E00).to(tl.float16, bitcast=True), scaled)


#: Whether Triton's interpreter runs the kernels (no inline assembly there).
INTERPRETED = tl.constexpr(not isinstance(fp8_bits_to_f16, JITFunction))


@triton.jit
def fp8_pair_to_f16(words, HIGH: tl.constexpr, E5M2: tl.constexpr):
    """Float16 of the low (HIGH false) or high byte of each 16-bit word of ``words`` (fp8 V read
    as words): a byte permute and one ``cvt`` a pair of words, pure, so that Triton hoists the
    operand layout above it, to the 16-bit load (``cvt.rn.f16x2.e4m3x2``: sm_89 and later)."""
    if INTERPRETED:
        if HIGH:
            words = words >> 8
        return fp8_bits_to_f16(words, E5M2)
    if E5M2:
        cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
    else:
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
    if HIGH:
        half: tl.constexpr = "hi"
    else:
        half: tl.constexpr = "lo"
    # the same permute in both calls (ptxas may keep one): low bytes below, high bytes above
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, 0x3120; mov.b32 {lo, hi}, t; "
        + cvt + " $0, " + half + "; }", "=r,r", [words], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def cache_offsets(tokens, block_start, in_range, table_row, num_pages, stride_kp, stride_kt, stride_vp, stride_vt,
                  PAGE_SIZE: tl.constexpr, OFFSETS_32: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K offsets, V offsets) of the tokens of one block, relative to the KV head's base. Paged:
    token t is row t % PAGE_SIZE of page block_table[b, t // PAGE_SIZE], one lookup per block when a
    page holds whole blocks, else one per token in range; block ids are clamped into [0, num_pages)
    (``bad_block_ids`` reports them, once per program). With OFFSETS_32 (every element of the cache
    within 2^31 - 1 of its start) the paged offsets are 32-bit: a third fewer instructions in the
    loop of pages smaller than a block, where every token has its own address."""
    if PAGE_SIZE == 0:
        offsets = tokens.to(tl.int64)
        return offsets * stride_kt, offsets * stride_vt
    elif PAGE_SIZE >= BLOCK_N:
        page = tl.load(table_row + block_start // PAGE_SIZE)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        rows = block_start % PAGE_SIZE + tl.arange(0, BLOCK_N)
        if not OFFSETS_32:
            page, rows = page.to(tl.int64), rows.to(tl.int64)
        return page * stride_kp + rows * stride_kt, page * stride_vp + rows * stride_vt
    else:
        # tokens >= 0: unsigned, // and % are a shift and a mask
        pages = tl.load(table_row + tokens.to(tl.uint32) // PAGE_SIZE, mask=in_range, other=0)
        pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1)
        rows = tokens & (PAGE_SIZE - 1)
        if not OFFSETS_32:
            pages, rows = pages.to(tl.int64), rows.to(tl.int64)
        return pages * stride_kp + rows * stride_kt, pages * stride_vp + rows * stride_vt


#: Table entries one step of ``bad_block_ids`` reads (each step waits on its load).
SCAN = tl.constexpr(128)


@triton.jit
def bad_block_ids(table_row, start, end, num_pages, PAGE_SIZE: tl.constexpr):
    """1 if a block id that the keys [start, end) use lies outside [0, num_pages), else 0. One pass
    over the program's table entries before its loop, so that the loop only clamps: a check per
    block costs pages smaller than a block a reduction across the program and its barriers in every
    step (``docs/design.md``, "Measured choices")."""
    first = start // PAGE_SIZE
    last = tl.where(start < end, tl.cdiv(end, PAGE_SIZE), first)
    bad = tl.zeros([SCAN], tl.int32)
    for entry in tl.range(first, last, SCAN, num_stages=1):
        entries = entry + tl.arange(0, SCAN)
        ids = tl.load(table_row + entries, mask=entries < last, other=0)
        bad |= ((ids < 0) | (ids >= num_pages)).to(tl.int32)
    return tl.max(bad, 0)


@triton.jit
def tile_mask(token_mask, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """(tokens, dims) mask of a tile of rows over head dims d (all HEAD_PAD, or a chunk of them): its
    rows' ``token_mask``, and where the head is padded, the dims below HEAD_DIM."""
    if HEAD_PAD == HEAD_DIM:
        return token_mask[:, None]
    else:
        return token_mask[:, None] & (d[None, :] < HEAD_DIM)


@triton.jit
def attend_block(acc, m, l, q, block_start, start, end, new_from,
                 k_head, v_head, table_row, num_pages, stride_kp, stride_kt, stride_vp, stride_vt,
                 k_new, v_new, stride_nkt, stride_nvt, Cos, Sin, rotary_rows,
                 row_pos, slopes, window_left, window_right, scale_log2, softcap_in, softcap_out, k_scale, v_scale,
                 ROW_MASKS: tl.constexpr, PAGE_SIZE: tl.constexpr, OFFSETS_32: tl.constexpr, APPEND: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                 WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LEFTPAD: tl.constexpr,
                 FP8: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 FP8_V_WORDS: tl.constexpr):
    """One KV block folded into the online softmax (acc, m, l). Keys outside [start, end) are
    dropped (a column mask). Without ROW_MASKS (the main loop) every key is cached and seen by
    every row. With ROW_MASKS (the head and tail blocks) keys outside each row's window are dropped
    too, and keys from ``new_from`` on are appended tokens read from k_new/v_new (k rotated at its
    position), never from the cache; a row may then see no key of the block, so a row max of -inf
    is guarded.

    k_head/v_head: the KV head's base (a cache row's, or the pages' with the block table row);
    row_pos: each query row's absolute position; slopes: ALiBi slopes * log2(e); scale_log2:
    softmax_scale * log2(e); softcap_in/out: the softcap's inner and outer factors (k's descale
    folded into scale_log2 and softcap_in; with ``fp16_rows``'s q, per-row factors of shape
    (BLOCK_M, 1) with its rows' 2^e). FP8: cached K/V are converted to q's dtype (float16) as loaded,
    appended tokens are ``quantise``d by k_scale/v_scale (the descales) and converted so, and the
    caller multiplies the output by v's descale. FP8_V_WORDS (fp8 caches, the main loop only: no
    row masks, no appended tokens): the cached V read as 16-bit words (``fp8_pair_to_f16``), acc
    then the pair (even head dims, odd head dims)."""
    tokens = block_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_PAD)
    in_range = tokens < end
    if LEFTPAD or ROW_MASKS:
        in_range = in_range & (tokens >= start)
    k_offs, v_offs = cache_offsets(tokens, block_start, in_range, table_row, num_pages,
                                   stride_kp, stride_kt, stride_vp, stride_vt, PAGE_SIZE, OFFSETS_32, BLOCK_N)
    k_ptrs = k_head + k_offs[:, None] + d[None, :]
    v_ptrs = v_head + v_offs[:, None] + d[None, :]
    if ROW_MASKS and APPEND:  # appended tokens come from k_new/v_new: the cache rows are being written
        fresh = tokens >= new_from
        new_rows = (tokens - new_from)[:, None]
        if FP8:  # a cache token and a new one differ in type: two loads, one of them masked off
            k = tl.load(k_ptrs, mask=tile_mask(in_range & ~fresh, d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
            k_fresh = tl.load(k_new + new_rows * stride_nkt + d[None, :],
                              mask=tile_mask(in_range & fresh, d, HEAD_DIM, HEAD_PAD), other=0.0)
        else:
            k_ptrs = tl.where(fresh[:, None], k_new + new_rows * stride_nkt + d[None, :], k_ptrs)
            v_ptrs = tl.where(fresh[:, None], v_new + new_rows * stride_nvt + d[None, :], v_ptrs)
            k_fresh = tl.load(k_ptrs, mask=tile_mask(in_range, d, HEAD_DIM, HEAD_PAD), other=0.0)
        if ROTARY_DIM > 0:
            partner, column, sign, rotated = rotary_columns(ROTARY_DIM, ROTARY_INTERLEAVED, HEAD_PAD)
            rotating = (in_range & fresh)[:, None] & rotated[None, :]
            k_partner = tl.load(k_new + new_rows * stride_nkt + partner[None, :], mask=rotating, other=0.0)
            k_fresh = rotate(k_fresh, k_partner, tokens, Cos, Sin, rotary_rows, column, sign, rotating,
                             ROTARY_DIM).to(k_fresh.dtype)
        if FP8:
            k = tl.where(fresh[:, None], quantise(k_fresh, k_scale, k_head.dtype.element_ty).to(q.dtype), k)
        else:
            k = k_fresh
    else:
        k = tl.load(k_ptrs, mask=tile_mask(in_range, d, HEAD_DIM, HEAD_PAD), other=0.0)
        if FP8:
            k = k.to(q.dtype)

    scores = tl.dot(q, tl.trans(k))
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        scores = softcap_out * (1.0 - 2.0 / (tl.exp2(scores * softcap_in) + 1.0))
    else:
        scores = scores * scale_log2
    if ALIBI:
        scores -= slopes[:, None] * tl.abs(row_pos[:, None] - tokens[None, :]).to(tl.float32)
    visible = in_range[None, :]
    if ROW_MASKS and WINDOW_LEFT:
        visible = visible & (tokens[None, :] >= row_pos[:, None] - window_left)
    if ROW_MASKS and WINDOW_RIGHT:
        visible = visible & (tokens[None, :] <= row_pos[:, None] + window_right)
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m, tl.max(scores, 1))
    if ROW_MASKS and (WINDOW_LEFT or WINDOW_RIGHT):
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new_safe)
        p = tl.exp2(scores - m_new_safe[:, None])
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)

    if FP8_V_WORDS:
        d2 = tl.arange(0, HEAD_PAD // 2)
        words = tl.load(v_head.to(tl.pointer_type(tl.int16)) + (v_offs // 2)[:, None] + d2[None, :],
                        mask=tile_mask(in_range, d2, HEAD_DIM // 2, HEAD_PAD // 2), other=0)
        e5m2: tl.constexpr = v_head.dtype.element_ty.is_fp8e5()
        p = p.to(tl.float16)
        acc_even, acc_odd = acc
        acc = (acc_even * alpha[:, None] + tl.dot(p, fp8_pair_to_f16(words, False, e5m2)),
               acc_odd * alpha[:, None] + tl.dot(p, fp8_pair_to_f16(words, True, e5m2)))
    else:
        if ROW_MASKS and APPEND and FP8:
            v = tl.load(v_ptrs, mask=tile_mask(in_range & ~fresh, d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
            v_fresh = tl.load(v_new + new_rows * stride_nvt + d[None, :],
                              mask=tile_mask(in_range & fresh, d, HEAD_DIM, HEAD_PAD), other=0.0)
            v = tl.where(fresh[:, None], quantise(v_fresh, v_scale, v_head.dtype.element_ty).to(q.dtype), v)
        else:
            v = tl.load(v_ptrs, mask=tile_mask(in_range, d, HEAD_DIM, HEAD_PAD), other=0.0)
            if FP8:
                v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l


@triton.jit
def append_tokens(k_head, v_head, table_row, num_pages, stride_kp, stride_kt, stride_vp, stride_vt,
                  k_new, v_new, stride_nkt, stride_nvt, Cos, Sin, rotary_rows, first_position, seqlen_new, capacity,
                  k_scale, v_scale, PAGE_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr,
                  ROTARY_INTERLEAVED: tl.constexpr, FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the appended tokens (k rotated at its position, in k's dtype) into the cache at positions
    ``first_position + j``, skipping positions outside [0, capacity) and pages with a bad block id,
    which it reports; an fp8 cache (FP8) takes them ``quantise``d by k_scale/v_scale. Arguments as
    for ``attend_block``."""
    d = tl.arange(0, HEAD_PAD)
    bad = tl.zeros([], tl.int32)
    for j0 in range(0, seqlen_new, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        given = j < seqlen_new
        positions = first_position + j
        write = given & (positions >= 0) & (positions < capacity)
        if PAGE_SIZE > 0:
            pages = tl.load(table_row + positions // PAGE_SIZE, mask=write, other=0)
            page_bad = write & ((pages < 0) | (pages >= num_pages))
            bad = bad | tl.max(page_bad.to(tl.int32), 0)
            write = write & ~page_bad
            pages = pages.to(tl.int64)
            rows = (positions % PAGE_SIZE).to(tl.int64)
            k_offs = pages * stride_kp + rows * stride_kt
            v_offs = pages * stride_vp + rows * stride_vt
        else:
            k_offs = positions.to(tl.int64) * stride_kt
            v_offs = positions.to(tl.int64) * stride_vt
        read = tile_mask(given, d, HEAD_DIM, HEAD_PAD)
        k = tl.load(k_new + j[:, None] * stride_nkt + d[None, :], mask=read, other=0.0)
        if ROTARY_DIM > 0:
            partner, column, sign, rotated = rotary_columns(ROTARY_DIM, ROTARY_INTERLEAVED, HEAD_PAD)
            rotating = given[:, None] & rotated[None, :]
            k_partner = tl.load(k_new + j[:, None] * stride_nkt + partner[None, :], mask=rotating, other=0.0)
            k = rotate(k, k_partner, positions, Cos, Sin, rotary_rows, column, sign, rotating, ROTARY_DIM)
        if FP8:  # rounded to k's dtype first, as the reference rotates
            k = quantise(k.to(k_new.dtype.element_ty), k_scale, k_head.dtype.element_ty)
        written = tile_mask(write, d, HEAD_DIM, HEAD_PAD)
        tl.store(k_head + k_offs[:, None] + d[None, :], k.to(k_head.dtype.element_ty), mask=written)
        v = tl.load(v_new + j[:, None] * stride_nvt + d[None, :], mask=read, other=0.0)
        if FP8:
            v = quantise(v, v_scale, v_head.dtype.element_ty)
        tl.store(v_head + v_offs[:, None] + d[None, :], v, mask=written)
    return bad
