"""Input checks for flash_decode_with_kvcache: the one validation path.

Every error names the argument, what it got and what was expected. Checks are host-side metadata
reads (a few microseconds) except the bounds of a CUDA ``cache_seqlens``, which need a
device-to-host copy: that one runs only when enabled (``set_seqlens_check(True)`` or the
environment variable ``FLASHDECODE_CHECK_SEQLENS=1``). When it is off, the kernels still clamp
every length into [0, seqlen_cache] (no out-of-bounds read) and write NaN into the output rows of
an out-of-range length, so a bad length is never a silent wrong answer.
"""
from __future__ import annotations

import functools
import math
import numbers
import os

import torch

from .planner import Problem

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEADDIMS = (64, 128, 256)
BACKENDS = ("auto", "tilelang", "triton", "reference")

_check_seqlens_on_device = os.environ.get("FLASHDECODE_CHECK_SEQLENS", "0") == "1"


def set_seqlens_check(enabled: bool) -> None:
    """Turn the host-side bounds check of CUDA ``cache_seqlens`` (one device sync per call) on/off."""
    global _check_seqlens_on_device
    _check_seqlens_on_device = bool(enabled)


def _require_tensor(name, value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_rank4(name, shape, layout):
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}, got shape {tuple(shape)}")


def validate(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, backend, out):
    """Check the inputs of a decode call; return (Problem, cache_seqlens as an int32 tensor or None).

    None means "every row has seqlen_cache tokens", which the caller turns into a tensor only when
    a kernel needs it. The checks depend on metadata only (types, shapes, strides, dtypes, devices,
    the scalars), so their outcome is cached per distinct metadata: a call repeating an earlier
    call's metadata costs the reads of that metadata (~1-2 us), not the checks. Only the values of
    a CPU (or, when enabled, CUDA) ``cache_seqlens`` are read every time.
    """
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, tensor)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_meta = (cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.device)
    else:
        seqlens_meta = (type(cache_seqlens), cache_seqlens)
    if out is not None:
        _require_tensor("out", out)
    meta = (_tensor_meta(q), _tensor_meta(k_cache), _tensor_meta(v_cache), seqlens_meta,
            (type(softmax_scale), softmax_scale), (type(num_splits), num_splits), backend,
            None if out is None else _tensor_meta(out))
    try:
        problem = _checked_problem(*meta)
    except TypeError as error:  # an unhashable argument (a list, ...): checked, and rejected, uncached
        if "unhashable" not in str(error):
            raise
        problem = _checked_problem.__wrapped__(*meta)
    if isinstance(cache_seqlens, torch.Tensor) and (cache_seqlens.device.type == "cpu" or _check_seqlens_on_device):
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high > problem.seqlen_cache:
            raise ValueError(f"cache_seqlens must be in [0, seqlen_cache={problem.seqlen_cache}], "
                             f"got values in [{low}, {high}]")
    return problem, cache_seqlens


def _tensor_meta(tensor):
    """What the checks read of a tensor: (dtype, device, shape, strides)."""
    return tensor.dtype, tensor.device, tensor.shape, tensor.stride()


@functools.lru_cache(maxsize=1024)
def _checked_problem(q_meta, k_meta, v_meta, seqlens_meta, scale_meta, splits_meta, backend, out_meta):
    """Every metadata check of ``validate``; the Problem they describe (raises on the first failure).

    ``q_meta``, ``k_meta``, ``v_meta`` and ``out_meta`` (or None) are ``_tensor_meta``s;
    ``seqlens_meta`` is (dtype, shape, strides, device)
    of a tensor or (type, value) of anything else; scalars come as (type, value), so that e.g. True
    and 1, equal as cache keys, still differ."""
    (q_dtype, device, q_shape, q_stride) = q_meta
    if q_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q_dtype}")
    for name, (dtype, tensor_device, _, _) in (("k_cache", k_meta), ("v_cache", v_meta)):
        if dtype != q_dtype:
            raise TypeError(f"{name} must have q's dtype {q_dtype}, got {dtype}")
        if tensor_device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {tensor_device}")
    _require_rank4("q", q_shape, "(batch, seqlen_q, nheads, headdim)")
    _require_rank4("k_cache", k_meta[2], "(batch, seqlen_cache, nheads_k, headdim)")
    _require_rank4("v_cache", v_meta[2], "(batch, seqlen_cache, nheads_k, headdim)")
    batch, seqlen_q, nheads, headdim = q_shape
    k_shape = k_meta[2]
    if batch == 0:
        raise ValueError("q must have batch >= 1, got batch 0")
    if seqlen_q != 1:
        raise ValueError(f"q must have seqlen_q == 1 (decode), got q.shape[1] = {seqlen_q}")
    if headdim not in SUPPORTED_HEADDIMS:
        raise ValueError(f"q's head dim must be one of {SUPPORTED_HEADDIMS}, got {headdim}")
    if k_shape[0] != batch or k_shape[3] != headdim:
        raise ValueError(
            f"k_cache must have shape ({batch}, seqlen_cache, nheads_k, {headdim}) to match q, "
            f"got {tuple(k_shape)}")
    if v_meta[2] != k_shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_shape)}, got {tuple(v_meta[2])}")
    seqlen_cache, nheads_k = k_shape[1], k_shape[2]
    if nheads == 0 or nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k_cache's nheads_k ({nheads_k})")
    for name, stride in (("q", q_stride), ("k_cache", k_meta[3]), ("v_cache", v_meta[3])):
        if stride[-1] != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {stride}")
    _check_seqlens(seqlens_meta, batch, seqlen_cache, device)
    scale_type, softmax_scale = scale_meta
    if softmax_scale is not None:
        if scale_type is bool or not issubclass(scale_type, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {scale_type.__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    splits_type, num_splits = splits_meta
    if splits_type is bool or not issubclass(splits_type, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: planner decides), got {num_splits!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if out_meta is not None:
        out_dtype, out_device, out_shape, out_stride = out_meta
        if out_shape != q_shape or out_dtype != q_dtype or out_device != device or out_stride[-1] != 1:
            raise ValueError(
                f"out must match q (shape {tuple(q_shape)}, {q_dtype}, {device}, last dim contiguous), "
                f"got shape {tuple(out_shape)}, {out_dtype}, {out_device}, strides {out_stride}")
    return Problem(batch, seqlen_cache, nheads, nheads_k, headdim, str(q_dtype).removeprefix("torch."))


def _check_seqlens(seqlens_meta, batch, seqlen_cache, device):
    if len(seqlens_meta) == 2:  # not a tensor: (type, value)
        kind, value = seqlens_meta
        if value is None:
            return
        if kind is bool or not issubclass(kind, int):
            raise TypeError(f"cache_seqlens must be an int32 tensor, an int or None, got {kind.__name__}")
        if not 0 <= value <= seqlen_cache:
            raise ValueError(f"cache_seqlens must be in [0, seqlen_cache={seqlen_cache}], got {value}")
        return
    dtype, shape, stride, seqlens_device = seqlens_meta
    if dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {dtype}")
    if shape != (batch,) or stride[0] != 1:
        raise ValueError(f"cache_seqlens must be a contiguous tensor of shape ({batch},), "
                         f"got shape {tuple(shape)}, strides {stride}")
    if seqlens_device != device:
        raise ValueError(f"cache_seqlens must be on q's device {device}, got {seqlens_device}")
