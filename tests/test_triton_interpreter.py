"""Triton kernels against the reference, on CPU tensors under TRITON_INTERPRET=1 (CUDA tensors on a GPU).

Triton's interpreter computes bfloat16 wrongly (a known upstream limitation: it has no bf16 numpy
type), so these tests use float16; bfloat16 runs in the GPU tests.

Tolerances: the kernel rounds P to float16 before the PV product and accumulates in float32, so its
relative L2 error against the float32 reference is ~1e-3; we allow 5e-3. A real bug (a block read
twice or skipped, a wrong head mapping, a mask off by one, a bad combine weight) moves the output
by O(1/length) or more of a unit-variance signal, far beyond 5e-3 on these short sequences, and the
LSE by more than its 2e-3 tolerance.
"""

import os

import pytest
import torch

from conftest import HAS_CUDA
from flashdecode import flash_decode_with_kvcache
from flashdecode.api import run_kernels
from flashdecode.hardware import profile_for
from flashdecode.planner import Problem, plan
from flashdecode.reference import reference_decode, relative_error

DEVICE = "cuda" if HAS_CUDA else "cpu"
OUT_TOLERANCE = 5e-3
LSE_TOLERANCE = 2e-3


def random_inputs(batch, seqlen_cache, nheads_k, group, headdim, lengths, dtype=torch.float16, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    q = randn(batch, 1, nheads_k * group, headdim)
    k = randn(batch, seqlen_cache, nheads_k, headdim)
    v = randn(batch, seqlen_cache, nheads_k, headdim)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def check_against_reference(q, k, v, seqlens, num_splits=0):
    out, lse = flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend="triton",
                                         return_softmax_lse=True)
    expected_out, expected_lse = reference_decode(q, k, v, seqlens)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == expected_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    nonempty = seqlens.cpu() > 0
    assert (out[~nonempty] == 0).all() and torch.isneginf(lse[~nonempty]).all()
    if nonempty.any():
        assert relative_error(out[nonempty], expected_out[nonempty]) < OUT_TOLERANCE
        torch.testing.assert_close(lse[nonempty], expected_lse[nonempty], atol=LSE_TOLERANCE, rtol=0)


SHAPES = [  # (batch, seqlen_cache, nheads_k, group, headdim, lengths)
    (1, 1, 1, 1, 64, [1]),
    (2, 65, 2, 4, 64, [65, 63]),
    (3, 100, 1, 8, 128, [0, 100, 37]),
    (2, 40, 1, 32, 64, [40, 17]),
    (1, 33, 2, 4, 256, [33]),
    (4, 130, 2, 4, 128, [129, 1, 64, 0]),
    (2, 0, 1, 4, 64, [0, 0]),  # an empty cache
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-s{}-hk{}-g{}-d{}".format(*s[:5]))
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_matches_reference(shape, num_splits):
    check_against_reference(*random_inputs(*shape), num_splits=num_splits)


def test_many_splits_with_skewed_lengths():
    """A long row among short ones under the planner's own (balanced) split rule."""
    q, k, v, seqlens = random_inputs(5, 600, 1, 4, 64, [600, 3, 64, 65, 0])
    p = plan(Problem(5, 600, 4, 1, 64, "float16"), profile_for(q.device))
    assert p.can_split
    check_against_reference(q, k, v, seqlens)


@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_groups(group):
    check_against_reference(*random_inputs(2, 70, 1, group, 64, [70, 5]), num_splits=2)


def test_out_of_range_length_poisons_its_row_only():
    """Without the host check, a bad length still reads in bounds and marks its row with NaN."""
    q, k, v, _ = random_inputs(3, 20, 1, 4, 64, [0, 0, 0])
    problem = Problem(3, 20, 4, 1, 64, "float16")
    seqlens = torch.tensor([20, 21, -1], dtype=torch.int32, device=DEVICE)
    for num_splits in (0, 2):
        p = plan(problem, profile_for(q.device), num_splits)
        out, _ = run_kernels("triton", p, problem, q, k, v, seqlens, 0.125)
        assert not out[0].isnan().any()
        assert out[1].isnan().all() and out[2].isnan().all()


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_lengths_around_block_boundaries(offset):
    block_n = plan(Problem(3, 200, 4, 1, 64, "float16"), profile_for(torch.device(DEVICE))).block_n
    lengths = [block_n + offset, 2 * block_n + offset, 1]
    check_against_reference(*random_inputs(3, 200, 1, 4, 64, lengths), num_splits=2)


@pytest.mark.parametrize("batch", [1, 2])
def test_combine_over_more_splits_than_one_step(batch):
    """More splits than the combine kernel loads per step (its step depends on the batch): its
    running max must carry over."""
    from flashdecode.kernels.triton.decode import combine_splits_per_step

    block_n = plan(Problem(batch, 64, 4, 1, 64, "float16"), profile_for(torch.device(DEVICE))).block_n
    splits = combine_splits_per_step(batch) + 3
    length = splits * block_n - 5
    lengths = [length] + [length - block_n] * (batch - 1)
    check_against_reference(*random_inputs(batch, length, 1, 4, 64, lengths), num_splits=splits)


@pytest.mark.parametrize("num_splits", [0, 1, 2])
def test_nan_in_the_cache_comes_out_as_nan(num_splits):
    """A NaN inside a row's valid tokens is not mistaken for an empty row, nor weighted away."""
    q, k, v, seqlens = random_inputs(2, 130, 1, 4, 64, [130, 7])
    k[0, 5, 0, 0] = float("nan")
    out = flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend="triton")
    assert out[0].isnan().all()
    assert not out[1].isnan().any()



@pytest.mark.parametrize("num_splits", [0, 3])
def test_out_without_lse_matches_out_with_it(num_splits):
    """Without return_softmax_lse the kernels write lse to a shared sink: out must not change."""
    q, k, v, seqlens = random_inputs(3, 130, 2, 4, 64, [130, 5, 64])
    with_lse, _ = flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend="triton",
                                            return_softmax_lse=True)
    alone = flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend="triton")
    assert torch.equal(with_lse, alone)


def test_specialization_key_is_as_fine_as_tritons():
    """The direct launch path reuses a compiled kernel only for calls Triton would give the same one:
    same dtypes, 16-byte alignment, constexprs and values of the specialised ints; the ints marked
    do_not_specialize (batch, lengths' schedule) may change within their 32-bit type."""
    from flashdecode.kernels.triton import decode

    q = torch.zeros(64, dtype=torch.float16)

    class Kernel:  # signature (Q, K, batch, nheads, B: constexpr)
        arg_names = ["Q", "K", "batch", "nheads", "B"]
        do_not_specialize = ["batch"]

    def key(tensors, scalars, **constexprs):
        return decode._specialization(Kernel, tensors, scalars, constexprs or {"B": 16}, {"num_warps": 4}, 0)

    assert key((q, q), (3, 5)) == key((q, torch.zeros(8, dtype=torch.float16)), (7, 5))  # other batch, tensor
    assert key((q, q), (3, 5)) != key((q, q), (2**31, 5))                                # batch now 64-bit
    assert key((q, q), (3, 5)) != key((q, q[1:]), (3, 5))                                # misaligned by 2 bytes
    assert key((q, q), (3, 5)) != key((q, q.float()), (3, 5))                            # another dtype
    assert key((q, q), (3, 5)) != key((q, q), (3, 6))                                    # a specialised int
    assert key((q, q), (3, 5)) != key((q, q), (3, 5), B=32)                              # a constexpr
    with pytest.raises(TypeError, match="not its last parameters"):                      # passed by position
        key((q, q), (3, 5), C=1)


def test_direct_launch_path(monkeypatch):
    """First call of a specialisation through Triton, later ones through the compiled kernel with a
    3-d grid, the constexprs appended in signature order and the current stream; the interpreter's
    kernels and CPU tensors always go through Triton."""
    from flashdecode.kernels.triton import decode

    calls = []

    class Compiled:
        function = object()

        def __getitem__(self, grid):
            return lambda *args, stream: calls.append(("direct", grid, args, stream))

    class Kernel(decode.JITFunction):  # only what the direct path reads of a JITFunction
        arg_names = ["X", "n", "C"]
        do_not_specialize = []

        def __init__(self):
            pass

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(("triton", grid, args, kwargs)) or Compiled()

    class CudaTensor:  # stands for a CUDA tensor: its device, dtype and address are read
        device = torch.device("cuda", 0)
        dtype = torch.float16

        def data_ptr(self):
            return 256

    monkeypatch.setattr(decode, "_COMPILED", {})
    monkeypatch.setattr(decode, "_SIGNATURES", {})
    monkeypatch.setattr(decode, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    x, kernel = CudaTensor(), Kernel()
    decode._launch_kernel(kernel, (4, 2), (x,), (9,), {"C": 16}, {"num_warps": 4})
    decode._launch_kernel(kernel, (4, 2), (x,), (9,), {"C": 16}, {"num_warps": 4})
    assert calls == [("triton", (4, 2), (x, 9), {"C": 16, "num_warps": 4}), ("direct", (4, 2, 1), (x, 9, 16), 77)]
    calls.clear()
    monkeypatch.setattr(decode, "_DIRECT_LAUNCH", False)  # Triton older than DIRECT_LAUNCH_FROM_TRITON
    decode._launch_kernel(kernel, (4, 2), (x,), (9,), {"C": 16}, {"num_warps": 4})
    assert [c[0] for c in calls] == ["triton"]
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels: Triton's path, CUDA tensors too
        assert not isinstance(decode._split_kernel, decode.JITFunction)
