"""Input checks of the public call: the one validation path; every error names its argument.

The checks read metadata only (types, dtypes, devices, shapes, strides, 16-byte alignment, the
scalars), so their outcome, a :class:`~flashdecode.problem.Problem`, is memoized per distinct
metadata by the caller (``DecodeContext``): a call repeating an earlier call's metadata costs the
reads of that metadata, not the checks. Values inside index tensors (lengths, batch indices, left
pads, block ids) are checked on the host when the tensor is on the CPU, and for CUDA tensors only
when enabled (``set_value_checks(True)`` or ``FLASHDECODE_CHECK_SEQLENS=1``): that check is a
device-to-host copy, which would break CUDA-graph capture. Off, the kernels clamp every such value
(no out-of-bounds read or write) and write NaN into the rows it touches (``docs/design.md``,
"Semantics").
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os

import torch

from .hardware import check_int
from .planner import key_range
from .problem import (ALIBI_NONE, ALIBI_PER_HEAD, ALIBI_PER_SEQUENCE, FP8_DTYPES, Problem, is_contiguous,
                      is_heads_first, offsets_fit_32)
from .reference import per_sequence

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: Cache dtypes besides q's: fp8, dequantised by k_descale/v_descale (``Problem.cache_dtype``).
FP8_CACHE_DTYPES = tuple(getattr(torch, name) for name in FP8_DTYPES)
MAX_HEADDIM = 256
#: Page sizes besides powers of two: FlashAttention 2 takes any multiple of this many tokens.
FA_PAGE_MULTIPLE = 256
BACKENDS = ("auto", "tilelang", "triton", "reference")
_BSHD = "(batch, seqlen, nheads, headdim)"
_PACKED = "(total_q, nheads, headdim) with cu_seqlens_q"


class _ValueChecks:
    """Whether CUDA index tensors' values are checked on the host (one sync per call)."""

    enabled = os.environ.get("FLASHDECODE_CHECK_SEQLENS", "0") == "1"


def set_value_checks(enabled: bool) -> None:
    """Turn the host-side check of the values of CUDA ``cache_seqlens``, ``cache_batch_idx``,
    ``cache_leftpad`` and ``block_table`` on or off (off by default: it syncs the device)."""
    _ValueChecks.enabled = bool(enabled)


def value_checks_enabled() -> bool:
    return _ValueChecks.enabled


def tensor_meta(name, tensor, traced: bool = False):
    """What the checks read of an argument: (dtype, device, shape, strides, 16-byte aligned) of a
    tensor, None for None, (type, value) of anything else (rejected by the checks). ``traced``:
    while torch.compile traces, which cannot read a data pointer (alignment None)."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return (type(tensor), _hashable(tensor))
    aligned = None if traced else tensor.data_ptr() % 16 == 0
    return (tensor.dtype, tensor.device, tensor.shape, tensor.stride(), aligned)


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def scalar_meta(value):
    """(type, value) of a scalar argument, so that True and 1, equal as keys, still differ."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(scalar_meta(item) for item in value))
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type == "cpu" and not value.is_floating_point():
            return (int, value.item())  # FlashAttention's own tests pass window sizes as 0-d tensors
        return (torch.Tensor, repr(value))
    return (type(value), _hashable(value))


def tensor_scalars(softmax_scale, causal, softcap, rotary_interleaved, num_splits):
    """The scalar arguments with one-element tensors read as Python numbers, as FlashAttention's
    bindings convert them (a host sync where the tensor is on the GPU): the call then sees, checks,
    memoizes and records the value, never the tensor (the compiled host path keys a tensor by its
    metadata)."""
    def value(name, item, convert):
        if not isinstance(item, torch.Tensor):
            return item
        if item.numel() != 1:
            _fail(TypeError, f"{name} must be a number or a one-element tensor, got a tensor of shape "
                             f"{tuple(item.shape)}")
        return convert(item.item())
    return (value("softmax_scale", softmax_scale, float), value("causal", causal, bool),
            value("softcap", softcap, float), value("rotary_interleaved", rotary_interleaved, bool),
            value("num_splits", num_splits, int))


def _fail(kind, message):
    raise kind(message)


def _numpy_bool(kind) -> bool:
    """numpy's bool scalar type, which FlashAttention's bindings take as a bool too."""
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def _type_name(kind) -> str:
    """A type as an error message names it: "int", "numpy.float64", "torch.Tensor"."""
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _require_tensor(name, meta, rank, layout):
    if meta is None or isinstance(meta[0], type):
        got = "None" if meta is None else _type_name(meta[0])
        _fail(TypeError, f"{name} must be a torch.Tensor, got {got}")
    if len(meta[2]) != rank:
        _fail(ValueError, f"{name} must have {rank} dimensions {layout}, got shape {tuple(meta[2])}")


def _require_index(name, meta, shape, device, batch_from=""):
    """An int32 tensor of ``shape``, contiguous in its last dimension, on ``device`` (``batch_from``:
    where its batch comes from, said where the shape is wrong)."""
    _require_tensor(name, meta, len(shape), f"of shape {shape}")
    dtype, tensor_device, got, stride, _ = meta
    if dtype != torch.int32:
        _fail(TypeError, f"{name} must be int32, got {dtype}")
    if tuple(got) != tuple(shape) or stride[-1] != 1:
        _fail(ValueError, f"{name} must have shape {shape}{batch_from} and a contiguous last dimension, got shape "
                          f"{tuple(got)}, strides {stride}")
    if tensor_device != device:
        _fail(ValueError, f"{name} must be on q's device {device}, got {tensor_device}")


def _require_unrepeated(name, meta, why):
    """A tensor the call writes: no element shares memory through a stride of 0 (an ``expand()`` view),
    where the writes of several elements would land on one and leave the others wrong."""
    if any([stride == 0 and size > 1 for size, stride in zip(meta[2], meta[3])]):  # (a list: dynamo traces it)
        _fail(ValueError, f"{name} must not repeat its memory ({why}): a stride of 0 in a dimension of "
                          f"size > 1, as expand() gives, got shape {tuple(meta[2])}, strides {meta[3]}")


def _require_like_q(name, meta, q_dtype, device):
    if meta[0] != q_dtype:
        _fail(TypeError, f"{name} must have q's dtype {q_dtype}, got {meta[0]}")
    if meta[1] != device:
        _fail(ValueError, f"{name} must be on q's device {device}, got {meta[1]}")
    if meta[3][-1] != 1:
        _fail(ValueError, f"{name} must be contiguous in its last dimension, got strides {meta[3]}")


def _require_cache(name, meta, q_dtype, device):
    """A cache of q's dtype or of an fp8 dtype (``FP8_CACHE_DTYPES``), otherwise as ``_require_like_q``."""
    if meta[0] in FP8_CACHE_DTYPES:
        meta = (q_dtype, *meta[1:])
    elif meta[0] != q_dtype:
        _fail(TypeError, f"{name} must have q's dtype {q_dtype} or be float8_e4m3fn or float8_e5m2, got {meta[0]}")
    _require_like_q(name, meta, q_dtype, device)


def descale_number(name: str, value, traced: bool = False) -> float:
    """A descale given as a number, checked: finite and > 0 (comparisons, which torch.compile
    traces). ``traced``: while torch.compile traces, whose symbolic floats a message cannot show."""
    if not 0 < value < math.inf:
        _fail(ValueError, f"{name} must be finite and > 0" + ("" if traced else f", got {value!r}"))
    return float(value)


def _check_descale(name, meta, cache_dtype, batch, nheads_k, device):
    """``k_descale``/``v_descale``: only with fp8 caches; a finite number > 0, or a float32 tensor of
    shape (), (nheads_k,) or (batch, nheads_k) (FA3's) on q's device."""
    if meta is None:
        return
    if cache_dtype not in FP8_CACHE_DTYPES:
        _fail(ValueError, f"{name} applies to float8 caches only, got k_cache of {cache_dtype}")
    if isinstance(meta[0], type):
        kind, value = meta
        if kind is bool or not issubclass(kind, numbers.Real):
            _fail(TypeError, f"{name} must be a float32 tensor of shape ({batch}, {nheads_k}), ({nheads_k},) or (), "
                             f"or a number, got {_type_name(kind)}")
        descale_number(name, value)
        return
    dtype, tensor_device, shape, _, _ = meta
    if dtype != torch.float32:
        _fail(TypeError, f"{name} must be float32, got {dtype}")
    if tuple(shape) not in ((), (nheads_k,), (batch, nheads_k)):
        _fail(ValueError, f"{name} must have shape ({batch}, {nheads_k}), ({nheads_k},) or (), got {tuple(shape)}")
    if tensor_device != device:
        _fail(ValueError, f"{name} must be on q's device {device}, got {tensor_device}")


def _int_value(name, meta, low=None):
    kind, value = meta
    if kind is bool or not issubclass(kind, numbers.Integral):
        _fail(TypeError, f"{name} must be an int, got {_type_name(kind)} {value!r}")
    value = int(value)
    if low is not None and value < low:
        _fail(ValueError, f"{name} must be >= {low}, got {value}")
    return value


def _window(meta, causal, seqlen_q, capacity):
    """(window_left, window_right) in the Problem's normal form (docs/design.md, "Semantics")."""
    kind, items = meta
    if not issubclass(kind, (tuple, list)) or len(items) != 2:
        got = tuple(item[1] for item in items) if issubclass(kind, (tuple, list)) else items
        _fail(TypeError, f"window_size must be a pair (left, right) of ints, got {_type_name(kind)} {got!r}")
    left, right = (_int_value(f"window_size[{i}]", item, low=-1) for i, item in enumerate(items))
    if causal:
        right = 0  # FlashAttention's rule: causal is a right window of 0, whatever window_size[1] says
    if seqlen_q == 1:
        right = -1  # the single row is the last key's position: nothing lies to its right
    left = -1 if left >= capacity else left
    right = -1 if right >= capacity else right
    return left, right


#: Tile-config fields that size ``tl.arange`` ranges, warps or MMA tiles: powers of two (block_n and
#: block_m at least 16, a ``tl.dot`` operand's least side).
POWER_OF_TWO_FIELDS = {"block_n": 16, "block_m": 16, "num_warps": 1, "combine_step": 1, "combine_dims": 1, "step": 1}
#: Tile-config fields where 0 means "off" (TileLang's producer_registers: the even split).
ZERO_ALLOWED_FIELDS = frozenset(("producer_registers",))


def check_tile_config(config, name: str = "config") -> None:
    """A ``DecodeContext``'s ``config``: a backend's frozen tile config (a dataclass: TritonConfig,
    TileLang's SplitConfig or ShortCacheConfig) whose int fields are positive (``ZERO_ALLOWED_FIELDS``:
    >= 0) and ``POWER_OF_TWO_FIELDS`` powers of two at least their minimum; TypeError/ValueError
    naming the field."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        _fail(TypeError, f"{name} must be a backend's tile config (TritonConfig, TileLang's SplitConfig or "
                         f"ShortCacheConfig), got {type(config).__name__}")
    for field in dataclasses.fields(config):
        value, label = getattr(config, field.name), f"{name}.{field.name}"
        if dataclasses.is_dataclass(value):
            check_tile_config(value, label)
        elif value is not None and not isinstance(value, bool):
            least = POWER_OF_TWO_FIELDS.get(field.name, 0 if field.name in ZERO_ALLOWED_FIELDS else 1)
            check_int(label, value, least, power_of_two=field.name in POWER_OF_TWO_FIELDS)


def check_out(out, q) -> None:
    """``out`` (a ``tensor_meta``) as the call writes it: q's shape (``q``: its ``tensor_meta``),
    dtype and device, contiguous in its last dimension, no element repeated."""
    _require_tensor("out", out, len(q[2]), _PACKED if len(q[2]) == 3 else _BSHD)
    _require_like_q("out", out, q[0], q[1])
    if out[2] != q[2]:
        _fail(ValueError, f"out must have q's shape {tuple(q[2])}, got {tuple(out[2])}")
    _require_unrepeated("out", out, "the call writes it")


def check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
               num_splits, backend, out, k_descale=None, v_descale=None, sinks=None, cu_seqlens_q=None,
               max_seqlen_q=None) -> Problem:
    """Every metadata check of a call; the Problem it describes. Tensor arguments come as
    ``tensor_meta``, scalars as ``scalar_meta`` (``k_descale``/``v_descale``: either, by what was
    passed). Raises TypeError/ValueError naming the argument."""
    ragged = cu_seqlens_q is not None
    if max_seqlen_q is not None and max_seqlen_q[1] is None:
        max_seqlen_q = None  # not given
    # where the batch a per-sequence argument must match comes from, said in its shape errors
    batch_from = " (batch: cu_seqlens_q's entries less one)" if ragged else " (q's batch)"
    if ragged:  # q (total_q, nheads, headdim): the Problem's batch and seqlen_q come from cu_seqlens_q
        _require_tensor("q", q, 3, _PACKED)
        q_dtype, device, (total_q, nheads, headdim), q_stride, q_aligned = q
        batch, seqlen_q = _ragged_rows(cu_seqlens_q, max_seqlen_q, device)
        if total_q == 0:
            _fail(ValueError, "q must have at least one row (total_q >= 1) with cu_seqlens_q")
    else:
        if max_seqlen_q is not None:
            _fail(ValueError, "max_seqlen_q is only taken with cu_seqlens_q (ragged queries)")
        _require_tensor("q", q, 4, _BSHD)
        q_dtype, device, (batch, seqlen_q, nheads, headdim), q_stride, q_aligned = q
    if q_dtype not in SUPPORTED_DTYPES:
        _fail(TypeError, f"q must be float16 or bfloat16, got {q_dtype}")
    if q_stride[-1] != 1:
        _fail(ValueError, f"q must be contiguous in its last dimension, got strides {q_stride}")
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        _fail(ValueError, f"q must have batch, seqlen_q and nheads >= 1, got shape {(batch, seqlen_q, nheads, headdim)}")
    if not 1 <= headdim <= MAX_HEADDIM:
        _fail(ValueError, f"q's head dim must be in [1, {MAX_HEADDIM}], got {headdim}")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, nheads_k, headdim)" if paged else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    for name, meta in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, meta, 4, cache_layout)
        _require_cache(name, meta, q_dtype, device)
    if v_cache[0] != k_cache[0]:
        _fail(TypeError, f"v_cache must have k_cache's dtype {k_cache[0]}, got {v_cache[0]}")
    if v_cache[2] != k_cache[2]:
        _fail(ValueError, f"v_cache must have k_cache's shape {tuple(k_cache[2])}, got {tuple(v_cache[2])}")
    rows, slots, nheads_k, cache_headdim = k_cache[2]
    if cache_headdim != headdim:
        _fail(ValueError, f"k_cache must have q's head dim {headdim} in its last dimension, got {tuple(k_cache[2])}")
    if nheads_k == 0 or nheads % nheads_k:
        _fail(ValueError, f"q's nheads ({nheads}) must be a multiple of k_cache's nheads_k ({nheads_k})")

    page_size, capacity = 0, slots
    if paged:
        _require_tensor("block_table", block_table, 2, "(batch, max_blocks_per_sequence)")
        _require_index("block_table", block_table, (batch, block_table[2][1]), device, batch_from)
        if cache_batch_idx is not None:
            _fail(ValueError, "cache_batch_idx cannot be used with block_table (a paged cache is indexed by "
                              "its block table)")
        if slots < 1 or (slots & (slots - 1) and slots % FA_PAGE_MULTIPLE):
            _fail(ValueError, f"k_cache's page size (dimension 1 with block_table) must be a power of two or a "
                              f"multiple of {FA_PAGE_MULTIPLE}, got {slots}")
        if rows == 0:
            _fail(ValueError, "k_cache must hold at least one page with block_table, got 0 pages")
        page_size, capacity = slots, slots * block_table[2][1]
    elif cache_batch_idx is not None:
        _require_index("cache_batch_idx", cache_batch_idx, (batch,), device, batch_from)
    elif rows < batch:  # more rows: sequence b reads row b, as in FlashAttention (a cache sized for a larger batch)
        _fail(ValueError, f"k_cache must have at least {batch} rows in dimension 0{batch_from} (or pass "
                          f"cache_batch_idx), got shape {tuple(k_cache[2])}")
    if cache_leftpad is not None:
        _require_index("cache_leftpad", cache_leftpad, (batch,), device, batch_from)
    for name, (kind, value) in (("causal", causal), ("rotary_interleaved", rotary_interleaved)):
        # FlashAttention's bindings take what converts to a C++ bool: numbers and None (False) too
        if not (issubclass(kind, numbers.Real) or _numpy_bool(kind) or value is None):
            _fail(TypeError, f"{name} must be a bool, got {_type_name(kind)} {value!r}")
    window_left, window_right = _window(window_size, causal[1], seqlen_q, capacity)

    seqlen_new = 0
    if (k is None) != (v is None):
        _fail(ValueError, "k and v must be given together (the new tokens to append), got only "
                          f"{'k' if v is None else 'v'}")
    if k is not None:
        for name, meta in (("k", k), ("v", v)):
            _require_tensor(name, meta, 3 if ragged else 4, "(total_q, nheads_k, headdim) with cu_seqlens_q"
                            if ragged else "(batch, seqlen_new, nheads_k, headdim)")
            _require_like_q(name, meta, q_dtype, device)
        if ragged:  # sequence b appends its own query rows' count of tokens, packed as q
            seqlen_new, expected = seqlen_q, (total_q, nheads_k, headdim)
        else:
            seqlen_new, expected = k[2][1], (batch, k[2][1], nheads_k, headdim)
        if tuple(k[2]) != expected or v[2] != k[2]:
            shape = f"({total_q}, {nheads_k}, {headdim})" if ragged else f"({batch}, seqlen_new, {nheads_k}, {headdim})"
            _fail(ValueError, f"k and v must have shape {shape}, got {tuple(k[2])} and {tuple(v[2])}")
        if seqlen_new > capacity and not ragged:  # ragged: each sequence's own count, checked with the values
            _fail(ValueError, f"k must have at most the cache's capacity {capacity} tokens, got {seqlen_new}")
        if cache_seqlens is None:
            _fail(ValueError, "cache_seqlens is required with k and v: it says where the new tokens go")
        for name, meta in (("k_cache", k_cache), ("v_cache", v_cache)):  # appended tokens are written there
            _require_unrepeated(name, meta, "k and v are appended into it")

    if cache_seqlens is not None and isinstance(cache_seqlens[0], type):
        if issubclass(cache_seqlens[0], (list, tuple)):
            _fail(TypeError, f"cache_seqlens must be an int32 tensor of shape ({batch},), an int or None, got "
                             f"{_type_name(cache_seqlens[0])} {[item[1] for item in cache_seqlens[1]]}")
        value = _int_value("cache_seqlens", cache_seqlens)
        if ragged:  # each sequence appends its own rows, read on the device: one that does not fit gives NaN rows
            if not 0 <= value <= capacity:
                _fail(ValueError, f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), got {value}")
        elif not 0 <= value <= capacity - seqlen_new:
            _fail(ValueError, f"cache_seqlens must be in [0, {capacity - seqlen_new}] (capacity {capacity} minus "
                              f"{seqlen_new} appended tokens), got {value}")
    elif cache_seqlens is not None:
        _require_index("cache_seqlens", cache_seqlens, (batch,), device, batch_from)

    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        _fail(ValueError, "rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            _fail(ValueError, "rotary_cos/rotary_sin need k and v: rotary is applied to the appended keys and q")
        for name, meta in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _require_tensor(name, meta, 2, "(seqlen_rotary, rotary_dim / 2)")
            if meta[0] not in (q_dtype, torch.float32) or meta[1] != device:
                _fail(TypeError, f"{name} must be {q_dtype} or float32 on {device}, got {meta[0]} on {meta[1]}")
            if not 0 < meta[2][1] <= headdim // 2:
                _fail(ValueError, f"{name} must have 1 to headdim/2 = {headdim // 2} columns (rotary_dim <= "
                                  f"headdim), got {meta[2][1]}")
            if meta[3] != (meta[2][1], 1):
                _fail(ValueError, f"{name} must be contiguous, got strides {meta[3]}")
        if rotary_sin[2] != rotary_cos[2]:
            _fail(ValueError, f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos[2])}, got {tuple(rotary_sin[2])}")
        rotary_rows, half = rotary_cos[2]
        rotary_dim = 2 * half
        if rotary_rows < capacity:  # FlashAttention's rule; query rows past it take the last row
            _fail(ValueError, f"rotary_cos/rotary_sin must have a row for every cache position: at least {capacity} "
                              f"rows (the capacity), got {rotary_rows}")

    alibi = ALIBI_NONE
    if alibi_slopes is not None:
        _require_tensor("alibi_slopes", alibi_slopes, len(alibi_slopes[2]) if isinstance(alibi_slopes[0], torch.dtype)
                        else 1, "(nheads,) or (batch, nheads)")
        dtype, slopes_device, shape, stride, _ = alibi_slopes
        if dtype != torch.float32 or slopes_device != device:
            _fail(TypeError, f"alibi_slopes must be float32 on {device}, got {dtype} on {slopes_device}")
        if tuple(shape) not in ((nheads,), (batch, nheads)) or stride[-1] != 1:
            _fail(ValueError, f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), contiguous, got "
                              f"shape {tuple(shape)}, strides {stride}")
        alibi = ALIBI_PER_HEAD if len(shape) == 1 else ALIBI_PER_SEQUENCE
    if sinks is not None:
        _require_tensor("sinks", sinks, 1, f"({nheads},)")
        dtype, sinks_device, shape, stride, _ = sinks
        if dtype != torch.float32 or sinks_device != device:
            _fail(TypeError, f"sinks must be float32 on {device}, got {dtype} on {sinks_device}")
        if tuple(shape) != (nheads,) or stride[-1] != 1:
            _fail(ValueError, f"sinks must have shape ({nheads},) (one logit per query head), contiguous, got "
                              f"shape {tuple(shape)}, strides {stride}")

    scale_type, scale = softmax_scale
    if scale is not None and (scale_type is bool or not issubclass(scale_type, numbers.Real) or not math.isfinite(scale)):
        _fail(TypeError if scale_type is bool or not issubclass(scale_type, numbers.Real) else ValueError,
              f"softmax_scale must be a finite float or None, got {scale!r}")
    softcap_type, softcap_value = softcap
    if softcap_type is bool or not issubclass(softcap_type, numbers.Real) or not softcap_value >= 0 \
            or not math.isfinite(softcap_value):
        _fail(ValueError, f"softcap must be a finite float >= 0 (0: off), got {softcap_value!r}")
    _int_value("num_splits", num_splits, low=0)
    _check_descale("k_descale", k_descale, k_cache[0], batch, nheads_k, device)
    _check_descale("v_descale", v_descale, k_cache[0], batch, nheads_k, device)
    if backend[1] not in BACKENDS:
        _fail(ValueError, f"backend must be one of {BACKENDS}, got {backend[1]!r}")

    caches = (k_cache, v_cache)
    # heads-first: transformers' (batch, Hk, T, D) caches seen through a transpose (plain where both fit)
    heads_first = not paged and not all(is_contiguous(meta[2], meta[3]) for meta in caches) and all(
        is_heads_first(meta[2], meta[3]) for meta in caches)
    dense = (q_aligned and is_contiguous(q[2], q_stride) and (paged or cache_batch_idx is not None or rows == batch)
             and all(meta[4] and (heads_first or is_contiguous(meta[2], meta[3])) for meta in caches))
    for meta in (k, v, block_table):
        if meta is not None:
            dense = dense and meta[4] and is_contiguous(meta[2], meta[3])
    if out is not None:
        check_out(out, q)
        dense = dense and out[4] and is_contiguous(out[2], out[3])
    offsets_32 = all(offsets_fit_32(meta[2], meta[3]) for meta in (k_cache, v_cache))
    return Problem(batch, capacity, nheads, nheads_k, headdim, str(q_dtype).removeprefix("torch."),
                   seqlen_q=seqlen_q, page_size=page_size, seqlen_new=seqlen_new, rotary_dim=rotary_dim,
                   rotary_interleaved=bool(rotary_interleaved[1]) and rotary_dim > 0,
                   window_left=window_left, window_right=window_right, softcap=softcap_value > 0, alibi=alibi,
                   leftpad=cache_leftpad is not None, batch_idx=cache_batch_idx is not None, dense=bool(dense),
                   offsets_32=offsets_32,
                   cache_dtype=str(k_cache[0]).removeprefix("torch.") if k_cache[0] in FP8_CACHE_DTYPES else None,
                   sinks=sinks is not None, ragged=ragged, heads_first=heads_first)


def _ragged_rows(cu_seqlens_q, max_seqlen_q, device) -> tuple[int, int]:
    """(batch, seqlen_q) of a ragged call: cu_seqlens_q's length less one, and max_seqlen_q."""
    _require_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    rows = cu_seqlens_q[2][0]
    _require_index("cu_seqlens_q", cu_seqlens_q, (rows,), device)
    if rows < 2:
        _fail(ValueError, f"cu_seqlens_q must have batch + 1 >= 2 entries, got shape ({rows},)")
    if max_seqlen_q is None:
        _fail(ValueError, "max_seqlen_q is required with cu_seqlens_q: it bounds every sequence's query rows")
    return rows - 1, _int_value("max_seqlen_q", max_seqlen_q, low=1)


def check_values(problem: Problem, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                 force: bool = False, block_ids_from: int = 1, cu_seqlens_q=None, total_q: int = 0) -> None:
    """Range checks of index tensors' values: always for CPU tensors (and with ``force``), for CUDA
    ones when enabled. ``block_ids_from``: the backend's ``block_ids_read_from``; ``total_q``: q's
    rows with ``cu_seqlens_q``. Raises ValueError naming the argument and the offending range."""
    def needed(tensor):
        return isinstance(tensor, torch.Tensor) and (force or tensor.device.type == "cpu" or _ValueChecks.enabled)

    limit = problem.seqlen_cache - problem.seqlen_new
    rows = None  # a ragged call's query rows per sequence
    if problem.ragged and (needed(cu_seqlens_q) or needed(cache_seqlens) or needed(block_table)):
        rows = _ragged_values(problem, cu_seqlens_q, total_q)
    tensor_lengths = isinstance(cache_seqlens, torch.Tensor)
    if problem.ragged and problem.seqlen_new and rows is not None and (not tensor_lengths or needed(cache_seqlens)):
        lengths = per_sequence(cache_seqlens, problem.batch, limit)  # an int: every sequence's
        bad = [b for b, (length, new) in enumerate(zip(lengths, rows)) if not 0 <= length <= problem.seqlen_cache - new]
        if bad:
            given = lengths if tensor_lengths else cache_seqlens
            raise ValueError(f"cache_seqlens must be in [0, capacity {problem.seqlen_cache} minus the sequence's "
                             f"appended tokens] for every sequence b, got {given} with cu_seqlens_q "
                             f"{cu_seqlens_q.tolist()} (sequence {bad[0]})")
    elif needed(cache_seqlens):
        _in_range("cache_seqlens", cache_seqlens, 0, limit,
                  f" (capacity {problem.seqlen_cache} minus {problem.seqlen_new} appended tokens)")
    if needed(cache_batch_idx):
        _in_range("cache_batch_idx", cache_batch_idx, 0, k_cache.shape[0] - 1, " (rows of k_cache)")
    if needed(block_table):
        # Only the block ids of the keys a sequence's rows can see (planner.key_range, its first key
        # rounded down as the backend reads) and of its appended tokens are read: others may hold anything.
        used = torch.zeros(block_table.shape, dtype=torch.bool)
        for b, (length, leftpad) in enumerate(zip(per_sequence(cache_seqlens, problem.batch, limit),
                                                  per_sequence(cache_leftpad, problem.batch, 0))):
            lo, hi = key_range(problem, length, leftpad, None if rows is None else rows[b])
            lo = lo // block_ids_from * block_ids_from
            if problem.seqlen_new:
                lo = min(lo, max(length, 0))
            used[b, lo // problem.page_size:-(-hi // problem.page_size)] = True
        used = used.to(block_table.device)
        _in_range("block_table", block_table[used], 0, k_cache.shape[0] - 1, " (pages of k_cache, for the keys "
                  "a sequence's rows can see)")
    if needed(cache_leftpad):
        if isinstance(cache_seqlens, torch.Tensor):
            bad = (cache_leftpad < 0) | (cache_leftpad > cache_seqlens.to(cache_leftpad.device))
        else:
            bad = (cache_leftpad < 0) | (cache_leftpad > (limit if cache_seqlens is None else int(cache_seqlens)))
        if bool(bad.any()):
            raise ValueError(f"cache_leftpad must be in [0, cache_seqlens[b]] for every sequence b, got "
                             f"{cache_leftpad.tolist()} with cache_seqlens {cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else cache_seqlens.tolist()}")


def _ragged_values(problem: Problem, cu_seqlens_q, total_q: int) -> list[int]:
    """Each sequence's query rows from ``cu_seqlens_q``, whose values must rise from >= 0 to at most
    ``total_q`` in steps of at most ``max_seqlen_q``."""
    bounds = cu_seqlens_q.tolist()
    rows = [last - first for first, last in zip(bounds, bounds[1:])]
    if bounds[0] < 0 or bounds[-1] > total_q or not all(0 <= count <= problem.seqlen_q for count in rows):
        raise ValueError(f"cu_seqlens_q must rise from >= 0 to at most total_q = {total_q} in steps of 0 to "
                         f"max_seqlen_q = {problem.seqlen_q}, got {bounds}")
    return rows


def _in_range(name, tensor, low, high, why):
    if tensor.numel() == 0:
        return
    least, most = int(tensor.min()), int(tensor.max())
    if least < low or most > high:
        raise ValueError(f"{name} must be in [{low}, {high}]{why}, got values in [{least}, {most}]")
