"""The private or version-dependent parts of torch that flashdecode uses, each behind a feature check
with a public fallback (``docs/design.md``, "Dependencies"). ``tests/test_compat.py`` checks that
every fast path agrees with its fallback, and notices when torch drops one."""
from __future__ import annotations

import torch

#: ``torch._C._cuda_getCurrentRawStream(device_index) -> int``: the current stream's handle in ~0.2 us,
#: where ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object (~1-2 us).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The handle (cudaStream_t as an int) of the current CUDA stream of a device."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def public_stream_handle(device_index: int) -> int:
    """The same through the public API (the fallback, and the tests' comparison)."""
    return torch.cuda.current_stream(device_index).cuda_stream


def has_fast_stream_handle() -> bool:
    return _raw_stream is not None


def _never_compiling() -> bool:
    return False


#: ``is_compiling()``: whether torch.compile is tracing this call (the call then goes through the
#: custom op). ``torch.compiler.is_compiling`` itself (torch >= 2.3), which every eager call asks, with
#: no wrapper around it; older torch has no torch.compile tracing to detect.
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _never_compiling
