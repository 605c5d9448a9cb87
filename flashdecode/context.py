"""DecodeContext: the state calls reuse, owned by one object instead of module globals.

A context memoizes validation (metadata -> Problem) and routing (Problem -> backend and Plan), and
owns the device memory calls reuse: the float32 partials of split sequences, the counters of a
split kernel that merges them itself, the sink that takes the lse when the caller did not ask for
it, and the lengths tensors of an int ``cache_seqlens``.
It serves calls queued in order on one stream from one host thread: a call's split kernel writes the
partials only after the previous call's combine read them, because the stream orders them. While a
CUDA graph is being captured, every buffer is the graph's own, so it may replay on any stream:
allocated fresh, or for a merging kernel's counters taken from ``CAPTURED_COUNTERS``. It also holds
the compiled host path's launch records (``host_path``): a repeat of a call's metadata is launched
from C++ without entering the Python path. Dropping the context frees
its memory.

The plain call uses a default context per (host thread, device, stream) (``default_context``);
users who want control (a workspace per model, per layer group) create one and pass it. A context
can also carry a Tuning and a tile config that replace the measured defaults: sweeps vary them
this way, as values, never by reassigning module globals.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import warnings

import torch

from . import compat, hardware, host_path
from .kernels import base
from .planner import plan as make_plan
from .problem import contiguous_strides
from .validate import check_call, check_values, scalar_meta, tensor_meta, tensor_scalars, value_checks_enabled

#: Scalar argument types that need no conversion (``validate.tensor_scalars``).
_PLAIN_SCALARS = frozenset((float, int, bool, type(None)))
#: Entries a context's memo tables hold before they are cleared (each distinct shape is one).
MAX_MEMO_ENTRIES = 1024


class DecodeContext:
    """Workspace, lse sink, lengths tensors and plans for calls on one device and stream.

    ``tuning`` (a ``hardware.Tuning``) replaces the device profile's thresholds and ``auto`` order;
    ``config`` replaces the chosen backend's tile config for the kernel its plans name."""

    def __init__(self, device=None, *, tuning=None, config=None):
        self.device = None if device is None else torch.device(device)
        self._stream = None
        self.tuning = tuning
        self.config = config
        self._calls: dict = {}  # call metadata -> (Problem, backend, Plan, check index values)
        self._workspace = None
        self._workspace_views: dict = {}
        self._sink = None
        self._sink_views: dict = {}
        self._tickets = None
        self._ticket_views: dict = {}
        self._uniform_lengths: dict = {}
        self._host = None  # HostPath: the compiled host path's records (``host_path``), made on first use
        self._host_tried = False
        self._host_off_because: str | None = None  # why the context has no HostPath (none made, or dropped)

    # -- what runs -------------------------------------------------------------------------------
    def resolve(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                alibi_slopes, num_splits, backend, out, sinks=None, cu_seqlens_q=None, max_seqlen_q=None):
        """(Problem, backend, Plan, whether index values are checked on the host, whether the call
        runs on ``contiguous_copies``) of a call: the checks, ``kernels.select`` and
        ``planner.plan``, memoized per call metadata (one dict lookup on a repeat: host time is what
        small calls cost). Raises naming the bad argument."""
        meta = _fast_meta
        key = (meta(q), meta(k_cache), meta(v_cache),
               None if k is None else meta(k), None if v is None else meta(v),
               None if rotary_cos is None else meta(rotary_cos), None if rotary_sin is None else meta(rotary_sin),
               None if cache_seqlens is None else meta(cache_seqlens),
               None if cache_batch_idx is None else meta(cache_batch_idx),
               None if cache_leftpad is None else meta(cache_leftpad),
               None if block_table is None else meta(block_table),
               None if alibi_slopes is None else meta(alibi_slopes), None if out is None else meta(out),
               softmax_scale, type(softmax_scale), causal, type(causal), softcap, type(softcap),
               rotary_interleaved, type(rotary_interleaved), num_splits, type(num_splits), backend,
               window_size if type(window_size) is tuple and all(type(side) is int for side in window_size)
               else scalar_meta(window_size),
               None if sinks is None else meta(sinks), None if cu_seqlens_q is None else meta(cu_seqlens_q),
               scalar_meta(max_seqlen_q))
        try:
            entry = self._calls.get(key)
        except TypeError:  # an unhashable argument (a list, ...): checked, and rejected, unmemoized
            entry, key = None, None
        if entry is None:
            copies = any(_needs_copy(t) for t in (q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
            problem = check_call(
                _copied_meta("q", q), tensor_meta("k_cache", k_cache), tensor_meta("v_cache", v_cache),
                _copied_meta("k", k), _copied_meta("v", v), tensor_meta("rotary_cos", rotary_cos),
                tensor_meta("rotary_sin", rotary_sin),
                _copied_meta("cache_seqlens", cache_seqlens) if isinstance(cache_seqlens, torch.Tensor)
                else (None if cache_seqlens is None else scalar_meta(cache_seqlens)),
                _copied_meta("cache_batch_idx", cache_batch_idx), _copied_meta("cache_leftpad", cache_leftpad),
                _copied_meta("block_table", block_table), scalar_meta(softmax_scale), scalar_meta(causal),
                scalar_meta(window_size), scalar_meta(softcap), scalar_meta(rotary_interleaved),
                tensor_meta("alibi_slopes", alibi_slopes), scalar_meta(num_splits), scalar_meta(backend),
                tensor_meta("out", out), sinks=tensor_meta("sinks", sinks),
                cu_seqlens_q=tensor_meta("cu_seqlens_q", cu_seqlens_q),
                max_seqlen_q=None if max_seqlen_q is None else scalar_meta(max_seqlen_q))
            chosen, plan = self._route(problem, backend, int(num_splits), q.device)
            on_host = [t for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q)
                       if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            # the reference indexes on the host: its values are always checked (never out of bounds)
            entry = (problem, chosen, plan, bool(on_host) or (chosen.name == "reference" and q.device.type != "cpu"),
                     copies)
            if key is not None:
                _remember(self._calls, key, entry)
        return entry

    def _route(self, problem, backend: str, num_splits: int, device: torch.device):
        """(backend object, Plan) for a problem: ``kernels.select`` then ``planner.plan``."""
        profile = hardware.profile_for(device)
        if self.tuning is not None:
            profile = dataclasses.replace(profile, tuning=self.tuning)
        chosen = base.select(backend, problem, device, profile)
        return chosen, make_plan(problem, profile, chosen, num_splits, self.config)

    # -- device memory -----------------------------------------------------------------------------
    def _bind(self, device: torch.device) -> bool:
        """Tie the context to the first call's device and CUDA stream: its workspace is reused in
        stream order, so calls from another stream would race on it (except while that stream
        captures a graph, whose buffers are its own). Whether the call is on the bound stream."""
        stream = compat.current_stream_handle(_index(device)) if device.type == "cuda" else 0
        if self.device is None:
            self.device = device
        elif self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device
            self.device = torch.device("cuda", _index(self.device))
        if self._stream is None:
            self._stream = stream
        if device != self.device:
            raise ValueError(f"context is bound to {self.device}, got q on {device}: use one context per device")
        elif stream != self._stream and not _capturing(device):
            raise ValueError("context is bound to another CUDA stream: use one DecodeContext per stream "
                             "(the plain call keeps one per stream by itself)")
        return stream == self._stream

    def partials(self, plan, problem, device, capturing=None):
        """part_o (W, Hk * q_rows, D) and part_lse (W, Hk * q_rows), float32 views of one buffer; empty
        when the plan does not split."""
        rows, columns, headdim = plan.workspace_rows, problem.nheads_k * problem.q_rows, problem.headdim
        key = (rows, columns, headdim)
        views = self._workspace_views.get(key)
        if rows == 0 and views is not None:  # nothing is read or written: shared, even by graphs
            return views
        if rows and (_capturing(device) if capturing is None else capturing):
            return _partial_views(torch.empty(rows * columns * (headdim + 1), dtype=torch.float32, device=device),
                                  rows, columns, headdim)
        if views is None:
            need = rows * columns * (headdim + 1)
            if rows == 0:
                views = _partial_views(torch.empty(0, dtype=torch.float32, device=device), 0, columns, headdim)
                _remember(self._workspace_views, key, views)
                return views
            grown = _grown(self._workspace, need, lambda size: torch.empty(size, dtype=torch.float32, device=device))
            if grown is not self._workspace:
                # The old buffer goes back to the caching allocator, which reuses it on this stream
                # only after the kernels already queued here.
                self._workspace = grown
                self._workspace_views.clear()
            views = _partial_views(self._workspace, rows, columns, headdim)
            _remember(self._workspace_views, key, views)
        return views

    def tickets(self, plan, problem, device, capturing=None) -> torch.Tensor | None:
        """The int32 counters a merging split kernel takes tickets from (``Plan.ticket_count``), or
        None. Zero when made; every kernel leaves its counters at zero (the merging program resets
        them), so calls reuse them in stream order and a CUDA graph replays; under capture they are
        counters no other call or graph uses (``CAPTURED_COUNTERS``)."""
        count = plan.ticket_count(problem)
        if count == 0:
            return None
        if _capturing(device) if capturing is None else capturing:
            return CAPTURED_COUNTERS.take(device, count)
        if device.type == "cuda":  # before any capture needs them
            CAPTURED_COUNTERS.prepare(device)
        view = self._ticket_views.get(count)
        if view is None:
            grown = _grown(self._tickets, count, lambda size: torch.zeros(size, dtype=torch.int32, device=device))
            if grown is not self._tickets:
                self._tickets = grown
                self._ticket_views.clear()
            view = self._tickets[:count]
            _remember(self._ticket_views, count, view)
        return view

    def lse(self, problem, device, wanted: bool, capturing=None, total_q: int = 0) -> torch.Tensor:
        """(B, Hq, Sq) float32 for the call's lse ((Hq, total_q) for ragged queries): fresh when
        asked for, else a view of the sink, which nothing reads."""
        shape = (problem.nheads, total_q) if problem.ragged else (problem.batch, problem.nheads, problem.seqlen_q)
        if wanted or (_capturing(device) if capturing is None else capturing):
            return torch.empty(shape, dtype=torch.float32, device=device)
        view = self._sink_views.get(shape)
        if view is None:
            need = math.prod(shape)
            # never an inference tensor: a sink made in a call under torch.inference_mode would refuse
            # the in-place writes of later calls outside it (the reference backend's copy_)
            with torch.inference_mode(False):
                if self._sink is None or self._sink.numel() < need:
                    size = max(need, 2 * self._sink.numel()) if self._sink is not None else need
                    self._sink = torch.empty(size, dtype=torch.float32, device=device)
                    self._sink_views.clear()
                view = self._sink[:need].view(shape)
            _remember(self._sink_views, shape, view)
        return view

    def lengths(self, problem, cache_seqlens, device, capturing=None) -> torch.Tensor:
        """cache_seqlens as an int32 (B,) tensor: as given, or made once per value for an int (None:
        the capacity; appended tokens then need an explicit length, see validate)."""
        if isinstance(cache_seqlens, torch.Tensor):
            return cache_seqlens
        value = problem.seqlen_cache if cache_seqlens is None else int(cache_seqlens)
        if _capturing(device) if capturing is None else capturing:
            return torch.full((problem.batch,), value, dtype=torch.int32, device=device)
        key = (problem.batch, value)
        tensor = self._uniform_lengths.get(key)
        if tensor is None:
            tensor = torch.full((problem.batch,), value, dtype=torch.int32, device=device)
            _remember(self._uniform_lengths, key, tensor)
        return tensor

    # -- the call ----------------------------------------------------------------------------------
    def run(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
            return_softmax_lse=False, backend="auto", out=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None):
        """validate -> route -> launch; returns out (and lse (B, Hq, Sq) when asked for)."""
        on_bound_stream = self._bind(q.device)
        return self._run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse, backend, out, on_bound_stream, sinks=sinks,
                         cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)

    def _run(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_softmax_lse, backend, out, on_bound_stream=True, sinks=None, cu_seqlens_q=None, max_seqlen_q=None):
        """``run`` on a context already bound to q's device (``default_context`` returns it so, on
        its current stream; ``on_bound_stream`` False: on another stream, which is capturing)."""
        if not (type(softmax_scale) in _PLAIN_SCALARS and type(causal) in _PLAIN_SCALARS and type(softcap) in
                _PLAIN_SCALARS and type(rotary_interleaved) in _PLAIN_SCALARS and type(num_splits) in _PLAIN_SCALARS):
            # (type membership: 74 ns on the CPU machine, where an isinstance of each took 307)
            softmax_scale, causal, softcap, rotary_interleaved, num_splits = tensor_scalars(
                softmax_scale, causal, softcap, rotary_interleaved, num_splits)
        if value_checks_enabled() or not on_bound_stream or not (sinks is cu_seqlens_q is max_seqlen_q is None):
            host = None  # (the compiled host path takes FlashAttention 2's arguments only)
        elif self._host_tried:
            host = self._host
        else:  # the first call: not under a capture, where building the extension would stall it
            host = None if _capturing(q.device) else self._host_path(q.device)
        if host is not None:
            found = host.run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, out,
                             self._stream)  # a miss while the stream captures (the extension asks the driver)
            if found is not None:
                return found
        device = q.device
        capturing = _capturing(device)  # buffers a graph records must be its own (fresh, or CAPTURED_COUNTERS)
        if capturing:
            host = None
        problem, chosen, plan, host_checks, copies = self.resolve(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            backend, out, sinks, cu_seqlens_q, max_seqlen_q)
        if copies:
            q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table = contiguous_copies(
                q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
        if host_checks or value_checks_enabled():
            check_values(problem, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, force=True,
                         block_ids_from=chosen.block_ids_read_from(plan), cu_seqlens_q=cu_seqlens_q,
                         total_q=q.shape[0])
        result = torch.empty_like(q) if out is None else out
        lse = self.lse(problem, device, return_softmax_lse, capturing, q.shape[0])
        part_o, part_lse = self.partials(plan, problem, device, capturing)
        scale = problem.headdim ** -0.5 if softmax_scale is None else float(softmax_scale)
        arguments = base.LaunchArgs(
            q, k_cache, v_cache, self.lengths(problem, cache_seqlens, device, capturing), result, lse, part_o, part_lse,
            scale, float(softcap), k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
            alibi_slopes, self.tickets(plan, problem, device, capturing), sinks, cu_seqlens_q)
        chosen.launch(plan, problem, arguments)
        if arguments.tickets is not None and value_checks_enabled() and not capturing:
            _check_counters_left_at_zero(arguments.tickets)
        if host is not None and not host_checks and not copies:  # a record would replay this call's copies
            call = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_softmax_lse, backend, out, self._stream)
            self._record(host, call, chosen.host_launches(plan, problem, arguments), problem, result,
                         lse if return_softmax_lse else None)
        return (result, lse) if return_softmax_lse else result

    @property
    def host_path(self):
        """The compiled host path's records for this context (``flashdecode.host_path.HostPath``:
        ``len()`` records, ``hits``), or None before the first CUDA call and where it is off."""
        return self._host

    @property
    def host_path_off_because(self) -> str | None:
        """Why this context's calls take the Python path (None: they may take the compiled one, or
        no call ran yet): host-side value checks are on, its device is not CUDA, the process cannot
        build or load the extension (``host_path.unavailable``), or the check of its first record
        failed (``HostPath.verify``)."""
        if value_checks_enabled():
            return "host-side value checks are on (set_value_checks)"
        return self._host_off_because

    def _host_path(self, device: torch.device):
        """The context's HostPath (``host_path.for_device``), made on the first call; None when off."""
        if not self._host_tried:
            self._host_tried = True
            self._host = host_path.for_device(device)
            if self._host is None:
                self._host_off_because = host_path.unavailable() if device.type == "cuda" else \
                    f"{device.type} is not a CUDA device"
        return self._host

    def _record(self, host, call, launches, problem, result, lse) -> None:
        """Give the host path the record of a call the Python path just launched; the context's first
        record of each kind (TVM-FFI, CUDA launches) is replayed and compared before any call uses it
        (``HostPath.verify``)."""
        if launches is None:
            return
        if host.add(call, launches, result, lse, (problem.batch, problem.nheads, problem.seqlen_q)) and \
                host.needs_verify(launches):
            host.verify(call, launches, result, lse)
            if host.off_because is not None:
                self._host, self._host_off_because = None, host.off_because


def _fast_meta(tensor):
    """What a tensor argument's memo key holds: (dtype, device, shape, strides, 16-byte aligned);
    anything else as (type, itself)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype, tensor.device, tensor.shape, tensor.stride(), tensor.data_ptr() % 16 == 0
    return type(tensor), tensor


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _with_index(device: torch.device) -> torch.device:
    """``device`` with its index (a plain "cuda" means the current device)."""
    return device if device.type != "cuda" or device.index is not None else torch.device("cuda", _index(device))


def _grown(buffer: torch.Tensor | None, need: int, make) -> torch.Tensor:
    """``buffer`` if it holds ``need`` elements, else ``make(size)`` of at least twice its size (a
    context's buffers grow geometrically, so a few shapes do not reallocate call after call)."""
    if buffer is not None and buffer.numel() >= need:
        return buffer
    return make(max(need, 2 * buffer.numel()) if buffer is not None else need)


def _remember(table: dict, key, value) -> None:
    if len(table) >= MAX_MEMO_ENTRIES:
        table.clear()
    table[key] = value


def _needs_copy(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.stride(-1) != 1


def _copied_meta(name, tensor):
    """``tensor_meta`` of the tensor the call runs on: its contiguous copy where it needs one."""
    meta = tensor_meta(name, tensor)
    if _needs_copy(tensor):
        return meta[0], meta[1], meta[2], contiguous_strides(meta[2]), True
    return meta


def contiguous_copies(q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table) -> tuple:
    """As FlashAttention's wrapper does: q, the appended k and v, and the index tensors copied where
    their last dimension is not contiguous (the caches never: they are written in place). Such a
    call takes the Python path every time: the compiled host path cannot make the copies."""
    return tuple(tensor.clone(memory_format=torch.contiguous_format) if _needs_copy(tensor) else tensor
                 for tensor in (q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table))


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (not the current device's)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _partial_views(buffer: torch.Tensor, rows: int, columns: int, headdim: int):
    """part_o and part_lse at the start of ``buffer``; part_lse starts rows * columns * headdim floats
    in (16-byte aligned when headdim is a multiple of 4, as the TileLang kernels need)."""
    body = rows * columns * headdim
    return (buffer.as_strided((rows, columns, headdim), (columns * headdim, headdim, 1)),
            buffer.as_strided((rows, columns), (columns, 1), body))


class CapturedCounters:
    """Zeroed int32 ticket counters for merging split kernels captured in CUDA graphs, per device.

    A captured call needs counters of its own (its graph may replay on any stream), zero at the first
    replay; each kernel leaves them at zero, so every later replay finds them so. Made fresh with
    ``torch.zeros`` under capture, they cost the graph a memset node before the kernel in every replay
    (1.2-1.6 us of GPU time on the H200, session 19; ``docs/design.md``, "The schedule"). So the first
    eager call that merges zeroes a buffer of ``size`` counters per device outside any capture
    (``torch.cuda.graph`` synchronizes the device before it captures), and each captured call takes
    counters no other call or graph uses. An eager merging call on the Python path (a context's first
    call of each metadata) also starts a new buffer once less than a quarter of the current one is left
    (the old stays, as graphs hold its counters); a capture that finds too few gets ``torch.zeros``
    again (correct, with the memset; warned once).

    What the memset did beside: every replay started from zero. A replay whose programs disagree on
    a sequence's splits (``cache_seqlens`` written while the kernel ran) leaves a counter non-zero,
    and later replays of that graph skip that merge; ``reset`` zeroes every buffer again (call it
    with no graph replaying on the device)."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._buffers: dict = {}  # device -> [buffers, counters of the last one handed out]
        self._warned = False

    def _new_buffer(self, device: torch.device) -> torch.Tensor:
        with torch.inference_mode(False):  # never an inference tensor (see ``DecodeContext.lse``)
            return torch.zeros(self.size, dtype=torch.int32, device=device)

    def prepare(self, device: torch.device) -> None:
        """Outside capture: make the device's buffer, or a new one when the current is nearly used up."""
        device = _with_index(device)
        entry = self._buffers.get(device)
        if entry is not None and entry[1] <= self.size * 3 // 4:
            return
        with self._lock:
            entry = self._buffers.get(device)
            if entry is None:
                self._buffers[device] = [[self._new_buffer(device)], 0]
            elif entry[1] > self.size * 3 // 4:
                entry[0].append(self._new_buffer(device))
                entry[1] = 0

    def take(self, device: torch.device, count: int) -> torch.Tensor:
        """``count`` zeroed counters for a call being captured: the buffer's next unused ones, or fresh."""
        entry = self._buffers.get(_with_index(device))
        with self._lock:
            if entry is not None and entry[1] + count <= self.size:
                view = entry[0][-1][entry[1]:entry[1] + count]
                entry[1] += count
                return view
            warn = not self._warned
            self._warned = True
        if warn:
            warnings.warn("flashdecode: the zeroed counters for captured merging calls are used up (or were never "
                          "made by an eager call): captured calls record a memset of their own (CapturedCounters)",
                          stacklevel=3)
        return torch.zeros(count, dtype=torch.int32, device=device)

    def handed_out(self, device: torch.device) -> int:
        """Counters of the device's current buffer that captured calls hold (0 before it is made)."""
        entry = self._buffers.get(_with_index(device))
        return 0 if entry is None else entry[1]

    def reset(self, device: torch.device) -> None:
        """Zero every buffer of the device again (eagerly, with no graph replaying there)."""
        entry = self._buffers.get(_with_index(device))
        for buffer in [] if entry is None else entry[0]:
            buffer.zero_()


#: 2^21 counters (8 MiB) a buffer: a captured call takes batch x KV heads x row tiles of them.
CAPTURED_COUNTERS = CapturedCounters(1 << 21)


class _DefaultContexts(threading.local):
    """One table per host thread: (device index, stream handle) for CUDA, else (device, 0) ->
    DecodeContext (``default_context``)."""

    def __init__(self):
        self.table: dict = {}


_defaults = _DefaultContexts()
#: Streams per thread whose default contexts are kept; past it the table starts again.
MAX_DEFAULT_CONTEXTS = 16


def default_context(q: torch.Tensor) -> DecodeContext:
    """The context the plain call on ``q`` uses on this host thread: one per device and current
    stream (bound to both). CUDA tensors are looked up by (device index, stream handle), ints: a
    ``torch.device``'s ``type`` alone takes ~0.2 us, which every eager call would pay."""
    if q.is_cuda:
        index = q.get_device()
        key = (index, compat.current_stream_handle(index))
    else:
        key = (q.device, 0)
    context = _defaults.table.get(key)
    if context is None:
        if len(_defaults.table) >= MAX_DEFAULT_CONTEXTS:
            _defaults.table.clear()
        device = q.device
        context = _defaults.table[key] = DecodeContext(device)
        context._bind(device)
    return context


def _check_counters_left_at_zero(tickets: torch.Tensor) -> None:
    """With value checks on: a merging split kernel leaves its ticket counters at zero. One left
    over (cache_seqlens changed while the kernel ran, the counters shared by concurrent launches,
    a fault) would make every later call on them skip its merge; they are reset and the call fails."""
    if bool(tickets.any()):
        tickets.zero_()
        raise RuntimeError("tickets: the split kernel left its ticket counters non-zero (cache_seqlens changed "
                           "while it ran, or the counters were shared by concurrent launches); they are reset "
                           "and this call's output is not valid")
