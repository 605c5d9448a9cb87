"""The public call: validate -> plan -> run."""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading

import torch

from . import hardware, planner
from .reference import reference_decode
from .validate import validate


@functools.lru_cache(maxsize=None)
def tilelang_available() -> bool:
    """Whether the TileLang backend can be imported (TileLang is an optional extra) and can build
    kernels: its first call of each specialisation compiles with nvcc, which TileLang looks for
    under its CUDA_HOME. ``auto`` takes TileLang only then."""
    if importlib.util.find_spec("tilelang") is None:
        return False
    try:
        from tilelang.env import CUDA_HOME

        from .kernels import tilelang as _  # noqa: F401
    except ImportError:
        return False
    return bool(CUDA_HOME) and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))


#: The largest GQA group TileLang's kernel takes (its q tile has 64 rows).
TILELANG_MAX_GROUP = 64


@functools.lru_cache(maxsize=None)
def is_hopper(device_index: int | None) -> bool:
    """Whether CUDA device ``device_index`` (None: the current one) is a Hopper (sm_90), the only
    GPU TileLang's kernels are built for."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def tilelang_limitation(tensors, group: int) -> str | None:
    """Why TileLang cannot take these tensors, or None: it needs contiguous, 16-byte aligned tensors
    (TMA descriptors, vector loads) and a group of at most TILELANG_MAX_GROUP. (The device's own
    requirement, a Hopper, is checked by resolve_backend.)"""
    if group > TILELANG_MAX_GROUP:
        return f"a GQA group of at most {TILELANG_MAX_GROUP} (got {group})"
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return "contiguous, 16-byte aligned q, k_cache, v_cache and out"
    return None


#: ``backend="auto"`` runs Triton on caches of at least this many bytes of K and V (capacity, not
#: the real lengths, which stay on the device), TileLang below. Measured on the H200
#: (docs/benchmarks.md, "How auto chooses"): from this size (cases 7, 9, 11, 12: 383-1024 MiB)
#: Triton's split kernel takes 4-11% less GPU time and its 65-91 us of host time hides behind
#: 81-187 us of GPU work. Below it (cases 1-6, 8, 10, 13, 14: up to 230 MiB) an eager call's host
#: time nears or exceeds its GPU time for Triton (cases 8, 10, 14: 63-65 us against 20-52 us) and
#: TileLang's is about half of Triton's; replayed from a CUDA graph, Triton is 1-15% faster on
#: cases 5, 8, 10, 13 and 14 too (name it there).
AUTO_TRITON_FROM_BYTES = 256 * 1024 * 1024


def cache_bytes(problem) -> int:
    """Bytes of K and V a call could read: the whole capacity of every sequence."""
    return 2 * problem.batch * problem.seqlen_cache * problem.nheads_k * problem.headdim * problem.element_bytes


def resolve_backend(backend: str, device: torch.device, tilelang_limit: str | None = None, problem=None) -> str:
    """The backend that will run: 'reference' on CPU tensors, else the requested or best kernel.

    ``tilelang_limit``: what the call's tensors lack for TileLang (``tilelang_limitation``); the
    device is checked here (TileLang's kernels are Hopper-only: TMA, wgmma, sm_90a).
    'auto' takes Triton where TileLang cannot run the call, and for ``problem``s whose cache holds
    at least AUTO_TRITON_FROM_BYTES of K and V; TileLang for the others (and when no problem is
    given). Naming TileLang for a call it cannot take is an error.
    """
    if device.type != "cuda":
        return "reference" if backend in ("auto", "reference") else backend
    if backend not in ("auto", "tilelang"):
        return backend
    if tilelang_limit is None and not is_hopper(device.index):
        tilelang_limit = "a Hopper GPU (compute capability 9.x)"
    if backend == "auto":
        large = problem is not None and cache_bytes(problem) >= AUTO_TRITON_FROM_BYTES
        return "tilelang" if tilelang_limit is None and tilelang_available() and not large else "triton"
    if tilelang_limit is not None:
        raise ValueError(f"backend 'tilelang' needs {tilelang_limit}; use backend='triton'")
    return backend


_KERNEL_MODULES = {}


def _kernel_module(backend: str):
    """The kernel module of a backend, imported on first use (TileLang is optional)."""
    module = _KERNEL_MODULES.get(backend)
    if module is None:
        if backend == "triton":
            from .kernels import triton as module
        elif backend == "tilelang":
            from .kernels import tilelang as module
        else:
            raise ValueError(f"backend {backend!r} has no kernels")
        _KERNEL_MODULES[backend] = module
    return module


def _uniform_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """The int32 lengths tensor for an int (or None) cache_seqlens: made once per value for eager
    calls (no fill kernel per call; kernels only read it), fresh while a CUDA graph is being
    captured, so that the graph owns it: a cached tensor can be evicted and freed while a graph that
    recorded its address still replays."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    return _cached_uniform_seqlens(batch, length, device)


@functools.lru_cache(maxsize=64)
def _cached_uniform_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.full((batch,), length, dtype=torch.int32, device=device)


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
        seqlens = _uniform_seqlens(problem.batch, problem.seqlen_cache if seqlens is None else seqlens, q.device)
    limit = None
    if q.device.type == "cuda" and backend in ("auto", "tilelang"):
        limit = tilelang_limitation((q, k_cache, v_cache) + (() if out is None else (out,)), problem.group)
    chosen = resolve_backend(backend, q.device, limit, problem)
    if chosen == "reference":
        result, lse = reference_decode(q, k_cache, v_cache, seqlens, scale)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, lse) if return_softmax_lse else result

    plan = plan_for(chosen, problem, hardware.profile_for(q.device), int(num_splits))
    result, lse = run_kernels(chosen, plan, problem, q, k_cache, v_cache, seqlens, scale, out,
                              return_lse=return_softmax_lse)
    return (result, lse.unsqueeze(-1)) if return_softmax_lse else result


def resident_programs(backend: str | None, problem, profile) -> int:
    """Split programs of ``backend``'s kernel one SM holds at once; without a kernel backend, the
    planner's assumption (``planner.ASSUMED_RESIDENT_PROGRAMS``)."""
    if backend in ("tilelang", "triton"):
        return _kernel_module(backend).resident_programs_for(problem, profile)
    return planner.ASSUMED_RESIDENT_PROGRAMS


def plan_for(backend: str | None, problem, profile, num_splits: int = 0):
    """The planner's schedule for one backend's kernels (their residency caps a single sequence's
    grid)."""
    return planner.plan(problem, profile, num_splits, resident_programs(backend, problem, profile))


@functools.lru_cache(maxsize=64)
def _no_partials(device: torch.device, nheads: int, headdim: int):
    """Zero-row partial buffers for plans that never split, made once: nothing reads or writes
    them, so sharing them between calls and streams is safe, and it saves an allocation
    (~2-5 us on the H200 machines' CPUs) per call."""
    return (torch.empty((0, nheads, headdim), dtype=torch.float32, device=device),
            torch.empty((0, nheads), dtype=torch.float32, device=device))


_LSE_SINKS: dict = {}  # (device, batch, nheads) -> a (batch, nheads) view of a sink buffer
_SINK_BUFFERS: dict = {}  # device -> every sink buffer ever made there, largest last (never freed)
_SINK_LOCK = threading.Lock()


def _lse_sink(device: torch.device, batch: int, nheads: int) -> torch.Tensor:
    """Where the kernels write lse when the caller did not ask for it, instead of a fresh allocation.

    Nothing ever reads it, so calls on different streams writing it at once only overwrite values
    nobody uses; and no sink buffer is ever freed, so a CUDA graph that captured one keeps a valid
    pointer. One buffer per device serves every (batch, nheads) until a larger one is needed (the
    size at least doubles), so all of them together stay under four times the largest
    batch * nheads floats. Made under a lock: calls from several threads may miss at once."""
    key = (device, batch, nheads)
    sink = _LSE_SINKS.get(key)
    if sink is None:
        with _SINK_LOCK:
            buffers = _SINK_BUFFERS.setdefault(device, [])
            need = batch * nheads
            if buffers and buffers[-1].numel() >= need:
                buffer = buffers[-1]
            else:
                buffer = torch.empty(max(need, 2 * buffers[-1].numel()) if buffers else need,
                                     dtype=torch.float32, device=device)
                buffers.append(buffer)
            sink = _LSE_SINKS[key] = buffer[:need].view(batch, nheads)
    return sink


def _partials(rows: int, nheads: int, headdim: int, device: torch.device):
    """part_o (rows, nheads, headdim) and part_lse (rows, nheads), float32, as two views of one new
    allocation (``_partial_views``)."""
    buffer = torch.empty(rows * nheads * (headdim + 1), dtype=torch.float32, device=device)
    return _partial_views(buffer, rows, nheads, headdim)


def _partial_views(buffer: torch.Tensor, rows: int, nheads: int, headdim: int):
    """part_o and part_lse at the start of ``buffer`` (a view costs ~1 us of host time, an
    allocation 2-5 us); part_lse starts rows * nheads * headdim floats in, a multiple of 16 bytes
    (headdim is), as the kernels need."""
    body = rows * nheads * headdim
    return (buffer.as_strided((rows, nheads, headdim), (nheads * headdim, headdim, 1)),
            buffer.as_strided((rows, nheads), (nheads, 1), body))


def _workspace(rows: int, nheads: int, headdim: int, device: torch.device):
    """The partials of one split call. Eager calls share one buffer per (device, stream, host
    thread): one thread's calls on one stream launch split, combine, split, combine in order, so a
    call's split kernel writes it only after the previous call's combine kernel has read it, and
    reuse saves an allocation and two views, a few us of host time a call (perf log 19). Two threads
    sharing a stream get separate buffers, since their launches may interleave. While a CUDA graph
    is being captured the partials are fresh: the graph owns them and may replay on any stream."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _partials(rows, nheads, headdim, device)
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    return _stream_workspace(device, stream, threading.get_ident()).partials(rows, nheads, headdim)


#: Shapes whose views a workspace keeps (each new batch size is one); past it they are cut again.
MAX_WORKSPACE_SHAPES = 256


class _StreamWorkspace:
    """A float32 buffer grown to the largest partials asked of it (at least doubling, so it holds
    under twice the largest), and the views cut from it for each shape. Used by one host thread."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.float32, device=device)
        self.views: dict = {}

    def partials(self, rows: int, nheads: int, headdim: int):
        views = self.views.get((rows, nheads, headdim))
        if views is None:
            need = rows * nheads * (headdim + 1)
            if self.buffer.numel() < need:
                # The old buffer's memory goes back to the caching allocator, which hands it out
                # again on this stream only, after the kernels queued on it.
                self.buffer = torch.empty(max(need, 2 * self.buffer.numel()), dtype=torch.float32, device=self.device)
                self.views.clear()
            if len(self.views) >= MAX_WORKSPACE_SHAPES:
                self.views.clear()
            views = self.views[(rows, nheads, headdim)] = _partial_views(self.buffer, rows, nheads, headdim)
        return views


@functools.lru_cache(maxsize=16)
def _stream_workspace(device: torch.device, stream: int, thread: int) -> _StreamWorkspace:
    return _StreamWorkspace(device)


def run_kernels(backend, plan, problem, q, k_cache, v_cache, seqlens, softmax_scale, out=None, return_lse=True):
    """Allocate the outputs and workspace, launch one backend's kernels; returns (out, lse (B, Hq)),
    lse None unless ``return_lse`` (the kernels then write it to a sink).

    No checks happen here: callers pass validated inputs (tests use it to feed out-of-range lengths).
    """
    result = torch.empty_like(q) if out is None else out
    if return_lse:
        lse = torch.empty((problem.batch, problem.nheads), dtype=torch.float32, device=q.device)
    else:
        lse = _lse_sink(q.device, problem.batch, problem.nheads)
    if plan.needs_combine:
        part_o, part_lse = _workspace(plan.programs_per_head, problem.nheads, problem.headdim, q.device)
    else:
        part_o, part_lse = _no_partials(q.device, problem.nheads, problem.headdim)
    _kernel_module(backend).run(
        plan, problem, q, k_cache, v_cache, seqlens, result, lse, part_o, part_lse, softmax_scale)
    return result, (lse if return_lse else None)
