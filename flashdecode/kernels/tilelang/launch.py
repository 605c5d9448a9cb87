"""Calling a compiled TileLang kernel with little host time.

A TileLang kernel object is callable (the public path), but each call rebuilds the argument list and
looks the entry function up by name in the tvm-ffi adapter (~8 us a call on the H200 machine's CPU).
The compiled module's entry function takes the same arguments directly, and TVM-FFI still takes the
current stream from torch. That function sits behind the adapter's private
``_get_executable()``, so :func:`fast_entry` checks for every piece it needs and :func:`launcher`
falls back to the public call where TileLang lays it out otherwise.
"""


def fast_entry(kernel):
    """The compiled module's entry function behind ``kernel``, or None where this TileLang does not
    expose it as expected (no adapter, no ``_get_executable``, no ``main`` in the module)."""
    get_executable = getattr(getattr(kernel, "adapter", None), "_get_executable", None)
    if not callable(get_executable):
        return None
    executable = get_executable()
    jit = getattr(executable, "jit", None)
    module = jit() if callable(jit) else executable
    entry = getattr(module, "main", None)
    return entry if callable(entry) else None


def launcher(kernel):
    """What to call to launch ``kernel``: its entry function when :func:`fast_entry` finds it, else
    the kernel object itself (same arguments)."""
    entry = fast_entry(kernel)
    return kernel if entry is None else entry


def is_ffi_function(function) -> bool:
    """Whether ``function`` is a TVM-FFI function, which the compiled host path can call."""
    try:
        import tvm_ffi
    except ImportError:
        return False
    return isinstance(function, tvm_ffi.Function)
