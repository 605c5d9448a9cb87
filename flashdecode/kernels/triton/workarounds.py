"""Triton compiler faults the backend steers around, each with the versions it was seen on.

Interleaved rotary at a padded head dim of 32 (head dims 17-32) with 4 warps and 64-token KV tiles:
Triton 3.6.0 miscompiles the split kernel on the H200. The row sums of the softmax (``tl.sum``) read
shared memory out of range (compute-sanitizer memcheck: "Out-of-range shared or local address" in
``_sum_combine``, only in the programs of the second row tile), which kills the CUDA context, or
the output is wrong (error 2.4-3.3 against FlashAttention's bound of ~1e-2). The same combos pass
under Triton's interpreter, with non-interleaved rotary, at head dim 64, and with 8 warps or
32-token tiles (``docs/iterations.md``, entry 19). The default config takes 32-token tiles
there; a config given through ``DecodeContext(config=...)`` is used as given, which is how
``tests/test_triton_workarounds.py`` checks on the GPU that the fault is still there.

fp8 V read as 16-bit words (``TritonConfig.fp8_v_words``) in 64-row tiles, whose products Triton
3.6.0 compiles to warp-group MMAs (``wgmma``; 16- and 32-row tiles take ``mma.sync``): at head dims
32 and 64 (the words' products ``m64n16`` and ``m64n32``) the output is wrong (errors 0.41-2.28) or
the kernel reads shared memory out of bounds (compute-sanitizer memcheck: "Invalid __shared__
read of size 1024 bytes" at the words' ``tl.dot``), on an H100; the cast is right, and so were the
grid's combos with words at head dims 80-256 (``docs/iterations.md``, entry 49). The default
config casts in tiles of more than ``FP8_V_WORDS_MAX_BLOCK_M`` rows at every head dim: words were
measured faster on 16-row tiles only.

Neither is fixed in any Triton release we know of, so the steers apply to every version; the GPU
tests fail once the installed Triton compiles a faulting config correctly, and say so.

Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``) stores bfloat16 as its uint16 bit
patterns and ``tl.dot`` multiplies those patterns (values near 1e10; triton-lang/triton#11584,
closed as "not supported yet"), so a bfloat16 call whose products are bfloat16 (a bfloat16
cache) is refused there rather than answered wrongly; fp8 caches take float16 products and run.
It also truncates float32 -> bfloat16 conversions (GPUs round to nearest), so rotary under bfloat16
q, whose rotated q and k the kernels round to q's dtype, is refused there too: 1-ulp-off keys flip
the fp8 rounding of appended keys (an e5m2 cache's lse 0.1 off, 2026-12-07).
``tests/test_triton_workarounds.py`` fails once the installed interpreter multiplies or rounds
bfloat16 right.
"""
from __future__ import annotations

import dataclasses

#: The last Triton release the interleaved-rotary fault was reproduced on (H200, sm_90a).
LAST_SEEN_ON = "3.6.0"
#: The KV tile the interleaved-rotary specialisations take instead.
SAFE_BLOCK_N = 32
#: The last Triton release whose 64-row tiles were seen failing with fp8 V read as words (H100).
FP8_V_WORDS_LAST_SEEN_ON = "3.6.0"
#: The largest row tile the default config lets read fp8 V as words.
FP8_V_WORDS_MAX_BLOCK_M = 32


#: The last Triton release whose interpreter was seen multiplying bfloat16 bit patterns.
INTERPRETER_BF16_LAST_SEEN_ON = "3.9.0"
#: Why the interpreter cannot take a call whose products are bfloat16 (``interpreter_limitation``).
INTERPRETER_BF16 = ("a CUDA device for bfloat16 products: Triton's interpreter multiplies bfloat16 bit patterns "
                    "(triton-lang/triton#11584); use float16 or backend='reference' on CPU tensors")


#: The last Triton release whose interpreter was seen truncating float32 -> bfloat16 conversions.
INTERPRETER_BF16_ROUNDING_LAST_SEEN_ON = "3.9.0"
#: Why the interpreter cannot take rotary under bfloat16 q (``interpreter_limitation``).
INTERPRETER_BF16_ROUNDING = ("a CUDA device for rotary with bfloat16 q: Triton's interpreter truncates float32 -> "
                             "bfloat16 conversions, so rotated q and k come out 1 ulp off; use float16 or "
                             "backend='reference' on CPU tensors")


def interpreter_limitation(problem) -> str | None:
    """Why Triton's interpreter cannot run ``problem`` (module docstring), or None."""
    if problem.dtype != "bfloat16":
        return None
    if problem.cache_dtype is None:
        return INTERPRETER_BF16
    return INTERPRETER_BF16_ROUNDING if problem.rotary_dim > 0 else None


def interleaved_rotary_small_head(problem, head_pad: int, block_n: int, num_warps: int) -> bool:
    """Whether a split-kernel specialisation is one Triton 3.6.0 miscompiles (module docstring)."""
    return (problem.rotary_dim > 0 and problem.rotary_interleaved and head_pad <= 32 and block_n > SAFE_BLOCK_N
            and num_warps == 4)


def steer(problem, config, head_pad: int):
    """``config`` off the faulting specialisations (module docstring), else unchanged."""
    if interleaved_rotary_small_head(problem, head_pad, config.block_n, config.num_warps):
        config = dataclasses.replace(config, block_n=SAFE_BLOCK_N)
    if config.fp8_v_words and config.block_m > FP8_V_WORDS_MAX_BLOCK_M:
        config = dataclasses.replace(config, fp8_v_words=False)
    return config
