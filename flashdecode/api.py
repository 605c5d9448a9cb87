"""The public call: validate -> plan -> run."""
from __future__ import annotations

import functools
import importlib.util
import math

import torch

from . import hardware, planner
from .reference import reference_decode
from .validate import validate


@functools.lru_cache(maxsize=None)
def tilelang_available() -> bool:
    """Whether the TileLang backend can be imported (TileLang is an optional extra)."""
    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        from .kernels import tilelang as _  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, contiguous: bool = True) -> str:
    """The backend that will run: 'reference' on CPU tensors, else the requested or best kernel.

    TileLang's kernels take contiguous q, caches and out only; 'auto' gives other layouts to Triton.
    """
    if device.type != "cuda":
        return "reference" if backend in ("auto", "reference") else backend
    if backend == "auto":
        return "tilelang" if contiguous and tilelang_available() else "triton"
    if backend == "tilelang" and not contiguous:
        raise ValueError("backend 'tilelang' needs contiguous q, k_cache, v_cache and out; "
                         "use backend='triton' for strided layouts")
    return backend


def _kernel_module(backend: str):
    if backend == "triton":
        from .kernels import triton as module
    elif backend == "tilelang":
        from .kernels import tilelang as module
    else:
        raise ValueError(f"backend {backend!r} has no kernels")
    return module


def flash_decode_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None,
                              num_splits=0, return_softmax_lse=False, backend="auto", out=None):
    """Decode attention over a KV cache; a drop-in for flash_attn_with_kvcache's decode path.

    q: (batch, 1, nheads, headdim); k_cache, v_cache: (batch, seqlen_cache, nheads_k, headdim),
    float16 or bfloat16, nheads a multiple of nheads_k (GQA). cache_seqlens: int32 tensor (batch,),
    an int for every row, or None (= seqlen_cache). Returns out (batch, 1, nheads, headdim) in q's
    dtype, and with ``return_softmax_lse`` also lse (batch, nheads, 1) float32 (natural log).
    A row of length 0 gives output 0 and lse -inf. ``num_splits`` > 0 forces that many KV splits;
    0 lets the planner decide. ``backend``: "auto", "tilelang", "triton" or "reference"
    (CPU tensors always use the reference unless a kernel backend is named, e.g. for Triton's
    interpreter).
    """
    problem, seqlens = validate(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, backend, out)
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    if seqlens is None or isinstance(seqlens, int):
        fill = problem.seqlen_cache if seqlens is None else seqlens
        seqlens = torch.full((problem.batch,), fill, dtype=torch.int32, device=q.device)
    contiguous = all(t.is_contiguous() for t in (q, k_cache, v_cache) + (() if out is None else (out,)))
    chosen = resolve_backend(backend, q.device, contiguous)
    if chosen == "reference":
        result, lse = reference_decode(q, k_cache, v_cache, seqlens, scale)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, lse) if return_softmax_lse else result

    plan = planner.plan(problem, hardware.profile_for(q.device), num_splits)
    result, lse = run_kernels(chosen, plan, problem, q, k_cache, v_cache, seqlens, scale, out)
    return (result, lse.unsqueeze(-1)) if return_softmax_lse else result


def run_kernels(backend, plan, problem, q, k_cache, v_cache, seqlens, softmax_scale, out=None):
    """Allocate the outputs and workspace, launch one backend's kernels; returns (out, lse (B, Hq)).

    No checks happen here: callers pass validated inputs (tests use it to feed out-of-range lengths).
    """
    result = torch.empty_like(q) if out is None else out
    lse = torch.empty((problem.batch, problem.nheads), dtype=torch.float32, device=q.device)
    # Split partials (16-byte aligned, as fresh allocations are); empty when nothing splits.
    part_rows = plan.programs_per_head if plan.needs_combine else 0
    part_o = torch.empty((part_rows, problem.nheads, problem.headdim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((part_rows, problem.nheads), dtype=torch.float32, device=q.device)
    _kernel_module(backend).run(
        plan, problem, q, k_cache, v_cache, seqlens, result, lse, part_o, part_lse, softmax_scale)
    return result, lse
