"""The compiled host path (``flashdecode.host_path``, ``csrc/host_path.cpp``) on the CPU: the
extension builds, a record launches its TVM-FFI functions with the new call's data pointers and
the held tensors, a call whose metadata differs misses, and aliased call tensors get no record.
A Python function wrapped by TVM-FFI stands in for the kernels. The GPU tier (``test_gpu.py``)
compares the path with the Python path on real kernels."""
import shutil

import pytest
import torch

from flashdecode import host_path

tvm_ffi = pytest.importorskip("tvm_ffi")
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension with")


@pytest.fixture(scope="module")
def module():
    loaded = host_path.EXTENSION.load()
    assert loaded is not None, host_path.EXTENSION.error
    return loaded


class Kernel:
    """The extension's recording TVM-FFI function (a tensor recorded as its data pointer)."""

    def __init__(self, module):
        self.module = module
        self.function = tvm_ffi.get_global_func("flashdecode.host_path.record")
        module.recorded_calls()  # start empty

    @property
    def calls(self):
        return self.module.recorded_calls()


def make_call(batch=2, seqlens=None, out=None, return_lse=False):
    q = torch.randn(batch, 1, 4, 8)
    k_cache, v_cache = torch.randn(batch, 16, 2, 8), torch.randn(batch, 16, 2, 8)
    seqlens = torch.tensor([3] * batch, dtype=torch.int32) if seqlens is None else seqlens
    return (q, k_cache, v_cache, None, None, None, None, seqlens, None, None, None, None, False, (-1, -1), 0.0, True,
            None, 0, return_lse, "auto", out, 0)


def test_a_record_launches_with_each_calls_tensors(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4)
    first = make_call()
    result, workspace = torch.empty_like(first[0]), torch.zeros(64)
    assert path.add(first, [(kernel.function, [first[0], first[1], first[2], first[7], result, workspace, 7, 0.5]),
                            (kernel.function, [workspace, result, 3])], result, None, (2, 4, 1))
    assert len(path) == 1
    second = make_call()
    out = path.run(second)
    assert out.shape == second[0].shape and out.dtype == second[0].dtype
    q, k_cache, v_cache, seqlens = second[0], second[1], second[2], second[7]
    assert kernel.calls == [[q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seqlens.data_ptr(), out.data_ptr(),
                             workspace.data_ptr(), 7, 0.5], [workspace.data_ptr(), out.data_ptr(), 3]]
    assert path.hits == 1


def test_records_are_bounded(module):
    path = host_path.HostPath(module, max_records=4)
    for batch in range(1, 7):
        call = make_call(batch=batch)
        result = torch.empty_like(call[0])
        assert path.add(call, [(Kernel(module).function, [result])], result, None, (batch, 4, 1))
    assert len(path) == 2  # cleared at the fifth


def test_other_metadata_misses(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4)
    first = make_call()
    result = torch.empty_like(first[0])
    path.add(first, [(kernel.function, [first[0], result])], result, None, (2, 4, 1))
    assert path.run(make_call(batch=3)) is None  # other shapes
    assert path.run(make_call()[:12] + (True,) + make_call()[13:]) is None  # causal
    assert path.run(make_call(seqlens=5)) is None  # an int where the record had a tensor
    assert path.run(make_call()[:13] + ([-1, -1],) + make_call()[14:]) is None  # a list: not expressible
    assert kernel.calls == []


def test_out_and_lse_given_or_allocated(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4)
    first = make_call(return_lse=True)
    result, lse = torch.empty_like(first[0]), torch.empty(2, 4, 1)
    assert path.add(first, [(kernel.function, [result, lse.view(2, 4)])], result, lse, (2, 4, 1))
    out, lse_out = path.run(make_call(return_lse=True))
    assert lse_out.shape == (2, 4, 1) and lse_out.dtype == torch.float32
    assert kernel.calls == [[out.data_ptr(), lse_out.data_ptr()]]
    given = torch.empty(2, 1, 4, 8)
    path.add(make_call(out=given), [(kernel.function, [given])], given, None, (2, 4, 1))
    mine = torch.empty(2, 1, 4, 8)
    assert path.run(make_call(out=mine)) is mine and kernel.calls == [[mine.data_ptr()]]


def test_aliased_call_tensors_get_no_record(module):
    path = host_path.HostPath(module, max_records=4)
    call = make_call()
    call = (call[0], call[1], call[1]) + call[3:]  # v_cache is k_cache
    result = torch.empty_like(call[0])
    assert not path.add(call, [(Kernel(module).function, [call[1], result])], result, None, (2, 4, 1))
    assert len(path) == 0


def test_verify_keeps_a_record_that_replays_what_python_wrote(module):
    path = host_path.HostPath(module, max_records=4)
    call = make_call()
    result = torch.full_like(call[0], 2.0)
    path.add(call, [(Kernel(module).function, [result, 2.0])], result, None, (2, 4, 1))  # fills out with 2
    path.verify(call, result, None)
    assert path.verified and path.off_because is None and len(path) == 1
    wrong = torch.full_like(call[0], 5.0)
    path.verify(call, wrong, None)
    assert "other values" in path.off_because and len(path) == 0
