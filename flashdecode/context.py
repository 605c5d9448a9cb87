"""DecodeContext: the state calls reuse, owned by one object instead of module globals.

A context serves calls queued in order on one stream from one host thread: it binds to the first
call's device and CUDA stream, memoizes validation (metadata -> Problem) and routing (Problem ->
backend and Plan) per call metadata (``resolve``), owns a :class:`~flashdecode.workspace.Workspace`
(the device memory its calls reuse, in that stream's order) and the compiled host path's launch
records (``host_path``): a repeat of a call's metadata is launched from C++ without entering the
Python path. Dropping the context frees its memory.

The plain call uses a default context per (host thread, device, stream) (``default_context``);
users who want control (a workspace per model, per layer group) create one and pass it. A context
can also carry a Tuning and a tile config that replace the measured defaults: sweeps vary them
this way, as values, never by reassigning module globals.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from . import compat, hardware, host_path, workspace
from .call import ARGUMENTS, FLAG, NAMES, REQUIRED, SCALAR, TENSOR, Call, define, parameters
from .kernels import base
from .planner import plan as make_plan
from .problem import contiguous_strides
from .validate import (check_call, check_tile_config, check_values, scalar_meta, tensor_meta, tensor_scalars,
                       value_checks_enabled)

#: ``new_call(values)``: the Call of a tuple of the call's arguments (no Python frame, unlike ``Call(*values)``).
new_call = functools.partial(tuple.__new__, Call)
#: Scalar argument types that need no conversion (``validate.tensor_scalars``).
_PLAIN_SCALARS = frozenset((float, int, bool, type(None)))
#: The arguments copied where their last dimension is not contiguous (``contiguous_copies``).
_COPIED = tuple(argument.name for argument in ARGUMENTS if argument.copied)

_RUN = """
def {name}(self, {parameters}):
    return self.run_call(new_call(({arguments},)), self._bind(q.device))
"""


class DecodeContext:
    """The memoized routes, workspace and compiled host path of calls on one device and stream.

    ``tuning`` (a ``hardware.Tuning``) replaces the device profile's thresholds and ``auto`` order;
    ``config`` replaces the chosen backend's tile config for the kernel its plans name.

    ``device`` and ``stream`` (the CUDA stream's handle, 0 off CUDA) are those it is bound to (None
    before the first call); ``workspace`` its device memory; ``host_path`` the compiled host path's
    records (``flashdecode.host_path.HostPath``: ``len()`` records, ``hits``; its ``run`` launches a
    repeat call), or None before the first CUDA call and where it is off (``host_path_off_because``)."""

    def __init__(self, device=None, *, tuning=None, config=None):
        if tuning is not None and not isinstance(tuning, hardware.Tuning):
            raise TypeError(f"tuning must be a flashdecode.hardware.Tuning, got {type(tuning).__name__}")
        if config is not None:
            check_tile_config(config)
        self.device = None if device is None else torch.device(device)
        self.stream = None
        self.tuning = tuning
        self.config = config
        self.workspace = workspace.Workspace()
        self.host_path = None  # made on the first call (``_host_path``); plain attributes: no frame per call
        self._calls: dict = {}  # call metadata -> (Problem, backend, Plan, check index values, copies)
        self._host_tried = False
        self._host_off_because: str | None = None  # why the context has no HostPath (none made, or dropped)

    run = define(_RUN, globals(), "run", qualname="DecodeContext.run", parameters=parameters(positional=NAMES),
                 doc="""\
        The call (``flash_attn_with_kvcache``'s arguments without ``context``, every one positional
        or keyword, in ``call.ARGUMENTS`` order) on this context:
        validate -> route -> launch; returns out (and lse (B, Hq, Sq) when asked for). Binds the
        context to q's device and the current stream on its first call; raises ValueError on
        another device, or on another stream unless that stream is capturing a CUDA graph.""")

    # -- what runs -------------------------------------------------------------------------------
    def resolve(self, call: Call):
        """(Problem, backend, Plan, whether index values are checked on the host, whether the call
        runs on ``contiguous_copies``) of a call: the checks, ``kernels.select`` and
        ``planner.plan``, memoized per call metadata (one dict lookup on a repeat: host time is what
        small calls cost). Raises naming the bad argument."""
        key = _memo_key(call)
        try:
            entry = self._calls.get(key)
        except TypeError:  # an unhashable argument (a list, ...): checked, and rejected, unmemoized
            entry, key = None, None
        if entry is None:
            copies = any(_needs_copy(getattr(call, name)) for name in _COPIED)
            problem = check_call(**{argument.name: _checked_meta(argument, value)
                                    for argument, value in zip(ARGUMENTS, call) if argument.kind != FLAG})
            chosen, plan = self._route(problem, call.backend, int(call.num_splits), call.q.device)
            on_host = [t for t in (call.cache_seqlens, call.cache_batch_idx, call.cache_leftpad, call.block_table,
                                   call.cu_seqlens_q) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            # the reference indexes on the host: its values are always checked (never out of bounds)
            entry = (problem, chosen, plan,
                     bool(on_host) or (chosen.name == "reference" and call.q.device.type != "cpu"), copies)
            if key is not None:
                workspace.remember(self._calls, key, entry)
        return entry

    def _route(self, problem, backend: str, num_splits: int, device: torch.device):
        """(backend object, Plan) for a problem: ``kernels.select`` then ``planner.plan``."""
        profile = hardware.profile_for(device)
        if self.tuning is not None:
            profile = dataclasses.replace(profile, tuning=self.tuning)
        chosen = base.select(backend, problem, device, profile)
        return chosen, make_plan(problem, profile, chosen, num_splits, self.config)

    def _bind(self, device: torch.device) -> bool:
        """Tie the context to the first call's device and CUDA stream: its workspace is reused in
        stream order, so calls from another stream would race on it (except while that stream
        captures a graph, whose buffers are its own). Whether the call is on the bound stream."""
        stream = compat.current_stream_handle(workspace.device_index(device)) if device.type == "cuda" else 0
        if self.device is None:
            self.device = device
        elif self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device
            self.device = torch.device("cuda", workspace.device_index(self.device))
        if self.stream is None:
            self.stream = stream
        if device != self.device:
            raise ValueError(f"context is bound to {self.device}, got q on {device}: use one context per device")
        elif stream != self.stream and not workspace.stream_capturing(device):
            raise ValueError("context is bound to another CUDA stream: use one DecodeContext per stream "
                             "(the plain call keeps one per stream by itself)")
        return stream == self.stream

    # -- the call ----------------------------------------------------------------------------------
    def run_call(self, call: Call, on_bound_stream: bool = True):
        """``run`` of a :class:`~flashdecode.call.Call` on a context already bound to q's device
        (``default_context`` returns it so, on its current stream; ``on_bound_stream`` False: on
        another stream, which is capturing): the compiled host path's record where there is one,
        else the Python path, which then records the call."""
        if not (type(call.softmax_scale) in _PLAIN_SCALARS and type(call.causal) in _PLAIN_SCALARS and
                type(call.softcap) in _PLAIN_SCALARS and type(call.rotary_interleaved) in _PLAIN_SCALARS and
                type(call.num_splits) in _PLAIN_SCALARS):
            # (type membership: 74 ns on the CPU machine, where an isinstance of each took 307)
            call = read_scalars(call)
        q = call.q
        if value_checks_enabled() or not on_bound_stream:
            host = None
        elif self._host_tried:
            host = self.host_path
        else:  # the first call: not under a capture, where building the extension would stall it
            host = None if workspace.stream_capturing(q.device) else self._host_path(q.device)
        if host is not None:
            found = host.run(*call, self.stream)  # a miss while the stream captures (the extension asks the driver)
            if found is not None:
                return found
        device = q.device
        capturing = workspace.stream_capturing(device)  # a graph's buffers are its own (fresh, or CAPTURED_COUNTERS)
        if capturing:
            host = None
        problem, chosen, plan, host_checks, copies = self.resolve(call)
        launched = checked_call(call, problem, chosen, plan, host_checks, copies)
        result = torch.empty_like(launched.q) if call.out is None else call.out
        memory = self.workspace
        lse = memory.lse(problem, device, call.return_softmax_lse, capturing, launched.q.shape[0])
        part_o, part_lse = memory.partials(plan, problem, device, capturing)
        scale = problem.headdim ** -0.5 if call.softmax_scale is None else float(call.softmax_scale)
        arguments = base.LaunchArgs(
            launched.q, launched.k_cache, launched.v_cache,
            memory.lengths(problem, launched.cache_seqlens, device, capturing), result, lse, part_o, part_lse, scale,
            float(call.softcap), launched.k, launched.v, launched.rotary_cos, launched.rotary_sin,
            launched.cache_batch_idx, launched.cache_leftpad, launched.block_table, launched.alibi_slopes,
            memory.tickets(plan, problem, device, capturing),
            *((None, None) if problem.cache_dtype is None else (memory.descale(problem, call.k_descale, device, capturing),
                                                                memory.descale(problem, call.v_descale, device, capturing))),
            launched.sinks, launched.cu_seqlens_q)
        chosen.launch(plan, problem, arguments)
        if arguments.tickets is not None and value_checks_enabled() and not capturing:
            _check_counters_left_at_zero(arguments.tickets)
        if host is not None and not host_checks and not copies:  # a record would replay this call's copies
            self._record(host, call, chosen.host_launches(plan, problem, arguments), result,
                         lse if call.return_softmax_lse else None, lse.shape)
        return (result, lse) if call.return_softmax_lse else result

    # -- the compiled host path --------------------------------------------------------------------
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
            self.host_path = host_path.for_device(device)
            if self.host_path is None:
                self._host_off_because = host_path.unavailable() if device.type == "cuda" else \
                    f"{device.type} is not a CUDA device"
        return self.host_path

    def _record(self, host, call: Call, launches, result, lse, lse_shape) -> None:
        """Give the host path the record of a call the Python path just launched (``lse_shape``: the
        lse a hit allocates when asked for, (B, Hq, Sq) or a ragged call's (Hq, total_q)); the
        context's first record of each kind (TVM-FFI, CUDA launches) is replayed and compared before
        any call uses it (``HostPath.verify``)."""
        if launches is None:
            return
        keyed = (*call, self.stream)
        if host.add(keyed, launches, result, lse, tuple(lse_shape)) and \
                host.needs_verify(launches):
            host.verify(keyed, launches, result, lse)
            if host.off_because is not None:
                self.host_path, self._host_off_because = None, host.off_because


def read_scalars(call: Call) -> Call:
    """The call with its one-element tensor scalars read as numbers (``validate.tensor_scalars``)."""
    return call._replace(**dict(zip(("softmax_scale", "causal", "softcap", "rotary_interleaved", "num_splits"),
                                    tensor_scalars(call.softmax_scale, call.causal, call.softcap,
                                                   call.rotary_interleaved, call.num_splits))))


def _fast_meta(tensor):
    """What a tensor argument's memo key holds: (dtype, device, shape, strides, 16-byte aligned);
    anything else as (type, itself)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype, tensor.device, tensor.shape, tensor.stride(), tensor.data_ptr() % 16 == 0
    return type(tensor), tensor


def _key_expression(argument) -> str:
    """The expression of an argument's part of the memo key: ``_fast_meta`` of a tensor argument
    (None for None), a scalar and its type; where the default is a tuple, a tuple of ints itself,
    anything else its ``scalar_meta``."""
    name = argument.name
    if argument.kind == TENSOR:
        return f"_fast_meta({name})" if argument.default is REQUIRED else f"None if {name} is None else _fast_meta({name})"
    if type(argument.default) is tuple:
        return (f"{name} if type({name}) is tuple and all(type(item) is int for item in {name}) "
                f"else scalar_meta({name})")
    return f"{name}, type({name})"


#: ``_memo_key(call)``: what a call's memo key holds (``resolve``), made from ARGUMENTS unrolled (it
#: runs on every call of the Python path: one expression per argument, no loop).
_memo_key = define("""
def {name}(call):
    {arguments} = call
    return ({key},)
""", globals(), "_memo_key", key=", ".join(_key_expression(argument) for argument in ARGUMENTS if argument.kind != FLAG))


def _checked_meta(argument, value):
    """What ``validate.check_call`` takes of an argument: ``scalar_meta`` of a scalar, ``tensor_meta``
    of a tensor (of its contiguous copy where the call makes one), None for None."""
    if argument.kind == SCALAR:
        return scalar_meta(value)
    if isinstance(value, torch.Tensor):
        return _copied_meta(argument.name, value) if argument.copied else tensor_meta(argument.name, value)
    return None if value is None else scalar_meta(value)


def _needs_copy(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.stride(-1) != 1


def _copied_meta(name, tensor):
    """``tensor_meta`` of the tensor the call runs on: its contiguous copy where it needs one."""
    meta = tensor_meta(name, tensor)
    if _needs_copy(tensor):
        return meta[0], meta[1], meta[2], contiguous_strides(meta[2]), True
    return meta


def contiguous_copies(call: Call) -> Call:
    """As FlashAttention's wrapper does: q, the appended k and v, and the index tensors copied where
    their last dimension is not contiguous (the caches never: they are written in place). Such a
    call takes the Python path every time: the compiled host path cannot make the copies."""
    return call._replace(**{name: getattr(call, name).clone(memory_format=torch.contiguous_format)
                            for name in _COPIED if _needs_copy(getattr(call, name))})


class _DefaultContexts(threading.local):
    """One table per host thread: (device index, stream handle) for CUDA, else (device, 0) ->
    DecodeContext (``default_context``)."""

    def __init__(self):
        self.table: dict = {}


_defaults = _DefaultContexts()
#: Streams per thread whose default contexts are kept; past it the table starts again.
MAX_DEFAULT_CONTEXTS = 16


def checked_call(call: Call, problem, chosen, plan, host_checks: bool, copies: bool) -> Call:
    """The call as launched (``contiguous_copies`` where ``resolve`` said so), its index values
    checked on the host where ``resolve`` or the value checks ask (never on meta tensors, which
    hold none: ``plan_for`` plans such calls without memory)."""
    launched = contiguous_copies(call) if copies else call
    if (host_checks or value_checks_enabled()) and launched.q.device.type != "meta":
        check_values(problem, launched.k_cache, launched.cache_seqlens, launched.cache_batch_idx,
                     launched.cache_leftpad, launched.block_table, force=True,
                     block_ids_from=chosen.block_ids_read_from(plan), cu_seqlens_q=launched.cu_seqlens_q,
                     total_q=launched.q.shape[0])
    return launched


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
