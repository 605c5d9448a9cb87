"""The Triton faults the backend steers around (``flashdecode.kernels.triton.workarounds``):
the steers on the CPU, and on the GPU that each fault is still there (else its steer can go) and
that the steered default passes. The GPU checks run each call in a subprocess: the fault kills the
CUDA context. Under the interpreter (CPU): bfloat16 products are refused, and a bfloat16 ``tl.dot``
still comes out wrong (else the refusal can go)."""
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import flashdecode
from conftest import HAS_CUDA
from flashdecode.kernels.base import BackendError
from flashdecode.kernels.triton.backend import INTERPRETED, TritonBackend, TritonConfig
from flashdecode.kernels.triton.workarounds import (FP8_V_WORDS_LAST_SEEN_ON, INTERPRETER_BF16_LAST_SEEN_ON,
                                                    INTERPRETER_BF16_ROUNDING_LAST_SEEN_ON,
                                                    LAST_SEEN_ON, SAFE_BLOCK_N)
from flashdecode.hardware import PROFILES
from flashdecode.problem import Problem

#: FlashAttention-grid combos that fail with a raw config on Triton 3.6.0, each with that config:
#: interleaved rotary at head dim 32 (H200), fp8 V read as words in a 64-row tile (H100).
FAULTING = {"rotary": ("float16-q64k800-d32-gqa-splits1-newkv-alibi-causal-neweq-rot0.5i-page256",
                       dict(block_n=64, block_m=64, num_warps=4, num_stages=2, combine_step=16)),
            "fp8-words": ("float16-q64k2048-d64-gqa-splits1-float8e4m3fn",
                          dict(block_n=128, block_m=64, num_warps=4, num_stages=3, combine_step=16, fp8_v_words=True))}
LAST_SEEN = {"rotary": LAST_SEEN_ON, "fp8-words": FP8_V_WORDS_LAST_SEEN_ON}


def problem(headdim, interleaved, rotary_dim=16):
    return Problem(2, 800, 6, 3, headdim, "float16", seqlen_q=64, seqlen_new=64, rotary_dim=rotary_dim,
                   rotary_interleaved=interleaved)


@pytest.mark.parametrize("headdim, interleaved, rotary_dim, block_n", [
    (32, True, 16, SAFE_BLOCK_N), (17, True, 8, SAFE_BLOCK_N),  # steered
    (32, False, 16, 64), (64, True, 32, 128), (32, True, 0, 64)])  # left alone (head dim 64: 128-token tiles)
def test_default_config_steers_only_the_faulting_specialisations(headdim, interleaved, rotary_dim, block_n):
    config = TritonBackend().default_config(problem(headdim, interleaved, rotary_dim), PROFILES["h200"], "split")
    assert config.block_n == block_n


@pytest.mark.parametrize("headdim, group, seqlen_q, words", [
    (64, 4, 8, True),  # 32 query rows: a 32-row tile, mma.sync
    (64, 4, 16, False), (32, 1, 64, False), (128, 8, 16, False)])  # 64-row tiles (wgmma): the cast
def test_default_config_reads_fp8_v_as_words_only_in_tiles_of_at_most_32_rows(headdim, group, seqlen_q, words):
    problem = Problem(2, 2048, 2 * group, 2, headdim, "bfloat16", seqlen_q=seqlen_q, cache_dtype="float8_e4m3fn")
    assert TritonBackend().default_config(problem, PROFILES["h200"], "split").fp8_v_words is words


interpreted = pytest.mark.skipif(HAS_CUDA or not INTERPRETED, reason="Triton's interpreter on CPU tensors")


@triton.jit
def _dot_kernel(A, B, C, N: tl.constexpr):
    rows = tl.arange(0, N)
    tile = rows[:, None] * N + rows[None, :]
    tl.store(C + tile, tl.dot(tl.load(A + tile), tl.load(B + tile)))


@interpreted
def test_the_interpreter_still_multiplies_bfloat16_bit_patterns():
    a, b = (torch.randint(-2, 3, (16, 16)).to(torch.bfloat16) for _ in range(2))
    c = torch.zeros(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    assert not torch.equal(c, a.float() @ b.float()), (
        f"Triton {triton.__version__}'s interpreter now multiplies bfloat16 right (wrong up to "
        f"{INTERPRETER_BF16_LAST_SEEN_ON}): lift INTERPRETER_BF16 in flashdecode/kernels/triton/workarounds.py")


@triton.jit
def _to_bfloat16_kernel(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, tl.load(X + offsets).to(tl.bfloat16))


@interpreted
def test_the_interpreter_still_truncates_to_bfloat16():
    x = torch.full((16,), 1.0 + 2 ** -8 + 2 ** -10)  # halfway-plus: rounds up to 1 + 2^-7
    y = torch.zeros(16, dtype=torch.bfloat16)
    _to_bfloat16_kernel[(1,)](x, y, N=16)
    assert not torch.equal(y, x.bfloat16()), (
        f"Triton {triton.__version__}'s interpreter now rounds float32 -> bfloat16 to nearest (truncated up to "
        f"{INTERPRETER_BF16_ROUNDING_LAST_SEEN_ON}): lift INTERPRETER_BF16_ROUNDING in "
        f"flashdecode/kernels/triton/workarounds.py")


@interpreted
def test_the_interpreter_refuses_rotary_under_bfloat16_q():
    q = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(1, 32, 2, 64).to(torch.float8_e4m3fn)
    k = torch.randn(1, 1, 2, 64, dtype=torch.bfloat16)
    cos, sin = torch.ones(32, 16, dtype=torch.bfloat16), torch.zeros(32, 16, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match=r"rotary with bfloat16 q.*truncates"):
        flashdecode.flash_attn_with_kvcache(q, cache, cache.clone(), k, k, cos, sin,
                                            cache_seqlens=torch.tensor([20], dtype=torch.int32), backend="triton")


@interpreted
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_interpreter_refuses_bfloat16_products_only(cache_dtype):
    q = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(1, 32, 2, 64).to(cache_dtype)
    call = dict(cache_seqlens=torch.tensor([20], dtype=torch.int32), backend="triton")
    if cache_dtype == torch.bfloat16:
        with pytest.raises(BackendError, match=r"bfloat16 products.*triton-lang/triton#11584.*backend 'reference' can"):
            flashdecode.flash_attn_with_kvcache(q, cache, cache, **call)
    else:  # fp8 caches take float16 products
        out = flashdecode.flash_attn_with_kvcache(q, cache, cache, **call)
        want = flashdecode.flash_attn_with_kvcache(q, cache, cache, **{**call, "backend": "reference"})
        assert torch.allclose(out.float(), want.float(), atol=2e-2)


def run_combo(fault: str, raw: bool) -> str:
    result = subprocess.run([sys.executable, __file__, fault, "raw" if raw else "default"], capture_output=True,
                            text=True, timeout=300)
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else f"no output (rc {result.returncode}): {result.stderr[-400:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("fault", FAULTING)
def test_the_miscompile_is_still_there(fault):
    outcome = run_combo(fault, raw=True)
    assert outcome != "OK", (f"the raw {fault} config now compiles correctly (last seen failing on Triton "
                             f"{LAST_SEEN[fault]}): remove its steer in flashdecode/kernels/triton/workarounds.py")
    # the miscompile itself, not a broken test: a wrong output or a CUDA fault
    assert outcome.startswith("WRONG") or outcome.startswith("FAULT") and "CUDA" in outcome, outcome


@pytest.mark.gpu
@pytest.mark.parametrize("fault", FAULTING)
def test_the_steered_default_is_right(fault):
    assert run_combo(fault, raw=False) == "OK"


def _child(fault: str, mode: str) -> None:
    import pathlib

    import torch

    import flashdecode
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import fa_grid

    combo_id, raw = FAULTING[fault]
    combo = fa_grid.Combo.from_id(combo_id)
    context = flashdecode.DecodeContext(config=TritonConfig(**raw)) if mode == "raw" else None

    def call(**arguments):
        return flashdecode.flash_attn_with_kvcache(**arguments, backend="triton", context=context)
    try:
        fa_grid.check_combo(combo, "cuda", call)
        torch.cuda.synchronize()
        print("OK")
    except AssertionError as error:
        print(f"WRONG {str(error).splitlines()[0][:120]}")
    except Exception as error:  # noqa: BLE001 - the fault surfaces as a CUDA error at the next sync
        print(f"FAULT {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}")


if __name__ == "__main__":
    _child(*sys.argv[1:])
