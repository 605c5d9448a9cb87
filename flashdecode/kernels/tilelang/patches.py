"""The rewrite of TileLang's generated CUDA that the split kernel needs: its producer loop on one warp.

TileLang 0.1.15 lowers the split kernel's ``T.Pipelined`` loop (a dynamic trip count) to a
warp-specialised TMA pipeline whose producer loop (wait until a stage is free, then one elected
thread issues its TMA loads) runs on all four warps of the producer warpgroup. Warps 1-3 only watch
the "stage free" mbarriers and nothing waits for them, so one that falls two phases of a barrier
behind sees the parity it waits for again and spins forever: the program never ends and the GPU
hangs. Guarding the loop with ``threadIdx.x < FLASHDECODE_PRODUCER_LOOP_THREADS`` lets warps 1-3
finish at once, as CUTLASS's and FlashAttention-3's producer warps do.

Upstream: no TileLang issue for this exact fault was found (searched the tracker for the
warp-specialised producer loop and mbarrier parity). The closest is tile-ai/tilelang#2566, a hang of
the same warp-specialised TMA pipeline when the loop is statically known to run once (a 1D bulk copy
without its arrive); the split kernel's dynamic trip count takes the multi-dimensional TMA path with
``arrive_and_expect_tx``, which that issue's fault does not reach.

The rewrite is written for TileLang :data:`WRITTEN_FOR` (``unsupported_version`` says when another
is installed) and refuses a source whose layout differs from the one it expects.

TileLang's only way to post-process generated CUDA is a process-wide TVM-FFI global function
(``tilelang_callback_cuda_postproc``); the state that installs and restores it lives here.
"""
import contextlib
import threading

import tilelang
import tvm_ffi

#: The TileLang release whose generated split kernel this rewrite was written against.
WRITTEN_FOR = "0.1.15"
#: Threads of the producer warpgroup that run the TMA loop: its first warp.
PRODUCER_LOOP_THREADS = 32
#: The guard's bound, a ``-D`` compile flag: as a flag it is part of TileLang's cache key, so a kernel
#: built without the rewrite is never loaded from the cache in place of one built with it.
PRODUCER_LOOP_MACRO = "FLASHDECODE_PRODUCER_LOOP_THREADS"
COMPILE_FLAGS = (f"-D{PRODUCER_LOOP_MACRO}={PRODUCER_LOOP_THREADS}",)

_PRODUCER_BRANCH = "if (((int)threadIdx.x) < 128) {"
_PRODUCER_LOOP = "for (int kb = "
_GUARD = f"if (((int)threadIdx.x) < {PRODUCER_LOOP_MACRO}) "
_CUDA_POSTPROC = "tilelang_callback_cuda_postproc"


def unsupported_version(version: str | None = None) -> str | None:
    """Why the installed TileLang (or ``version``) may not take the rewrite, or None."""
    version = tilelang.__version__ if version is None else version
    if version.split("+")[0] != WRITTEN_FOR:
        return f"TileLang {WRITTEN_FOR} (the split kernel's producer-loop rewrite is written for it; got {version})"
    return None


def one_warp_producer(code: str) -> str:
    """The split kernel's CUDA source with its producer loop run by one warp instead of four.

    Raises ValueError unless the source has exactly one producer loop with TMA loads directly
    inside an open ``threadIdx.x < 128`` branch whose ``else`` is the consumer (matrix products):
    another TileLang may lay the kernel out otherwise, and the guard must never land on other code."""
    loop = code.find(_PRODUCER_LOOP)
    branch = code.rfind(_PRODUCER_BRANCH, 0, loop)
    consumer = code.find("} else {", loop)
    if not (loop >= 0 and code.count(_PRODUCER_LOOP) == 1 and branch >= 0 and consumer >= 0
            and _braces_open(code[branch:loop]) == 1 and "tma_load" in code[loop:consumer]
            and ("wgmma" in code[consumer:] or "mma_sync" in code[consumer:])):
        raise ValueError("the split kernel's source does not have the one producer TMA loop expected "
                         f"(TileLang other than {WRITTEN_FOR}?): cannot restrict it to one warp")
    return code[:loop] + _GUARD + code[loop:]


def is_rewritten(code: str) -> bool:
    """Whether a compiled split kernel's source has its producer loop on one warp."""
    return code.count(_GUARD + _PRODUCER_LOOP) == 1


def _braces_open(text: str) -> int:
    """Braces opened and not closed in ``text``; -1 once more have closed than opened, or once the
    first opened block has closed (the code after it is outside)."""
    depth = 0
    for char in text:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth <= 0:
                return -1
    return depth


_lock = threading.RLock()
_installed = {"users": 0, "previous": None}  # guarded by _lock
_thread_rewrites = threading.local()  # .active: this thread's (rewrite, kernel name), innermost last


def _dispatch(code, target):
    """TileLang's CUDA post-processing hook while one of our compiles runs: the hook set before,
    then the rewrite of the compiling thread's innermost ``cuda_postproc`` block, if the source is
    that block's kernel. TileLang calls the hook on the compiling thread, so another thread's compile
    (ours or the user's) only gets the hook set before."""
    previous = _installed["previous"]
    code = previous(code, target) if previous is not None else code
    active = getattr(_thread_rewrites, "active", None)
    if active and active[-1][1] in code:
        code = active[-1][0](code)
    return code


@contextlib.contextmanager
def cuda_postproc(rewrite, kernel_name: str):
    """Within the block, this thread's TileLang compiles of the kernel whose CUDA source names
    ``kernel_name`` are post-processed by ``rewrite`` (after any hook already set); the hook is set
    while any thread is inside such a block and restored after the last leaves (a hook another
    thread registers meanwhile is then replaced by the one from before)."""
    active = getattr(_thread_rewrites, "active", None)
    if active is None:
        active = _thread_rewrites.active = []
    with _lock:
        if _installed["users"] == 0:
            _installed["previous"] = tvm_ffi.get_global_func(_CUDA_POSTPROC, allow_missing=True)
            tvm_ffi.register_global_func(_CUDA_POSTPROC, f=_dispatch, override=True)
        _installed["users"] += 1
    active.append((rewrite, kernel_name))
    try:
        yield
    finally:
        active.pop()
        with _lock:
            _installed["users"] -= 1
            if _installed["users"] == 0:
                previous, _installed["previous"] = _installed["previous"], None
                if previous is not None:
                    tvm_ffi.register_global_func(_CUDA_POSTPROC, f=previous, override=True)
                else:
                    tvm_ffi.remove_global_func(_CUDA_POSTPROC)
