"""Compiling the TileLang kernels: prim_func, occupancy and (for the split kernel) the CUDA rewrite.

Nothing is cached here; :class:`~.backend.TileLangBackend` keeps what it builds. TileLang also keeps
compiled kernels on disk, keyed by the kernel, the target, the compile flags and its version, so a
kernel built for {"kind": "cuda", "arch": "sm_90a"} on a machine without the GPU
(``flashdecode warmup``, ``kernels.tilelang.warmup``) loads on the H200.

Warp specialisation stays on: TileLang's other lowering, a cp.async software pipeline, gave wrong
results for these kernels on the H200 (``docs/design.md``, "Measured choices").
"""
import tilelang

from . import kernels, occupancy, patches

#: The Hopper target the kernels are written for (TMA, wgmma, setmaxnreg).
SM90A = {"kind": "cuda", "arch": "sm_90a"}


def device_target(index: int | None = None) -> dict:
    """CUDA device ``index`` (None: the current one) as an explicit TileLang target, e.g.
    {"kind": "cuda", "arch": "sm_90a"}.

    Explicit rather than "auto" so that a kernel built for it on a machine without the GPU has the
    same TileLang cache key as one built on the GPU."""
    import torch
    from tilelang.contrib import nvcc

    return {"kind": "cuda", "arch": f"sm_{nvcc.get_target_arch(torch.cuda.get_device_capability(index))}"}


def _compile(func, target: dict, compile_flags=None):
    return tilelang.compile(func, target=dict(target), execution_backend="tvm_ffi", compile_flags=compile_flags)


def split(shape, config, can_split: bool, profile, target: dict):
    """The compiled split kernel (``kernels.split_kernel``) with its producer loop on one warp."""
    resident = occupancy.resident_programs(shape, config, profile)
    func = kernels.split_kernel(shape, config, can_split, resident, occupancy.register_split(config, resident, profile))
    with patches.cuda_postproc(patches.one_warp_producer, kernels.SPLIT_KERNEL_NAME):
        kernel = _compile(func, target, list(patches.COMPILE_FLAGS))
    if not patches.is_rewritten(kernel.get_kernel_source()):
        raise RuntimeError("the split kernel was built without its one-warp producer loop")
    return kernel


def short_cache(shape, config, profile, target: dict):
    """The compiled short-cache kernel (``kernels.short_cache_kernel``)."""
    return _compile(kernels.short_cache_kernel(shape, config, occupancy.resident_programs(shape, config, profile)),
                    target)


def combine(shape, config, block_n: int, target: dict):
    """The compiled combine kernel (``kernels.combine_kernel``) for a split kernel of ``block_n``."""
    return _compile(kernels.combine_kernel(shape, config, block_n), target)
