"""FlashAttention 2.8.3's ``test_flash_attn_kvcache`` grid, rebuilt: its axes, values, skips, inputs
and tolerance rule, plus deterministic stratified samples of the grid and a per-feature report.

One combo of the grid is checked as FlashAttention checks it: the caches are materialized per
sequence (pages gathered through the block table, rows through ``cache_batch_idx``), the appended
tokens written into that copy, K/V repeated for GQA, and the dense float32 ``attention_ref`` on a
key padding mask is the oracle. The system's error must be at most 3x (5x with ALiBi) that of a
same-dtype PyTorch run (``upcast=False, reorder_ops=True``) plus 1e-5; the cache after the call
must hold the appended k (rotated) within 1e-3 and exactly the appended v.

Beyond FlashAttention's list: dtypes float16 and bfloat16 (its list has float16 only),
``has_batch_idx`` True too (its list has only False, True commented out), and the lse is checked by
the same rule as the output. ALiBi's bias is ``-slope * |p_i - t|`` for every row (FlashAttention's
causal variant differs from it by a per-row constant, which no softmax sees; this one also fixes lse).

fp8 caches (``FP8_AXES``, drawn with ``restrict``): two more axes, the cache dtype (float8_e4m3fn,
float8_e5m2; q stays float16/bfloat16) and a softcap (0 or 30; FlashAttention's list has none). The
caches are drawn as above and quantised with per-(sequence, KV head) descales (the call's k_descale,
v_descale); the oracle and the same-dtype PyTorch run see the dequantised caches (the latter rounded
to q's dtype), and the appended tokens as the cache stores them (``reference.quantise``). After the
call the cache must hold v exactly and k within one fp8 step (a rotation rounded otherwise may land
on the neighbour).

Two axes beyond FlashAttention 2 (``EXTENSION_AXES``, off in its grid, drawn where a sample's
``restrict`` names them): ``sinks`` (a float32 sink logit per head, ``attention_ref``'s ``sinks``)
and ``ragged`` (q packed by ``cu_seqlens_q``, FlashAttention 3's layout: sequence b keeps the last
``q_b`` of the grid's seqlen_q rows, drawn in [1, seqlen_q], and appends its first ``q_b`` new
tokens; the oracle is the padded call's rows at the same positions, packed).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import time
import zlib

import pytest
import torch

from flashdecode.problem import ALIBI_PER_SEQUENCE, Problem, offsets_fit_32
from flashdecode.reference import apply_rotary, attention_ref, quantise

SEQLEN_PAIRS = ((1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                (1, 128 * 1024), (16, 128 * 1024), (128, 128))

#: The grid's axes and values, in FlashAttention's order (``seqlens`` is its (seqlen_q, seqlen_k)).
AXES = {
    "dtype": ("float16", "bfloat16"),
    "num_splits": (1, 0),
    "mha_type": ("mha", "mqa", "gqa"),
    "new_kv": (False, True),
    "alibi": (False, True),
    "local": (False, True),
    "causal": (False, True),
    "seqlen_new_eq_seqlen_q": (True, False),
    "rotary_interleaved": (False, True),
    "rotary_fraction": (0.0, 0.5, 1.0),
    "paged_kv_block_size": (None, 256),
    "has_leftpad": (False, True),
    "has_batch_idx": (False, True),
    "d": (32, 59, 64, 80, 128, 256),
    "seqlens": SEQLEN_PAIRS,
}
#: Axes beyond FlashAttention 2's grid: False in its combos, drawn only where ``restrict`` names them.
EXTENSION_AXES = {"sinks": (False, True), "ragged": (False, True)}
BATCH, NHEADS = 2, 6
NHEADS_K = {"mha": 6, "mqa": 1, "gqa": 3}
#: The fp8 part of the grid: ``restrict`` of ``sample`` with these adds the cache dtype and softcap axes.
FP8_AXES = {"kv_dtype": ("float8_e4m3fn", "float8_e5m2"), "softcap": (0.0, 30.0)}


@dataclasses.dataclass(frozen=True)
class Combo:
    """One point of the grid."""

    dtype: str
    num_splits: int
    mha_type: str
    new_kv: bool
    alibi: bool
    local: bool
    causal: bool
    seqlen_new_eq_seqlen_q: bool
    rotary_interleaved: bool
    rotary_fraction: float
    paged_kv_block_size: int | None
    has_leftpad: bool
    has_batch_idx: bool
    d: int
    seqlens: tuple
    kv_dtype: str | None = None  # None: the caches in q's dtype; else an fp8 dtype (FP8_AXES)
    softcap: float = 0.0
    sinks: bool = False
    ragged: bool = False

    @property
    def id(self) -> str:
        seqlen_q, seqlen_k = self.seqlens
        flags = [name for name, on in (("newkv", self.new_kv), ("alibi", self.alibi), ("local", self.local),
                                       ("causal", self.causal), ("leftpad", self.has_leftpad),
                                       ("bidx", self.has_batch_idx), ("sinks", self.sinks),
                                       ("ragged", self.ragged)) if on]
        if self.new_kv:
            flags.append("neweq" if self.seqlen_new_eq_seqlen_q else "newlt")
        if self.rotary_fraction:
            flags.append(f"rot{self.rotary_fraction}{'i' if self.rotary_interleaved else 'h'}")
        if self.paged_kv_block_size:
            flags.append(f"page{self.paged_kv_block_size}")
        if self.kv_dtype:
            flags.append(self.kv_dtype.replace("_", ""))
        if self.softcap:
            flags.append(f"softcap{self.softcap}")
        return "-".join([f"{self.dtype}", f"q{seqlen_q}k{seqlen_k}", f"d{self.d}", self.mha_type,
                         f"splits{self.num_splits}", *flags])

    def features(self) -> list[str]:
        """``axis=value`` of every axis: the keys of the report (FP8_AXES' for fp8 combos only, and the
        extension axes where on, so the other combos' samples stay as they were)."""
        axes = [*AXES, *FP8_AXES] if self.kv_dtype else AXES
        return [f"{axis}={getattr(self, axis)}" for axis in axes] + \
            [f"{axis}=True" for axis in EXTENSION_AXES if getattr(self, axis)]

    @classmethod
    def from_id(cls, text: str) -> Combo:
        """The combo an ``id`` names; axes the id leaves out because they do not apply (the rotary
        layout without rotary, the appended length without new k/v) take their first value."""
        dtype, lengths, d, mha_type, splits, *flags = text.split("-")
        seqlen_q, seqlen_k = lengths.removeprefix("q").split("k")
        rotary = next((flag for flag in flags if flag.startswith("rot")), None)
        page = next((flag for flag in flags if flag.startswith("page")), None)
        fp8 = next((name for name in FP8_AXES["kv_dtype"] if name.replace("_", "") in flags), None)
        softcap = next((float(flag[7:]) for flag in flags if flag.startswith("softcap")), 0.0)
        return cls(dtype, int(splits.removeprefix("splits")), mha_type, "newkv" in flags, "alibi" in flags,
                   "local" in flags, "causal" in flags, "newlt" not in flags, rotary is not None and rotary[-1] == "i",
                   float(rotary[3:-1]) if rotary else 0.0, int(page[4:]) if page else None, "leftpad" in flags,
                   "bidx" in flags, int(d.removeprefix("d")), (int(seqlen_q), int(seqlen_k)), fp8, softcap,
                   "sinks" in flags, "ragged" in flags)


def skip_reason(combo: Combo) -> str | None:
    """FlashAttention's own skips of its grid (combos it does not run)."""
    seqlen_q, seqlen_k = combo.seqlens
    if seqlen_q > seqlen_k and combo.new_kv:
        return "seqlen_q > seqlen_k with new k/v"
    if not combo.new_kv and combo.rotary_fraction > 0:
        return "rotary without new k/v"
    if combo.paged_kv_block_size and (combo.has_batch_idx or combo.has_leftpad):
        return "paged with cache_batch_idx or cache_leftpad"
    if combo.ragged and combo.new_kv and not combo.seqlen_new_eq_seqlen_q:
        return "ragged queries append as many tokens as their rows"
    return None


def _axes(dtypes, max_seqlen_k):
    axes = dict(AXES, dtype=tuple(dtypes))
    if max_seqlen_k is not None:
        axes["seqlens"] = tuple(pair for pair in SEQLEN_PAIRS if pair[1] <= max_seqlen_k)
    return axes


def _split_axes(dtypes, max_seqlen_k, restrict):
    """(the grid's axes, the axes beyond it that ``restrict`` names: ``EXTENSION_AXES``' and
    ``FP8_AXES``'), each with ``restrict``'s values."""
    restrict = restrict or {}
    axes = {**_axes(dtypes, max_seqlen_k), **{axis: values for axis, values in restrict.items() if axis in AXES}}
    return axes, {axis: values for axis, values in restrict.items() if axis in EXTENSION_AXES or axis in FP8_AXES}


def full_grid(dtypes=AXES["dtype"], max_seqlen_k=None, restrict=None) -> list[Combo]:
    """Every combo FlashAttention runs (its skips removed), for these dtypes and sizes; ``restrict``
    as for ``sample``."""
    axes, extension = _split_axes(dtypes, max_seqlen_k, restrict)
    combos = (dataclasses.replace(Combo(*values), **dict(zip(extension, extra)))
              for values in itertools.product(*axes.values()) for extra in itertools.product(*extension.values()))
    return [combo for combo in combos if skip_reason(combo) is None]


def distinct(combos) -> list[Combo]:
    """``combos`` without repeats of an id (combos that differ only in axes that do not apply)."""
    return list({combo.id: combo for combo in combos}.values())


def sample(count, seed, dtypes=AXES["dtype"], max_seqlen_k=None, pool=16, restrict=None) -> list[Combo]:
    """``count`` distinct combos, deterministic for ``seed``, stratified over pairs of features:
    each pick is the one of ``pool`` random runnable combos whose (axis=value, axis=value) pairs
    have been seen least, so every value (and nearly every pair of values) appears evenly.
    ``restrict``: {axis: values} drawn from instead of the grid's (a backend's part of the grid), and
    the values of the extension axes it names (``EXTENSION_AXES``; the others stay False)."""
    axes, extension = _split_axes(dtypes, max_seqlen_k, restrict)
    rng = random.Random(seed)
    pair_counts = collections.Counter()
    chosen = {}

    def draw():
        while True:
            combo = Combo(*(rng.choice(values) for values in axes.values()))
            combo = dataclasses.replace(combo, **{axis: rng.choice(values) for axis, values in extension.items()})
            if skip_reason(combo) is None:
                return combo

    def novelty(pairs):
        return sum(1.0 / (1 + pair_counts[pair]) for pair in pairs)

    for _ in range(count):
        candidates = [combo for combo in (draw() for _ in range(pool)) if combo not in chosen]
        if not candidates:
            continue
        scored = [(list(itertools.combinations(combo.features(), 2)), combo) for combo in candidates]
        pairs, best = max(scored, key=lambda item: novelty(item[0]))
        pair_counts.update(pairs)
        chosen[best] = None
    return list(chosen)


def extension_sample(count_each, seed, **sample_arguments) -> list[Combo]:
    """The grid with its extension axes: ``count_each`` combos (``sample``) of sinks at each split
    count, and of ragged queries (with or without sinks) at each pair of causal and new k/v."""
    parts = [{"sinks": (True,), "num_splits": (splits,)} for splits in AXES["num_splits"]]
    parts += [{"ragged": (True,), "sinks": (False, True), "causal": (causal,), "new_kv": (new_kv,)}
              for causal in AXES["causal"] for new_kv in AXES["new_kv"]]
    return distinct(combo for index, restrict in enumerate(parts)
                    for combo in sample(count_each, seed + index, restrict=restrict, **sample_arguments))


def problem_of(combo: Combo) -> Problem:
    """The Problem the public call validates from ``make_case(combo).call``, without drawing the
    inputs (tools/warmup_tests.py compiles the TileLang kernels of a sample from it). Only the kernel
    shape is exact for appended tokens: ``seqlen_new`` is 1 where the combo draws it."""
    seqlen_q, seqlen_k = combo.seqlens
    pages = math.ceil(seqlen_k / combo.paged_kv_block_size) * 3 if combo.paged_kv_block_size else 0
    left, right = (1, 1) if combo.local else (-1, -1)  # drawn in [0, seqlen_k): they always bind
    if combo.causal:
        right = 0
    if seqlen_q == 1:
        right = -1
    rows = BATCH * (2 if combo.has_batch_idx else 1)
    cache = (BATCH * pages, combo.paged_kv_block_size) if pages else (rows, seqlen_k)  # the call's k_cache
    return Problem(BATCH, pages * combo.paged_kv_block_size if pages else seqlen_k, NHEADS, NHEADS_K[combo.mha_type],
                   combo.d, combo.dtype, seqlen_q=seqlen_q, page_size=combo.paged_kv_block_size or 0,
                   seqlen_new=int(combo.new_kv), rotary_dim=int(combo.rotary_fraction * combo.d) // 16 * 16
                   if combo.new_kv else 0, rotary_interleaved=combo.rotary_interleaved and combo.new_kv
                   and combo.rotary_fraction > 0, window_left=left, window_right=right,
                   softcap=combo.softcap > 0, alibi=ALIBI_PER_SEQUENCE if combo.alibi else 0,
                   leftpad=combo.has_leftpad, batch_idx=combo.has_batch_idx,
                   offsets_32=offsets_fit_32((*cache, NHEADS_K[combo.mha_type], combo.d)), cache_dtype=combo.kv_dtype,
                   sinks=combo.sinks, ragged=combo.ragged)


def padding_mask(seqlen_k, ends, leftpads=None):
    """(B, seqlen_k) bool: keys ``[leftpads[b], ends[b])`` are real."""
    positions = torch.arange(seqlen_k, device=ends.device)
    mask = positions < ends[:, None]
    if leftpads is not None:
        mask &= positions >= leftpads[:, None]
    return mask


def alibi_bias(slopes, seqlen_q, key_padding_mask, leftpads=None):
    """(B, H, Sq, Sk) ALiBi bias ``-slope * |p_i - t|``, with query row i at ``p_i = end_b - Sq + i``
    (``end_b``: one past sequence b's last real key). slopes (H,) or (B, H)."""
    batch, seqlen_k = key_padding_mask.shape
    device = key_padding_mask.device
    start = torch.zeros(batch, dtype=torch.long, device=device) if leftpads is None else leftpads.long()
    ends = start + key_padding_mask.sum(-1)
    positions_q = ends[:, None] - seqlen_q + torch.arange(seqlen_q, device=device)  # (B, Sq)
    distance = (positions_q[:, :, None] - torch.arange(seqlen_k, device=device)).abs().float()
    return -slopes.float().expand(batch, -1)[:, :, None, None] * distance[:, None]


def materialize_pages(pages, block_table, seqlen_k):
    """(B, seqlen_k, Hk, D): each sequence's keys gathered from its pages in block-table order."""
    batch = block_table.shape[0]
    gathered = pages[block_table.long().flatten()]
    return gathered.view(batch, -1, *pages.shape[2:])[:, :seqlen_k]


@dataclasses.dataclass
class Case:
    """One combo's inputs (``call`` kwargs) and what FlashAttention's test expects of them."""

    call: dict
    k_cache_ref: torch.Tensor  # each sequence's cache after the append, materialized
    v_cache_ref: torch.Tensor
    out_ref: torch.Tensor
    lse_ref: torch.Tensor
    out_pt: torch.Tensor
    lse_pt: torch.Tensor


def make_case(combo: Combo, device) -> Case:
    """The inputs of ``combo`` drawn as FlashAttention's test draws them (seeded by the combo's
    id), and the expected outputs and caches."""
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(combo.id.encode()))
    dtype = getattr(torch, combo.dtype)
    seqlen_q, seqlen_k = combo.seqlens
    d, nheads_k = combo.d, NHEADS_K[combo.mha_type]

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    def randint(low, high, shape=(1,)):
        return torch.randint(low, high, shape, generator=generator, device=device, dtype=torch.int32)

    batch_cache = 2 * BATCH if combo.has_batch_idx else BATCH
    rotary_dim = int(combo.rotary_fraction * d) // 16 * 16
    window = tuple(randint(0, seqlen_k, (2,)).tolist()) if combo.local else (-1, -1)
    q = randn(BATCH, seqlen_q, NHEADS, d)
    seqlen_new = seqlen_q if combo.seqlen_new_eq_seqlen_q else int(randint(1, seqlen_q + 1))
    # ragged: sequence b's rows are the last q_rows[b] of q's, its appended tokens the first of k's
    q_rows = randint(1, seqlen_q + 1, (BATCH,)) if combo.ragged else torch.full((BATCH,), seqlen_q, device=device)
    new_rows = q_rows if combo.ragged else torch.full((BATCH,), seqlen_new, device=device)
    k = randn(BATCH, seqlen_new, nheads_k, d) if combo.new_kv else None
    v = randn(BATCH, seqlen_new, nheads_k, d) if combo.new_kv else None
    block_table = None
    if combo.paged_kv_block_size:
        page = combo.paged_kv_block_size
        num_pages = math.ceil(seqlen_k / page) * BATCH * 3
        k_pages, v_pages = randn(num_pages, page, nheads_k, d), randn(num_pages, page, nheads_k, d)
        block_table = torch.randperm(num_pages, generator=generator, device=device).to(torch.int32).view(BATCH, -1)
        k_cache = materialize_pages(k_pages, block_table, seqlen_k)
        v_cache = materialize_pages(v_pages, block_table, seqlen_k)
        rotary_rows = num_pages * page
    else:
        k_pages = k_cache = randn(batch_cache, seqlen_k, nheads_k, d)
        v_pages = v_cache = randn(batch_cache, seqlen_k, nheads_k, d)
        rotary_rows = seqlen_k
    if combo.new_kv:  # the room left for the new tokens (for q too when its rows rotate one by one)
        room = seqlen_q if (combo.causal or combo.local) and rotary_dim > 0 else seqlen_new
        cache_seqlens = randint(0, seqlen_k - room + 1, (BATCH,))
    else:
        cache_seqlens = randint(1, seqlen_k + 1, (BATCH,))
    leftpad = None
    if combo.has_leftpad:
        leftpad = torch.cat([randint(0, n) if n > 0 else randint(0, 1) for n in cache_seqlens.tolist()])
    key_padding_mask = padding_mask(seqlen_k, cache_seqlens + (new_rows if combo.new_kv else 0), leftpad)
    batch_idx = None
    if combo.has_batch_idx:
        batch_idx = torch.randperm(batch_cache, generator=generator, device=device)[:BATCH].to(torch.int32)
    descales = {}
    if combo.kv_dtype:  # each sequence's pages or row stored by its descales (others by sequence 0's)
        fp8 = getattr(torch, combo.kv_dtype)
        descales = {name: 0.5 + torch.rand(BATCH, nheads_k, generator=generator, device=device)
                    for name in ("k_descale", "v_descale")}
        owned = block_table if block_table is not None else \
            (batch_idx if batch_idx is not None else torch.arange(BATCH, device=device))[:, None]

        def stored(rows, descale):
            row_scales = descale[0].expand(rows.shape[0], nheads_k).clone()
            row_scales[owned.long()] = descale[:, None, :]
            return torch.stack([quantise(row, scales, fp8) for row, scales in zip(rows, row_scales)])

        k_pages, v_pages = stored(k_pages, descales["k_descale"]), stored(v_pages, descales["v_descale"])
        k_cache, v_cache = (materialize_pages(k_pages, block_table, seqlen_k), materialize_pages(
            v_pages, block_table, seqlen_k)) if block_table is not None else (k_pages, v_pages)
    slopes = bias = None
    if combo.alibi:
        slopes = torch.rand(BATCH, NHEADS, generator=generator, device=device) * 0.3
        bias = alibi_bias(slopes, seqlen_q, key_padding_mask, leftpad)
    cos = sin = None
    q_ro, k_ro = q, k
    if rotary_dim > 0:
        angle = torch.rand(rotary_rows, rotary_dim // 2, generator=generator, device=device) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
        if combo.causal or combo.local:  # row i at cache_seqlens[b] + i (ragged: of its own rows)
            q_ro = apply_rotary(q, cos, sin, cache_seqlens - (seqlen_q - q_rows), combo.rotary_interleaved)
        else:  # every query row at position cache_seqlens[b]
            rows = q.reshape(BATCH, 1, seqlen_q * NHEADS, d)
            q_ro = apply_rotary(rows, cos, sin, cache_seqlens, combo.rotary_interleaved).view_as(q)
        k_ro = apply_rotary(k, cos, sin, cache_seqlens, combo.rotary_interleaved)
    selected = slice(None) if batch_idx is None else batch_idx.long()
    k_cache_ref, v_cache_ref = k_cache[selected].clone(), v_cache[selected].clone()
    if combo.new_kv:
        for b, (start, count) in enumerate(zip(cache_seqlens.tolist(), new_rows.tolist())):
            if combo.kv_dtype:
                k_cache_ref[b, start:start + count] = quantise(k_ro[b, :count], descales["k_descale"][b], fp8)
                v_cache_ref[b, start:start + count] = quantise(v[b, :count], descales["v_descale"][b], fp8)
            else:
                k_cache_ref[b, start:start + count] = k_ro[b, :count]
                v_cache_ref[b, start:start + count] = v[b, :count]
    k_seen, v_seen = k_cache_ref, v_cache_ref
    if combo.kv_dtype:  # the dequantised caches
        k_seen = k_cache_ref.float() * descales["k_descale"][:, None, :, None]
        v_seen = v_cache_ref.float() * descales["v_descale"][:, None, :, None]
    group = NHEADS // nheads_k
    k_rep, v_rep = k_seen.repeat_interleave(group, dim=2), v_seen.repeat_interleave(group, dim=2)
    sinks = torch.randn(NHEADS, generator=generator, device=device) * 2 if combo.sinks else None
    masks = dict(key_padding_mask=key_padding_mask, attn_bias=bias, causal=combo.causal, window_size=window,
                 key_leftpad=leftpad, softcap=combo.softcap, sinks=sinks)
    out_ref, lse_ref = attention_ref(q_ro, k_rep, v_rep, **masks)
    out_pt, lse_pt = attention_ref(q_ro, k_rep.to(dtype), v_rep.to(dtype), **masks, upcast=False, reorder_ops=True)
    call = dict(q=q, k_cache=k_pages, v_cache=v_pages, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad, block_table=block_table,
                causal=combo.causal, window_size=window, rotary_interleaved=combo.rotary_interleaved,
                alibi_slopes=slopes, num_splits=combo.num_splits, return_softmax_lse=True, **descales)
    if combo.softcap:
        call["softcap"] = combo.softcap
    if sinks is not None:
        call["sinks"] = sinks
    if combo.ragged:
        counts = q_rows.tolist()
        call.update(q=pack(q, counts, last=True), cu_seqlens_q=torch.tensor([0, *itertools.accumulate(counts)],
                    dtype=torch.int32, device=device), max_seqlen_q=seqlen_q)
        if combo.new_kv:
            call.update(k=pack(k, counts, last=False), v=pack(v, counts, last=False))
        out_ref, out_pt = pack(out_ref, counts, last=True), pack(out_pt, counts, last=True)
        lse_ref, lse_pt = (pack(lse.transpose(1, 2), counts, last=True).transpose(0, 1) for lse in (lse_ref, lse_pt))
    return Case(call, k_cache_ref, v_cache_ref, out_ref, lse_ref, out_pt, lse_pt)


def pack(padded, counts, last):
    """(total, ...) from (B, S, ...): sequence b's last (or first) ``counts[b]`` rows, in order."""
    return torch.cat([rows[-count:] if last else rows[:count] for rows, count in zip(padded, counts)])


def within_rule(name, got, ref, pt, mult):
    """FlashAttention's rule: max |got - ref| <= mult * max |pt - ref| + 1e-5 (rows of -inf lse
    must match exactly)."""
    got, ref, pt = got.float(), ref.float(), pt.float()
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), empty), f"{name}: rows without keys differ from the reference's"
    error = (got - ref)[~empty].abs().max().item() if (~empty).any() else 0.0
    pt_error = (pt - ref)[~empty].abs().max().item() if (~empty).any() else 0.0
    assert error <= mult * pt_error + 1e-5, f"{name}: max error {error:.3g} > {mult} x PyTorch's {pt_error:.3g} + 1e-5"


def check_combo(combo: Combo, device, function) -> None:
    """Run ``function(**case.call) -> (out, lse)`` on the combo's inputs and check it as
    FlashAttention does (module docstring)."""
    case = make_case(combo, device)
    out, lse = function(**case.call)
    assert out.shape == case.out_ref.shape and out.dtype == case.out_ref.dtype, (out.shape, out.dtype)
    if combo.new_kv:
        call = case.call
        if combo.paged_kv_block_size:
            seqlen_k = combo.seqlens[1]
            k_cache = materialize_pages(call["k_cache"], call["block_table"], seqlen_k)
            v_cache = materialize_pages(call["v_cache"], call["block_table"], seqlen_k)
        else:
            selected = slice(None) if call["cache_batch_idx"] is None else call["cache_batch_idx"].long()
            k_cache, v_cache = call["k_cache"][selected], call["v_cache"][selected]
        # FlashAttention's 1e-3, for float16; bfloat16's ulp is 8x wider (a rotation rounded otherwise);
        # fp8: one step of its grid (the smallest subnormal of e4m3 near zero)
        tolerance = 1e-3 if combo.dtype == "float16" else 8e-3
        if combo.kv_dtype:
            tolerance = 2.0 ** -(3 if combo.kv_dtype == "float8_e4m3fn" else 2)
            k_cache, v_cache = k_cache.float(), v_cache.float()
            k_want, v_want = case.k_cache_ref.float(), case.v_cache_ref.float()
        else:
            k_want, v_want = case.k_cache_ref, case.v_cache_ref
        assert torch.allclose(k_cache, k_want, rtol=tolerance, atol=min(tolerance, 2.0 ** -9)), \
            "k_cache after the append"
        assert torch.equal(v_cache, v_want), "v_cache after the append"
    mult = 5 if combo.alibi else 3
    assert not out.isnan().any(), "NaN in the output"
    within_rule("out", out, case.out_ref, case.out_pt, mult)
    within_rule("lse", lse, case.lse_ref, case.lse_pt, mult)


class GridReport:
    """Pass/fail/skip counts per (tier, backend, dtype) and per ``axis=value`` feature, as JSON,
    written to ``path`` (when given) every WRITE_EVERY seconds and by ``flush``, so a run cut by a
    time limit still leaves its counts."""

    MAX_FAILURES = 50  # failures listed per (tier, backend, dtype)

    #: Seconds between writes to ``path`` (a write of the whole report takes ~1 ms).
    WRITE_EVERY = 2.0

    def __init__(self, path=None):
        self.entries = {}
        self.path = path
        self._written = 0.0

    def record(self, tier, backend, combo: Combo, outcome, message=""):
        entry = self.entries.setdefault((tier, backend, combo.dtype), {
            "total": collections.Counter(), "features": collections.defaultdict(collections.Counter), "failures": []})
        entry["total"][outcome] += 1
        for feature in combo.features():
            entry["features"][feature][outcome] += 1
        if outcome == "fail" and len(entry["failures"]) < self.MAX_FAILURES:
            entry["failures"].append({"id": combo.id, "message": message[:300]})
        if self.path and time.monotonic() - self._written >= self.WRITE_EVERY:
            self.flush()

    def flush(self):
        """Write the report to ``path`` now (at the end of a run; ``record`` writes every WRITE_EVERY s)."""
        if self.path:
            self.write(self.path)
            self._written = time.monotonic()

    @contextlib.contextmanager
    def recording(self, tier, backend, combo: Combo):
        """Records the outcome of the block: pass, skip (pytest.skip), or fail (any exception)."""
        try:
            yield
        except pytest.skip.Exception as skipped:
            self.record(tier, backend, combo, "skip", str(skipped))
            raise
        except Exception as error:
            self.record(tier, backend, combo, "fail", f"{type(error).__name__}: {error}")
            raise
        else:
            self.record(tier, backend, combo, "pass")

    def as_dict(self):
        report = {}
        for (tier, backend, dtype), entry in sorted(self.entries.items()):
            report.setdefault(tier, {}).setdefault(backend, {})[dtype] = {
                "total": dict(entry["total"]),
                "features": {name: dict(counts) for name, counts in sorted(entry["features"].items())},
                "failures": entry["failures"]}
        return report

    def write(self, path):
        partial = f"{path}.partial"
        with open(partial, "w") as file:
            json.dump(self.as_dict(), file, indent=1)
        os.replace(partial, path)


#: A GPU-tier test and its outcome in a pytest log (-v, with or without pytest-xdist).
_LOG_RESULT = re.compile(r"test_kvcache_grid(_tilelang_part|_auto)?_gpu\[([^\]]+)\].*?(PASSED|FAILED|SKIPPED|ERROR)"
                         r"|(PASSED|FAILED|SKIPPED|ERROR) tests/test_fa_kvcache\.py::test_kvcache_grid(_tilelang_part|_auto)?"
                         r"_gpu\[([^\]]+)\]")


def log_outcomes(text: str, outcomes: dict | None = None) -> dict:
    """{(backend, combo id): "pass" | "fail" | "skip"} of the GPU tier's tests in a pytest log,
    added to ``outcomes``; a later line (or log) overrides an earlier one for the same test. Combos
    that differ only in axes that do not apply share an id, and count once."""
    outcomes = {} if outcomes is None else outcomes
    words = {"PASSED": "pass", "FAILED": "fail", "ERROR": "fail", "SKIPPED": "skip"}
    for match in _LOG_RESULT.finditer(text):
        part, name, word = (match.group(1, 2, 3) if match.group(2) else match.group(5, 6, 4))
        backend, combo_id = (part.removeprefix("_").removesuffix("_part"), name) if part else name.split("-", 1)
        combo_id = re.sub(r"_\d+$", "", combo_id)  # pytest's suffix for combos whose ids coincide
        outcomes[(backend, combo_id)] = words[word]
    return outcomes


def coverage(outcomes: dict) -> dict:
    """A report (``GridReport.as_dict`` form, tier "gpu") of distinct combos from ``log_outcomes``."""
    report = GridReport()
    for (backend, combo_id), outcome in sorted(outcomes.items()):
        report.record("gpu", backend, Combo.from_id(combo_id), outcome)
    return report.as_dict()


def merge_reports(reports: list) -> dict:
    """One report (``GridReport.as_dict`` form) summing several, e.g. one per pytest-xdist worker."""
    merged = {}
    for report in reports:
        for tier, backends in report.items():
            for backend, dtypes in backends.items():
                for dtype, entry in dtypes.items():
                    into = merged.setdefault(tier, {}).setdefault(backend, {}).setdefault(
                        dtype, {"total": {}, "features": {}, "failures": []})
                    for outcome, count in entry["total"].items():
                        into["total"][outcome] = into["total"].get(outcome, 0) + count
                    for feature, counts in entry["features"].items():
                        target = into["features"].setdefault(feature, {})
                        for outcome, count in counts.items():
                            target[outcome] = target.get(outcome, 0) + count
                    into["failures"] = (into["failures"] + entry["failures"])[:GridReport.MAX_FAILURES]
    return merged
