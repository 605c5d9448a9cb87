"""Input checks for flash_decode_with_kvcache: the one validation path.

Every error names the argument, what it got and what was expected. Checks are host-side metadata
reads (a few microseconds) except the bounds of a CUDA ``cache_seqlens``, which need a
device-to-host copy: that one runs only when enabled (``set_seqlens_check(True)`` or the
environment variable ``FLASHDECODE_CHECK_SEQLENS=1``). When it is off, the kernels still clamp
every length into [0, seqlen_cache] (no out-of-bounds read) and write NaN into the output rows of
an out-of-range length, so a bad length is never a silent wrong answer.
"""
from __future__ import annotations

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


def _require_rank4(name, tensor, layout):
    if tensor.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}, got shape {tuple(tensor.shape)}")


def validate(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, backend, out):
    """Check the inputs of a decode call; return (Problem, cache_seqlens as an int32 tensor or None).

    None means "every row has seqlen_cache tokens", which the caller turns into a tensor only when
    a kernel needs it.
    """
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, tensor)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}")
    _require_rank4("q", q, "(batch, seqlen_q, nheads, headdim)")
    _require_rank4("k_cache", k_cache, "(batch, seqlen_cache, nheads_k, headdim)")
    _require_rank4("v_cache", v_cache, "(batch, seqlen_cache, nheads_k, headdim)")
    batch, seqlen_q, nheads, headdim = q.shape
    if batch == 0:
        raise ValueError("q must have batch >= 1, got batch 0")
    if seqlen_q != 1:
        raise ValueError(f"q must have seqlen_q == 1 (decode), got q.shape[1] = {seqlen_q}")
    if headdim not in SUPPORTED_HEADDIMS:
        raise ValueError(f"q's head dim must be one of {SUPPORTED_HEADDIMS}, got {headdim}")
    if k_cache.shape[0] != batch or k_cache.shape[3] != headdim:
        raise ValueError(
            f"k_cache must have shape ({batch}, seqlen_cache, nheads_k, {headdim}) to match q, "
            f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    seqlen_cache, nheads_k = k_cache.shape[1], k_cache.shape[2]
    if nheads == 0 or nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k_cache's nheads_k ({nheads_k})")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}")
    seqlens = _validate_seqlens(cache_seqlens, batch, seqlen_cache, q.device)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: planner decides), got {num_splits!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if out is not None:
        _require_tensor("out", out)
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
            raise ValueError(
                f"out must match q (shape {tuple(q.shape)}, {q.dtype}, {q.device}, last dim contiguous), "
                f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}, strides {out.stride()}")
    problem = Problem(batch, seqlen_cache, nheads, nheads_k, headdim, str(q.dtype).removeprefix("torch."))
    return problem, seqlens


def _validate_seqlens(cache_seqlens, batch, seqlen_cache, device):
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int32 tensor, an int or None, got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= seqlen_cache:
            raise ValueError(f"cache_seqlens must be in [0, seqlen_cache={seqlen_cache}], got {cache_seqlens}")
        return cache_seqlens
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (batch,) or cache_seqlens.stride(0) != 1:
        raise ValueError(f"cache_seqlens must be a contiguous tensor of shape ({batch},), "
                         f"got shape {tuple(cache_seqlens.shape)}, strides {cache_seqlens.stride()}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on q's device {device}, got {cache_seqlens.device}")
    if cache_seqlens.device.type == "cpu" or _check_seqlens_on_device:
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high > seqlen_cache:
            raise ValueError(
                f"cache_seqlens must be in [0, seqlen_cache={seqlen_cache}], got values in [{low}, {high}]")
    return cache_seqlens
