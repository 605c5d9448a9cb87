"""Workspace: the device memory a context's calls reuse, and the zeroed counters of captured calls.

A :class:`Workspace` owns the float32 partials of split sequences, the counters of a split kernel
that merges them itself, the sink that takes the lse when the caller did not ask for it, and the
lengths tensors of an int ``cache_seqlens``. Its buffers are reused in stream order: a call's split
kernel writes the partials only after the previous call's combine read them, because the stream
orders them (so a workspace serves one stream: ``DecodeContext`` binds it). While a CUDA graph is
being captured every buffer is the graph's own, so that it may replay on any stream: allocated
fresh, or for a merging kernel's counters taken from :data:`CAPTURED_COUNTERS`. Dropping the
workspace frees its memory.
"""
from __future__ import annotations

import math
import threading
import warnings

import torch

#: Entries a memo table holds before it is cleared (each distinct shape is one).
MAX_MEMO_ENTRIES = 1024


def remember(table: dict, key, value) -> None:
    """``table[key] = value``, the table cleared first when it holds MAX_MEMO_ENTRIES."""
    if len(table) >= MAX_MEMO_ENTRIES:
        table.clear()
    table[key] = value


def stream_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (not the current device's)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def device_index(device: torch.device) -> int:
    """A CUDA device's index (a plain "cuda" means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


class Workspace:
    """Partials, ticket counters, lse sink, lengths and descale tensors for calls queued on one stream.

    Each method takes ``capturing`` (whether the call's stream captures a CUDA graph; None: asked),
    and under capture returns buffers of the graph's own."""

    def __init__(self):
        self._partials = None
        self._partial_views: dict = {}
        self._sink = None
        self._sink_views: dict = {}
        self._tickets = None
        self._ticket_views: dict = {}
        self._uniform_lengths: dict = {}
        self._descales: dict = {}  # number -> 0-d float32 tensor (``descale``)

    def partials(self, plan, problem, device, capturing=None):
        """part_o (W, Hk * q_rows, D) and part_lse (W, Hk * q_rows), float32 views of one buffer; empty
        when the plan does not split."""
        rows, columns, headdim = plan.workspace_rows, problem.nheads_k * problem.q_rows, problem.headdim
        key = (rows, columns, headdim)
        views = self._partial_views.get(key)
        if rows == 0 and views is not None:  # nothing is read or written: shared, even by graphs
            return views
        if rows and (stream_capturing(device) if capturing is None else capturing):
            return _partial_views(torch.empty(rows * columns * (headdim + 1), dtype=torch.float32, device=device),
                                  rows, columns, headdim)
        if views is None:
            need = rows * columns * (headdim + 1)
            if rows == 0:
                views = _partial_views(torch.empty(0, dtype=torch.float32, device=device), 0, columns, headdim)
                remember(self._partial_views, key, views)
                return views
            grown = _grown(self._partials, need, lambda size: torch.empty(size, dtype=torch.float32, device=device))
            if grown is not self._partials:
                # The old buffer goes back to the caching allocator, which reuses it on this stream
                # only after the kernels already queued here.
                self._partials = grown
                self._partial_views.clear()
            views = _partial_views(self._partials, rows, columns, headdim)
            remember(self._partial_views, key, views)
        return views

    def tickets(self, plan, problem, device, capturing=None) -> torch.Tensor | None:
        """The int32 counters a merging split kernel takes tickets from (``Plan.ticket_count``), or
        None. Zero when made; every kernel leaves its counters at zero (the merging program resets
        them), so calls reuse them in stream order and a CUDA graph replays; under capture they are
        counters no other call or graph uses (``CAPTURED_COUNTERS``)."""
        count = plan.ticket_count(problem)
        if count == 0:
            return None
        if stream_capturing(device) if capturing is None else capturing:
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
            remember(self._ticket_views, count, view)
        return view

    def lse(self, problem, device, wanted: bool, capturing=None, total_q: int = 0) -> torch.Tensor:
        """(B, Hq, Sq) float32 for the call's lse ((Hq, total_q) for ragged queries): fresh when
        asked for, else a view of the sink, which nothing reads."""
        shape = (problem.nheads, total_q) if problem.ragged else (problem.batch, problem.nheads, problem.seqlen_q)
        if wanted or (stream_capturing(device) if capturing is None else capturing):
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
            remember(self._sink_views, shape, view)
        return view

    def lengths(self, problem, cache_seqlens, device, capturing=None) -> torch.Tensor:
        """cache_seqlens as an int32 (B,) tensor: as given, or made once per value for an int (None:
        the capacity; appended tokens then need an explicit length, see validate)."""
        if isinstance(cache_seqlens, torch.Tensor):
            return cache_seqlens
        value = problem.seqlen_cache if cache_seqlens is None else int(cache_seqlens)
        if stream_capturing(device) if capturing is None else capturing:
            return torch.full((problem.batch,), value, dtype=torch.int32, device=device)
        key = (problem.batch, value)
        tensor = self._uniform_lengths.get(key)
        if tensor is None:
            tensor = torch.full((problem.batch,), value, dtype=torch.int32, device=device)
            remember(self._uniform_lengths, key, tensor)
        return tensor

    def descale(self, problem, descale, device, capturing=None) -> torch.Tensor:
        """An fp8 cache's descale as the float32 (B, Hk) view the kernels read: a tensor expanded, a
        number (None: 1.0) made once per value (``reference.descale_table``'s rule)."""
        if isinstance(descale, torch.Tensor):
            return descale.expand(problem.batch, problem.nheads_k)
        value = 1.0 if descale is None else float(descale)
        if stream_capturing(device) if capturing is None else capturing:
            return torch.full((), value, dtype=torch.float32, device=device).expand(problem.batch, problem.nheads_k)
        tensor = self._descales.get(value)
        if tensor is None:
            tensor = torch.full((), value, dtype=torch.float32, device=device)
            remember(self._descales, value, tensor)
        return tensor.expand(problem.batch, problem.nheads_k)


def _grown(buffer: torch.Tensor | None, need: int, make) -> torch.Tensor:
    """``buffer`` if it holds ``need`` elements, else ``make(size)`` of at least twice its size (a
    workspace's buffers grow geometrically, so a few shapes do not reallocate call after call)."""
    if buffer is not None and buffer.numel() >= need:
        return buffer
    return make(max(need, 2 * buffer.numel()) if buffer is not None else need)


def _partial_views(buffer: torch.Tensor, rows: int, columns: int, headdim: int):
    """part_o and part_lse at the start of ``buffer``; part_lse starts rows * columns * headdim floats
    in (16-byte aligned when headdim is a multiple of 4, as the TileLang kernels need)."""
    body = rows * columns * headdim
    return (buffer.as_strided((rows, columns, headdim), (columns * headdim, headdim, 1)),
            buffer.as_strided((rows, columns), (columns, 1), body))


def _with_index(device: torch.device) -> torch.device:
    """``device`` with its index (a plain "cuda" means the current device)."""
    return device if device.type != "cuda" or device.index is not None else torch.device("cuda", device_index(device))


class CapturedCounters:
    """Zeroed int32 ticket counters for merging split kernels captured in CUDA graphs, per device.

    A captured call needs counters of its own (its graph may replay on any stream), zero at the first
    replay; each kernel leaves them at zero, so every later replay finds them so. Made fresh with
    ``torch.zeros`` under capture, they cost the graph a memset node before the kernel in every replay
    (1.2-1.6 us of GPU time on the H200; ``docs/design.md``, "The schedule"). So the first eager call
    that merges zeroes a buffer of ``size`` counters per device outside any capture
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
        with torch.inference_mode(False):  # never an inference tensor (see ``Workspace.lse``)
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
