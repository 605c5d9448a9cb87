"""Launching Triton kernels with less host time: the compiled kernel called directly.

``kernel[grid](...)`` (Triton's public path, ``JITFunction.run``) binds and specialises every
argument on every call; on the H200 machine it cost a decode call ~30 us of host time more than
calling the compiled kernel (``CompiledKernel[grid](*args, stream=...)``) with the arguments in
signature order, constexprs included (``docs/design.md``, "Dependencies"). That relies on how Triton
lays out a compiled kernel's arguments, which is not a public contract, so :class:`Launcher` uses it
only when

* at import, Triton's classes have what it calls (``FAST_PATH_UNAVAILABLE`` says what is missing);
* on the first CUDA launch, a probe kernel launched both ways writes the same bytes;
* the kernel is compiled (not the interpreter's), its tensors are on a CUDA device and the
  specialisation was compiled by an earlier call through Triton's path.

It reuses a compiled kernel only for calls with the same ``specialization`` key, at least as fine as
Triton's own: kernel, device, constexprs, options, each tensor's dtype and 16-byte alignment, and
the exact value of every scalar.

``describe`` goes one step further for the compiled host path (``flashdecode.host_path``): a
compiled kernel's CUDA function and parameter words, launched from C++ with ``cuLaunchKernel``
(``cuLaunchKernelEx`` for a dependent launch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import compat
from ..base import FLOAT32, INT8, INT32, INT64, POINTER, CudaLaunch

#: Parameter kinds of Triton's scalar signature types (pointers are "*<type>").
SCALAR_KINDS = {"i1": INT8, "i8": INT8, "i32": INT32, "i64": INT64, "fp32": FLOAT32}
#: Pointer parameters Triton's launcher appends after the kernel's own, by the metadata field that
#: sizes each (a null pointer where the size is 0).
SCRATCH_FIELDS = ("global_scratch_size", "profile_scratch_size")

#: Shared memory a plain launch takes (above it Triton sets an oversized-shared-memory attribute).
MAX_PLAIN_SHARED = 228 * 1024

#: A launch option of flashdecode's, not Triton's: the most registers a thread should use
#: (``TritonConfig.max_registers``), applied only where the compiler's own choice exceeds it.
REGISTER_CEILING = "register_ceiling"

#: Compiled kernels a launcher keeps (each new shape or schedule constant adds one); past it the
#: table starts again.
MAX_COMPILED = 4096


try:  # grid-dependency control, for programmatic dependent launches (``DEPENDENT_LAUNCH_UNAVAILABLE``)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): no CUDA launch at all."""
    return not isinstance(_probe_kernel, triton.runtime.jit.JITFunction)


def _fast_path_unavailable() -> str | None:
    """What the direct launch needs of Triton and this process that is missing, or None."""
    try:
        from triton.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError as error:
        return f"Triton's CompiledKernel or JITFunction does not import ({error})"
    if not callable(getattr(CompiledKernel, "__getitem__", None)):
        return "CompiledKernel has no [grid] launcher"
    if not callable(getattr(JITFunction, "run", None)):
        return "JITFunction has no run()"
    if _interpreted():
        return "kernels are interpreted (TRITON_INTERPRET=1)"
    if not hasattr(_probe_kernel, "arg_names"):
        return "JITFunction has no arg_names"
    return None


@triton.jit(do_not_specialize=["count"])
def _probe_kernel(Out, X, Unused, scale, count, stride, WIDTH: tl.constexpr):
    """Out[p, :] = X[::stride] * scale + count + 1000 p: every kind of argument our kernels pass
    (tensors, a None, a float, an unspecialised and a specialised int, a constexpr)."""
    offs = tl.arange(0, WIDTH)
    pid = tl.program_id(0)
    x = tl.load(X + offs * stride)
    tl.store(Out + pid * WIDTH + offs, x * scale + count + 1000.0 * pid)


def probe_direct_launch(device: torch.device, stream_handle) -> str | None:
    """Launch the probe through Triton's path and directly; None if both wrote the same, else why not."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(32, dtype=torch.float32, device=device)
    public = torch.full((2, 16), -1.0, device=device)
    direct = torch.full((2, 16), -1.0, device=device)
    try:
        compiled = _probe_kernel[(2,)](public, x, None, 0.5, 7, 2, WIDTH=16)
        compiled[(2, 1, 1)](direct, x, None, 0.5, 7, 2, 16, stream=stream_handle(device.index))
        if torch.equal(public, direct):
            return None
        return "the probe kernel launched directly wrote other values than through Triton"
    except Exception as error:  # any failure of a private path means: use the public one
        return f"the probe kernel failed to launch directly ({type(error).__name__}: {error})"


FAST_PATH_UNAVAILABLE = _fast_path_unavailable()


def _dependent_launch_unavailable() -> str | None:
    """What a programmatic dependent launch needs of Triton that is missing, or None: the
    grid-dependency instructions (``gdc_wait``) and the ``launch_pdl`` compile option, on compiled
    kernels (the interpreter runs no inline PTX)."""
    if gdc_wait is None:
        return "Triton has no grid-dependency control (triton.language.extra.cuda.gdc_wait)"
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError as error:
        return f"Triton's CUDA options do not import ({error})"
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return "Triton's CUDA options have no launch_pdl"
    if _interpreted():
        return "kernels are interpreted (TRITON_INTERPRET=1)"
    return None


DEPENDENT_LAUNCH_UNAVAILABLE = _dependent_launch_unavailable()


def specialization(kernel, device_index: int, tensors: tuple, scalars: tuple, constexpr_values: tuple,
                   options: tuple) -> tuple:
    """The key under which a compiled kernel is reused (see the module docstring). None tensors and
    scalars are part of it (Triton compiles them as constexpr None)."""
    alignment = 0
    for tensor in tensors:
        alignment = alignment << 1 | (tensor is not None and tensor.data_ptr() % 16 == 0)
    return (id(kernel), device_index, tuple(None if t is None else t.dtype for t in tensors), alignment, scalars,
            constexpr_values, options)


class Launcher:
    """Launches kernels for one backend instance; owns its compiled-kernel table and the verdict of
    the probe (``fast_path``: None until the first CUDA launch, then whether it is on).

    ``stream_handle(device_index)`` gives the current stream; ``probe(device, stream_handle)`` says
    why the direct path must stay off (None: it may be used); it runs outside CUDA-graph capture
    (``is_capturing()``), since it allocates and synchronizes."""

    def __init__(self, max_compiled: int = MAX_COMPILED, stream_handle=compat.current_stream_handle,
                 probe=probe_direct_launch, unavailable: str | None = FAST_PATH_UNAVAILABLE,
                 is_capturing=torch.cuda.is_current_stream_capturing):
        self.max_compiled = max_compiled
        self._stream_handle = stream_handle
        self._probe = probe
        self._is_capturing = is_capturing
        self.fast_path: bool | None = False if unavailable else None
        self.fast_path_off_because = unavailable
        self._compiled: dict = {}
        self._options: dict = {}  # specialisation -> Triton's options (``register_options``)
        self._checked_signatures: set = set()

    def __len__(self) -> int:
        """Compiled kernels held for the direct path."""
        return len(self._compiled)

    def launch(self, kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict, options: dict) -> None:
        """``kernel[grid](*tensors, *scalars, **constexprs, **options)``: the kernel's parameters are
        its tensors, then its scalars, then its constexprs, in this order; later calls of a
        specialisation go to the compiled kernel directly when the fast path is on. A
        ``REGISTER_CEILING`` option becomes Triton's ``maxnreg`` where the compiler gives the kernel
        more (``register_options``). The first tensor is never None: its device is the launch's."""
        device = tensors[0].device
        if device.type != "cuda":
            kernel[grid](*tensors, *scalars, **constexprs, **_without_ceiling(options))
            return
        fast = self._fast_path_on(device)
        if not fast and REGISTER_CEILING not in options:
            kernel[grid](*tensors, *scalars, **constexprs, **options)
            return
        constexpr_values = tuple(constexprs.values())
        key = specialization(kernel, device.index, tensors, scalars, constexpr_values, tuple(options.items()))
        compiled = self._compiled.get(key) if fast else None
        if compiled is not None:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*tensors, *scalars, *constexpr_values,
                                                            stream=self._stream_handle(device.index))
            return
        triton_options = self._register_options(key, kernel, grid, tensors, scalars, constexprs, options)
        if not fast:
            kernel[grid](*tensors, *scalars, **constexprs, **triton_options)
            return
        self._check_signature(kernel, len(tensors) + len(scalars), tuple(constexprs))
        compiled = kernel[grid](*tensors, *scalars, **constexprs, **triton_options)
        if len(self._compiled) >= self.max_compiled:
            self._compiled.clear()
        self._compiled[key] = compiled

    def _register_options(self, key, kernel, grid, tensors, scalars, constexprs, options) -> dict:
        """Triton's options for a specialisation (memoized): ``register_options`` of ``options``."""
        if REGISTER_CEILING not in options:
            return options
        found = self._options.get(key)
        if found is None:
            if len(self._options) >= self.max_compiled:
                self._options.clear()
            found = self._options[key] = register_options(kernel, grid, tensors, scalars, constexprs, options)
        return found

    def cuda_launch(self, kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict,
                    options: dict) -> CudaLaunch | None:
        """The launch ``launch`` made last with these arguments, as its CUDA function and parameters
        (``describe``), for the compiled host path; None where the fast path is off, the kernel was
        not compiled for them, or q's device is not the current one."""
        device = tensors[0].device
        if not self.fast_path or device.type != "cuda":
            return None
        if device.index is not None and device.index != torch.cuda.current_device():
            return None  # the function belongs to another device's context than the current one
        key = specialization(kernel, device.index, tensors, scalars, tuple(constexprs.values()), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            return None
        return describe(compiled, grid, (*tensors, *scalars, *constexprs.values()))

    def _fast_path_on(self, device: torch.device) -> bool:
        if self.fast_path is None:
            if self._is_capturing():
                return False  # Triton's path for now; the probe waits for a call outside capture
            self.fast_path_off_because = self._probe(device, self._stream_handle)
            self.fast_path = self.fast_path_off_because is None
        return self.fast_path

    def _check_signature(self, kernel, positional: int, constexpr_names: tuple) -> None:
        """The direct path passes constexprs by position: they must be the kernel's last parameters."""
        key = (id(kernel), positional, constexpr_names)
        if key in self._checked_signatures:
            return
        names = tuple(kernel.arg_names)
        if names[positional:] != constexpr_names:
            raise TypeError(f"{getattr(kernel, '__name__', kernel)}: parameters after the first {positional} are "
                            f"{names[positional:]}, expected the constexprs {constexpr_names} in this order")
        self._checked_signatures.add(key)


def _without_ceiling(options: dict) -> dict:
    return {name: value for name, value in options.items() if name != REGISTER_CEILING}


def register_options(kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict, options: dict) -> dict:
    """Triton's options for a launch whose ``options`` carry a ``REGISTER_CEILING``: the others, plus
    ``maxnreg`` = the ceiling where the kernel compiled without it uses more registers a thread. A
    cap always set costs speed where the compiler stays below it anyway; one set where it binds
    keeps the programs per SM the planner counts on (docs/tuning.md). The count is read from a compile
    without a launch (``JITFunction.warmup``) and the compiled kernel's ``n_regs`` (private, loaded
    by ``_init_handles``); where either is missing the ceiling is dropped."""
    plain = _without_ceiling(options)
    ceiling = options[REGISTER_CEILING]
    warmup = getattr(kernel, "warmup", None)
    if ceiling is None or not callable(warmup):
        return plain
    compiled = warmup(*tensors, *scalars, grid=grid, **constexprs, **plain)
    registers = getattr(compiled, "n_regs", None)
    if registers is None and callable(getattr(compiled, "_init_handles", None)):
        compiled._init_handles()
        registers = getattr(compiled, "n_regs", None)
    if not isinstance(registers, int) or registers <= ceiling:
        return plain
    return {**plain, "maxnreg": ceiling}


def describe(compiled, grid: tuple, values: tuple) -> CudaLaunch | None:
    """A compiled kernel's launch with ``values`` (every parameter in signature order, constexprs
    included) as Triton's launcher makes it: the non-constexpr parameters, then a null pointer per
    scratch buffer. Reads Triton's private CompiledKernel fields; None where any is missing or the
    launch needs more than cuLaunchKernel's plain parameters (clusters, cooperative launches,
    scratch memory, tensor descriptors, oversized shared memory); a dependent launch (``launch_pdl``)
    is described as one. Triton's launch hooks (a profiler's) are not called for launches from the
    record. The compiled host path checks the parameter list against the function's own where the
    driver can tell, and replays its first record against Triton's launch (``docs/design.md``,
    "Host path")."""
    try:
        if getattr(compiled, "function", None) is None:
            compiled._init_handles()
        function, metadata, signature = compiled.function, compiled.metadata, compiled.src.signature
        num_warps, shared = int(metadata.num_warps), int(metadata.shared)
    except (AttributeError, TypeError, ValueError):
        return None
    plain = (getattr(metadata, "num_ctas", 1) == 1 and shared <= MAX_PLAIN_SHARED
             and not getattr(metadata, "launch_cooperative_grid", False)
             and not getattr(metadata, "tensordesc_meta", None)
             and not any(getattr(metadata, field, 0) for field in SCRATCH_FIELDS))
    types = list(signature.values()) if isinstance(signature, dict) else []
    if not plain or not isinstance(function, int) or not function or len(types) != len(values):
        return None
    arguments, kinds = [], []
    for kind, value in zip(types, values):
        if kind == "constexpr":
            continue
        if isinstance(kind, str) and kind.startswith("*") and isinstance(value, torch.Tensor):
            kinds.append(POINTER)
        elif kind in SCALAR_KINDS and isinstance(value, (int, float)) and (kind == "fp32") == isinstance(value, float):
            kinds.append(SCALAR_KINDS[kind])
        else:
            return None
        arguments.append(value)
    for field in SCRATCH_FIELDS:
        if hasattr(metadata, field):
            arguments.append(None)
            kinds.append(POINTER)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return CudaLaunch(function, grid, 32 * num_warps, shared, tuple(arguments), tuple(kinds), owner=compiled,
                      dependent=bool(getattr(metadata, "launch_pdl", False)))
