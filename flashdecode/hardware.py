"""Hardware profiles: the only place in flashdecode where hardware numbers live.

The planner sizes its grid and tiles from a :class:`HardwareProfile`; the benchmark sizes its
L2 flush from it. ``current()`` reads the CUDA device in use; ``PROFILES`` holds named profiles
so plans can be computed and tested on a machine without that device.

Sources of the named numbers (see docs/hardware.md):
- H100 SXM and H200: NVIDIA datasheets (SMs, shared memory, bandwidth); L2 as PyTorch reports it
  on the H200 this project measures on (60 MiB), 50 MiB for the H100.
- MetaX C500: the vendor's figures as given in this project's brief (104 compute units, wave64,
  64 KiB shared memory per unit, 8 MiB L2, about 1.8 TB/s). Its register file size is not in
  that brief: 64 Ki registers per unit is an assumption (the NVIDIA figure), to be checked.
- Registers: 64 Ki 32-bit registers per SM on Hopper (CUDA programming guide).
"""
from __future__ import annotations

import dataclasses
import functools

KIB = 1024
MIB = 1024 * KIB


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What a schedule needs to know about a device."""

    name: str
    multiprocessors: int  # SMs (NVIDIA) / compute units (MetaX)
    shared_memory_per_multiprocessor: int  # bytes
    l2_bytes: int
    wave_width: int  # threads per warp / wavefront
    registers_per_multiprocessor: int  # 32-bit registers
    hbm_bandwidth: float  # bytes per second, vendor figure (the benchmark measures its own ceiling)


PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", 132, 228 * KIB, 50 * MIB, 32, 64 * KIB, 3.35e12),
    "h200": HardwareProfile("h200", 132, 228 * KIB, 60 * MIB, 32, 64 * KIB, 4.8e12),
    "c500": HardwareProfile("c500", 104, 64 * KIB, 8 * MIB, 64, 64 * KIB, 1.8e12),
}


def _named_profile_for(device_name: str) -> HardwareProfile | None:
    lowered = device_name.lower()
    for key, profile in PROFILES.items():
        if key in lowered:
            return profile
    return None


@functools.lru_cache(maxsize=None)
def current(device_index: int | None = None) -> HardwareProfile:
    """The profile of a CUDA device, read from the driver.

    Bandwidth cannot be read from the driver; it comes from the named profile whose key appears in
    the device name (e.g. "NVIDIA H200"), and is 0.0 for an unknown device.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("hardware.current() needs a CUDA device; use PROFILES[...] instead")
    index = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(index)
    named = _named_profile_for(props.name)
    return HardwareProfile(
        name=props.name,
        multiprocessors=props.multi_processor_count,
        shared_memory_per_multiprocessor=props.shared_memory_per_multiprocessor,
        l2_bytes=props.L2_cache_size,
        wave_width=props.warp_size,
        registers_per_multiprocessor=getattr(
            props, "regs_per_multiprocessor", (named or PROFILES["h100"]).registers_per_multiprocessor),
        hbm_bandwidth=named.hbm_bandwidth if named else 0.0,
    )


def profile_for(device) -> HardwareProfile:
    """The profile that plans for tensors on ``device``: the real device for CUDA, else the H200's."""
    if getattr(device, "type", device) == "cuda":
        return current(device.index)
    return PROFILES["h200"]
