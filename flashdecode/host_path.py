"""The compiled host path: a repeat call validated, looked up and launched from C++ (``docs/design.md``,
"Host path").

On the H200 machine's host a plain call spent ~23-29 us in Python for 3-20 us of GPU work with
TileLang (~4 us building its memo key, ~4 us allocating out, ~8 us per launch converting a dozen
tensors for TVM-FFI) and 42-113 us with Triton (its launcher's Python per launch).
``csrc/host_path.cpp`` keeps, per :class:`~flashdecode.DecodeContext`, a table from a call's
metadata (every tensor's dtype, device, shape, strides and 16-byte alignment, every scalar, the
stream) to a launch record: TileLang's TVM-FFI entry functions with DLTensor templates, or Triton's
CUDA functions with their parameter words (``cuLaunchKernel``; ``cuLaunchKernelEx`` for a dependent
launch), whose data pointers it patches per call. The first call of a metadata takes the Python
path, which validates, plans, launches and then adds the record; later calls hash their metadata in
C++ and launch from there. The extension knows the call's arguments from their declaration
(``call.ARGUMENTS``), handed to it as :data:`LAYOUT` when a table is made.

The extension is built on first use (about a minute; cached across processes, see ``_build``), with
TVM-FFI where it is installed (else for CUDA launches only), and used only when

* ``FLASHDECODE_HOST_PATH`` is not ``0`` and the build works (``unavailable()`` says why not);
* the backend can describe its launches (``Backend.host_launches``), the call is not being captured
  in a CUDA graph, index values are not checked on the host;
* the context's first record of each kind, replayed into scratch outputs, writes exactly what the
  Python path wrote (else the context keeps the Python path: ``HostPath.off_because``).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import threading

import torch

from .call import ARGUMENTS, POSITION, TENSOR
from .kernels.base import INT8, CudaLaunch

#: How the extension keys each of the call's arguments (its ``ArgumentKey``): a tensor it takes
#: (keyed by metadata, a launch slot), a scalar (keyed by value), or one it takes only as None.
KEY_TENSOR, KEY_SCALAR, KEY_NONE_ONLY = range(3)
#: The call's arguments as the extension's ``Layout`` takes them: a key per argument, then the
#: positions of out and return_softmax_lse.
LAYOUT = ([KEY_NONE_ONLY if not argument.host_path else KEY_TENSOR if argument.kind == TENSOR else KEY_SCALAR
           for argument in ARGUMENTS], POSITION["out"], POSITION["return_softmax_lse"])
#: The call's tensors a launch argument may be, in the extension's slot order; then the lse
#: (the extension's ``LSE_SLOT``).
CALL_TENSORS = tuple(argument.name for argument, key in zip(ARGUMENTS, LAYOUT[0]) if key == KEY_TENSOR)
CONSTANT = -1
#: Records a HostPath holds before it starts again (each distinct call metadata is one).
MAX_RECORDS = 1024
SOURCE = pathlib.Path(__file__).parent / "csrc" / "host_path.cpp"


class _Extension:
    """The built extension module, or why there is none; built once per process, under a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._module = None
        self._error: str | None = None
        self._tried = False

    def load(self, verbose: bool = False):
        """The module, building it if needed; None (``error`` says why) where it cannot be had."""
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                try:
                    self._module = _build(verbose)
                except Exception as error:  # noqa: BLE001 - any build failure means: the Python path
                    self._error = f"the extension did not build ({type(error).__name__}: {str(error)[-300:]})"
                self._tried = True
        return self._module

    @property
    def error(self) -> str | None:
        return self._error


EXTENSION = _Extension()


def unavailable() -> str | None:
    """Why calls cannot take the compiled host path in this process (None: they can). Builds the
    extension on the first call."""
    if os.environ.get("FLASHDECODE_HOST_PATH", "1") == "0":
        return "FLASHDECODE_HOST_PATH=0"
    if EXTENSION.load() is None:
        return EXTENSION.error
    return None


def _build(verbose: bool):
    """Compile ``csrc/host_path.cpp`` against this torch, and TVM-FFI where it is installed (once: the
    library is cached under ``FLASHDECODE_CACHE_DIR``, default ``~/.cache/flashdecode``, keyed by the
    source, Python, torch and whether TVM-FFI is in) and import it. The compiler is called directly
    (``CXX``, default ``c++``): no ninja."""
    import importlib.util
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    if cpp_extension.CUDA_HOME and (pathlib.Path(cpp_extension.CUDA_HOME) / "include" / "cuda.h").is_file():
        includes.append(str(pathlib.Path(cpp_extension.CUDA_HOME) / "include"))  # checks the launch structures
    ffi_defines, ffi_libraries = [], []
    package = _tvm_ffi_package()
    if package is not None:
        includes.append(str(package / "include"))
        dlpack = package / "3rdparty" / "dlpack" / "include"
        if dlpack.is_dir():
            includes.append(str(dlpack))
        ffi_defines = ["-DFLASHDECODE_TVM_FFI"]
        ffi_libraries = [f"-L{package / 'lib'}", "-ltvm_ffi", f"-Wl,-rpath,{package / 'lib'}"]
    flavour = f"{sys.version}{torch.__version__}{bool(ffi_defines)}"
    key = hashlib.sha256(SOURCE.read_bytes() + flavour.encode()).hexdigest()[:12]
    name = f"flashdecode_host_path_{key}"
    cache = pathlib.Path(os.environ.get("FLASHDECODE_CACHE_DIR", pathlib.Path.home() / ".cache" / "flashdecode"))
    library = cache / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not library.exists():
        print("flashdecode: building the compiled host path (once per machine, about a minute)", file=sys.stderr)
        cache.mkdir(parents=True, exist_ok=True)
        defines = [f"-DTORCH_EXTENSION_NAME={name}", *ffi_defines,
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True))}"]
        for field in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):  # torch's pybind11 ABI, as its extensions use
            value = getattr(torch._C, f"_PYBIND11_{field}", None)
            if value:
                defines.append(f'-DPYBIND11_{field}="{value}"')
        libraries = [f"-L{path}" for path in cpp_extension.library_paths()] + [
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl", *ffi_libraries,
            *(f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths())]
        partial = library.with_name(f"{library.name}.{os.getpid()}.partial")
        command = [os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++17", *defines,
                   *(f"-I{path}" for path in includes), str(SOURCE), "-o", str(partial), *libraries]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:3])} ... failed: {done.stderr[-1500:]}")
        os.replace(partial, library)  # atomic: processes building at once each finish whole
    elif verbose:
        print(f"flashdecode: host path from {library}", file=sys.stderr)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if (module.ARGUMENT_KEYS, module.PARAMETER_KINDS) != (KEY_NONE_ONLY + 1, INT8 + 1) \
            or len(CALL_TENSORS) > module.MAX_CALL_SLOTS:
        raise RuntimeError("the extension's slots, argument keys or parameter kinds differ from flashdecode's")
    return module


def _tvm_ffi_package() -> pathlib.Path | None:
    """TVM-FFI's installed package folder, where it has what the TVM-FFI launches need (its
    Function's ``__chandle__``); else None."""
    try:
        import tvm_ffi
    except ImportError:
        return None
    if not (hasattr(tvm_ffi, "Function") and hasattr(tvm_ffi.Function, "__chandle__")):
        return None
    return pathlib.Path(tvm_ffi.__file__).parent


class HostPath:
    """One context's launch records (``csrc/host_path.cpp``).

    ``run(*call, stream)``: out, or (out, lse), from the record of ``call`` (the call's arguments in
    ``call.ARGUMENTS`` order, then the context's stream, positionally); None when there is none. It
    is the extension's own function (METH_FASTCALL: no Python frame, no argument tuple, no pybind11
    dispatch): every eager call takes it. The other methods take ``call`` as one tuple, the stream
    last (``(*call, stream)``)."""

    def __init__(self, module, max_records: int = MAX_RECORDS, real_launches: bool = True):
        """``real_launches``: compare each CUDA launch's parameter words with its function's own list
        where the driver can tell, and miss while the call's stream captures a CUDA graph (off only
        where the functions and streams are stand-ins, in tests)."""
        self._native = module.HostPath(max_records, real_launches, *LAYOUT)
        self._lse_slot = module.LSE_SLOT
        self.run = self._native.run_function()
        self._verified: set[str] = set()  # kinds of launches ("ffi", "cuda") a replay checked
        self.off_because: str | None = None

    def __len__(self) -> int:
        """Records held."""
        return len(self._native)

    @property
    def hits(self) -> int:
        """Calls launched from a record."""
        return self._native.hits

    def add(self, call: tuple, launches: list, result: torch.Tensor, lse: torch.Tensor | None, lse_shape) -> bool:
        """Record ``launches`` (``kernels.base.FfiLaunch`` es or ``CudaLaunch`` es, not both) of ``call``,
        whose out is ``result`` and whose lse (when the caller asked for it) is ``lse``. Each tensor
        argument is matched to the call tensor with its data pointer, a view of it included (an
        expanded descale); it is held by the record where none has it. Where several call tensors
        have it (k_descale is v_descale), it takes the first, and the record hits only calls whose
        tensors share their data pointers alike. No record when it lies in a call tensor's memory at
        another data pointer (a record would read the first call's memory there), nor when out or
        lse shares its data pointer with another call tensor (a replay into scratch outputs would
        write the caller's). Returns whether the record was added."""
        owners: dict[int, list[int]] = {}
        storages: dict[int, tuple] = {}  # slot -> the memory its tensor lies in
        for slot, name in enumerate(CALL_TENSORS):
            tensor = result if name == "out" else call[POSITION[name]]
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                owners.setdefault(tensor.data_ptr(), []).append(slot)
                storages[slot] = _storage_of(tensor)
        if lse is not None:
            owners.setdefault(lse.data_ptr(), []).append(self._lse_slot)
            storages[self._lse_slot] = _storage_of(lse)
        outputs = {CALL_TENSORS.index("out"), self._lse_slot}
        specs, same_slots = [], set()
        for launch in launches:
            slots = []
            for argument in launch.arguments:
                slot = CONSTANT
                if isinstance(argument, torch.Tensor) and argument.numel():
                    found = owners.get(argument.data_ptr(), [])
                    if len(found) > 1 and outputs & set(found):
                        return False  # an output is an input too (out=q)
                    storage = _storage_of(argument)
                    if (storages[found[0]] if found else None) != storage and storage in storages.values():
                        return False  # part of a call tensor at another offset: no slot patches it
                    same_slots.update((found[0], other) for other in found[1:])
                    slot = found[0] if found else CONSTANT
                slots.append(slot)
            if isinstance(launch, CudaLaunch):
                specs.append(("cuda", launch.function, launch.owner, launch.grid, launch.block, launch.shared,
                              list(launch.arguments), slots, list(launch.kinds), launch.dependent))
            else:
                specs.append(("ffi", launch.function, list(launch.arguments), slots))
        return bool(self._native.add(call, specs, list(lse_shape), sorted(same_slots)))

    def needs_verify(self, launches: list) -> bool:
        """Whether no record of this kind of launches (TVM-FFI or CUDA) was verified yet."""
        return _kind(launches) not in self._verified

    def parameter_words(self, call: tuple) -> list:
        """The 8-byte parameter words the record of ``call`` would pass to each CUDA launch,
        with ``call``'s data pointers patched in (an inspection for tests: out, unless the call
        gives it, and lse are allocated per launch, their words here 0)."""
        return self._native.parameter_words(call)

    def verify(self, call: tuple, launches: list, result: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Replay the record of ``call`` (made of ``launches``) into scratch outputs and compare with
        what the Python path wrote (``result``, ``lse``); on any difference the host path stays off
        for this context. Synchronizes the device: done once per kind of launches, for the context's
        first record of that kind."""
        scratch = torch.full_like(result, 7.0)
        scratch_lse = None if lse is None else torch.full_like(lse, 7.0)
        try:
            self._native.replay(call, scratch, scratch_lse)
            same = torch.equal(scratch.nan_to_num(3.0), result.nan_to_num(3.0)) and (
                lse is None or torch.equal(scratch_lse.nan_to_num(3.0), lse.nan_to_num(3.0)))
        except Exception as error:  # noqa: BLE001 - a failing replay means: the Python path
            self.off_because = f"the replay of the first record failed ({type(error).__name__}: {error})"
        else:
            if not same:
                self.off_because = "the replay of the first record wrote other values than the Python path"
        if self.off_because:
            self._native.clear()
        self._verified.add(_kind(launches))


def _storage_of(tensor: torch.Tensor) -> tuple:
    """The memory a tensor lies in: its device and its storage's first address."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def _kind(launches: list) -> str:
    return "cuda" if isinstance(launches[0], CudaLaunch) else "ffi"


def for_device(device: torch.device) -> HostPath | None:
    """A fresh HostPath for a context on ``device``, or None where calls cannot take it."""
    if device.type != "cuda" or unavailable() is not None:
        return None
    return HostPath(EXTENSION.load())
