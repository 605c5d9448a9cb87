"""The compiled host path (``flashdecode.host_path``, ``csrc/host_path.cpp``) on the CPU: the
extension builds (with TVM-FFI and without), a record launches its TVM-FFI functions with the new
call's data pointers and the held tensors, a CUDA launch's parameter words are packed as its kinds
say, a call whose metadata differs misses, and a record of aliased call tensors hits only calls
aliased alike; fp8 descales, sinks and ragged queries are patched per call like the other tensors.
A function registered with TVM-FFI stands in for TileLang's kernels; CUDA launches are only packed
here. The GPU tier (``test_gpu_host_path.py``) compares the path with the Python path on real kernels."""
import ctypes.util
import dataclasses
import shutil

import pytest
import torch

from conftest import last_dim_strided
from flashdecode import host_path
from flashdecode.call import POSITION, Call
from flashdecode.kernels.base import FLOAT32, INT8, INT32, INT64, POINTER, CudaLaunch, FfiLaunch

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
        tvm_ffi = pytest.importorskip("tvm_ffi")
        self.module = module
        self.function = tvm_ffi.get_global_func("flashdecode.host_path.record")
        module.recorded_calls()  # start empty

    @property
    def calls(self):
        return self.module.recorded_calls()


def make_call(batch=2, seqlens=None, out=None, return_lse=False, q=None, **extra):
    """A call tuple as ``HostPath.run`` takes it (stream 0); ``extra``: more of the call's arguments."""
    q = torch.randn(batch, 1, 4, 8) if q is None else q
    k_cache, v_cache = torch.randn(batch, 16, 2, 8), torch.randn(batch, 16, 2, 8)
    seqlens = torch.tensor([3] * batch, dtype=torch.int32) if seqlens is None else seqlens
    return (*Call(q, k_cache, v_cache, cache_seqlens=seqlens, return_softmax_lse=return_lse, out=out, **extra), 0)


def test_a_record_launches_with_each_calls_tensors(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = make_call()
    result, workspace = torch.empty_like(first[0]), torch.zeros(64)
    split = FfiLaunch(kernel.function, (first[0], first[1], first[2], first[7], result, workspace, 7, 0.5))
    combine = FfiLaunch(kernel.function, (workspace, result, 3))
    assert path.add(first, [split, combine], result, None, (2, 4, 1))
    assert len(path) == 1
    second = make_call()
    out = path.run(*second)
    assert out.shape == second[0].shape and out.dtype == second[0].dtype
    q, k_cache, v_cache, seqlens = second[0], second[1], second[2], second[7]
    assert kernel.calls == [[q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seqlens.data_ptr(), out.data_ptr(),
                             workspace.data_ptr(), 7, 0.5], [workspace.data_ptr(), out.data_ptr(), 3]]
    assert path.hits == 1


def test_records_are_bounded(module):
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    for batch in range(1, 7):
        call = make_call(batch=batch)
        result = torch.empty_like(call[0])
        assert path.add(call, [FfiLaunch(Kernel(module).function, (result,))], result, None, (batch, 4, 1))
    assert len(path) == 2  # cleared at the fifth


def test_other_metadata_misses(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = make_call()
    result = torch.empty_like(first[0])
    path.add(first, [FfiLaunch(kernel.function, (first[0], result))], result, None, (2, 4, 1))
    assert path.run(*make_call(batch=3)) is None  # other shapes
    assert path.run(*make_call()[:12], True, *make_call()[13:]) is None  # causal
    assert path.run(*make_call(seqlens=5)) is None  # an int where the record had a tensor
    assert path.run(*make_call()[:13], [-1, -1], *make_call()[14:]) is None  # a list: not expressible
    assert kernel.calls == []


def test_a_tensor_where_the_call_takes_a_scalar_gets_no_record(module):
    """The key holds a tensor's metadata, not its value: a one-element tensor for the scale, causal,
    softcap, rotary_interleaved or num_splits is a miss, never a record a call of another value would
    hit (the public call reads such tensors into numbers before the host path: ``validate.tensor_scalars``)."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    for position, value in ((11, torch.tensor(0.5)), (12, torch.tensor(True)), (14, torch.tensor(1.0)),
                            (15, torch.tensor(False)), (17, torch.tensor(2))):
        call = make_call()
        call = call[:position] + (value,) + call[position + 1:]
        result = torch.empty_like(call[0])
        assert not path.add(call, [FfiLaunch(kernel.function, (call[0], result))], result, None, (2, 4, 1))
        assert path.run(*call) is None
    assert len(path) == 0 and kernel.calls == []


def test_out_and_lse_given_or_allocated(module):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = make_call(return_lse=True)
    result, lse = torch.empty_like(first[0]), torch.empty(2, 4, 1)
    assert path.add(first, [FfiLaunch(kernel.function, (result, lse.view(2, 4)))], result, lse, (2, 4, 1))
    out, lse_out = path.run(*make_call(return_lse=True))
    assert lse_out.shape == (2, 4, 1) and lse_out.dtype == torch.float32
    assert kernel.calls == [[out.data_ptr(), lse_out.data_ptr()]]
    given = torch.empty(2, 1, 4, 8)
    path.add(make_call(out=given), [FfiLaunch(kernel.function, (given,))], given, None, (2, 4, 1))
    mine = torch.empty(2, 1, 4, 8)
    assert path.run(*make_call(out=mine)) is mine and kernel.calls == [[mine.data_ptr()]]


def test_a_truthy_return_softmax_lse_gets_the_lse_as_on_the_python_path(module):
    """``return_softmax_lse=1`` returns (out, lse) from a record too (the Python path reads it for its truth)."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = make_call(return_lse=1)
    result, lse = torch.empty_like(first[0]), torch.empty(2, 4, 1)
    assert path.add(first, [FfiLaunch(kernel.function, (result, lse.view(2, 4)))], result, lse, (2, 4, 1))
    out, lse_out = path.run(*make_call(return_lse=1))
    assert kernel.calls == [[out.data_ptr(), lse_out.data_ptr()]]


def test_an_argument_only_the_python_path_takes_is_keyed_as_none_only(module):
    """A layout with one more argument the host path takes only as None (``Argument(host_path=False)``):
    a call passing it gets no record and misses one; with None it hits. A layout whose first argument
    is not a tensor (q) is refused."""
    kernel = Kernel(module)
    keys, out, return_lse = host_path.LAYOUT
    native = module.HostPath(4, False, [*keys, host_path.KEY_NONE_ONLY], out, return_lse)
    run = native.run_function()

    def extended(extra):
        call = make_call()
        return (*call[:-1], extra, call[-1])

    first = extended(None)
    result = torch.empty_like(first[0])
    launch = ("ffi", kernel.function, [first[0], result], [0, host_path.CALL_TENSORS.index("out")])
    assert not native.add(extended(torch.zeros(2)), [launch], [2, 4, 1])
    assert native.add(first, [launch], [2, 4, 1])
    assert run(*extended(torch.zeros(2))) is None and run(*extended(0.5)) is None
    second = extended(None)
    got = run(*second)
    assert kernel.calls == [[second[0].data_ptr(), got.data_ptr()]]
    with pytest.raises(ValueError, match="q must be a tensor"):
        module.HostPath(4, False, [host_path.KEY_SCALAR, *keys[1:]], out, return_lse)


def test_aliased_call_tensors_hit_only_calls_aliased_alike(module):
    """A record made where two call tensors share a data pointer (v_descale is k_descale) launches
    the first's for both: it hits calls whose two share theirs, and misses others, whose own record
    (made by the Python path) then serves both kinds."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)

    def call(aliased):
        made = serving_call(v_descale=(2,))
        if aliased:
            made = made[:POSITION["v_descale"]] + (made[POSITION["k_descale"]],) + made[POSITION["v_descale"] + 1:]
        return made

    def launch(made, result):
        k_descale, v_descale, _ = serving_tensors(made)
        return [FfiLaunch(kernel.function, (result, k_descale, v_descale))]

    first = call(aliased=True)
    result = torch.empty_like(first[0])
    assert path.add(first, launch(first, result), result, None, (2, 4, 1))
    second = call(aliased=True)
    out = path.run(*second)
    descale = second[POSITION["k_descale"]].data_ptr()
    assert kernel.calls == [[out.data_ptr(), descale, descale]]
    separate = call(aliased=False)
    assert path.run(*separate) is None and kernel.calls == []
    assert path.add(separate, launch(separate, result), result, None, (2, 4, 1)) and len(path) == 1
    for made in (call(aliased=False), call(aliased=True)):
        out = path.run(*made)
        k_descale, v_descale, _ = serving_tensors(made)
        assert kernel.calls == [[out.data_ptr(), k_descale.data_ptr(), v_descale.data_ptr()]]


def test_an_output_that_is_an_input_gets_no_record(module):
    """out=q (the kernels write over their query): a replay into scratch outputs, or a record's
    launch through q's slot, would write the caller's tensor; the Python path keeps such calls."""
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    call = make_call()
    call = make_call(out=call[0], q=call[0])
    launches = [FfiLaunch(Kernel(module).function, (call[0], call[0]))]
    assert not path.add(call, launches, call[0], None, (2, 4, 1)) and len(path) == 0


def test_verify_keeps_a_record_that_replays_what_python_wrote(module):
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    call = make_call()
    result = torch.full_like(call[0], 2.0)
    launches = [FfiLaunch(Kernel(module).function, (result, 2.0))]
    path.add(call, launches, result, None, (2, 4, 1))  # fills out with 2
    assert path.needs_verify(launches)
    path.verify(call, launches, result, None)
    assert not path.needs_verify(launches) and path.off_because is None and len(path) == 1
    assert path.needs_verify([CudaLaunch(1, (1, 1, 1), 32, 0, (), ())])  # each kind is checked once
    wrong = torch.full_like(call[0], 5.0)
    path.verify(call, launches, wrong, None)
    assert "other values" in path.off_because and len(path) == 0


def words_of(*values) -> list:
    """Each value as the 8-byte parameter word cuLaunchKernel reads (little-endian, zero-padded)."""
    import struct

    packed = []
    for kind, value in values:
        format_ = {INT32: "<i", INT64: "<q", FLOAT32: "<f", INT8: "<b", POINTER: "<Q"}[kind]
        packed.append(int.from_bytes(struct.pack(format_, value).ljust(8, b"\0"), "little"))
    return packed


def test_a_cuda_launch_packs_each_parameter_as_its_kind(module):
    """(Stand-in functions: the check against the driver's parameter list is off.)"""
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    result, lse, workspace = torch.empty(2, 1, 4, 8), torch.empty(2, 4, 1), torch.zeros(64)
    first = make_call(out=result, return_lse=True)
    split = CudaLaunch(0x1234, (3, 2, 1), 128, 4096,
                       (first[0], first[1], first[7], result, lse, workspace, None, 0.125, -7, 2 ** 40, 1),
                       (POINTER,) * 7 + (FLOAT32, INT32, INT64, INT8))
    combine = CudaLaunch(0x5678, (2, 1, 1), 128, 0, (result, 9), (POINTER, INT32))
    assert path.add(first, [split, combine], result, lse, (2, 4, 1))
    out = torch.empty(2, 1, 4, 8)  # given: the words hold its pointer (an allocated out's is 0 here)
    second = make_call(out=out, return_lse=True)
    q, k_cache, seqlens = second[0], second[1], second[7]
    split_words, combine_words = path.parameter_words(second)
    assert split_words[:3] == words_of((POINTER, q.data_ptr()), (POINTER, k_cache.data_ptr()),
                                       (POINTER, seqlens.data_ptr()))
    assert split_words[3] == out.data_ptr() and split_words[4] == 0  # the lse is allocated per call
    assert split_words[5:] == words_of((POINTER, workspace.data_ptr()), (POINTER, 0), (FLOAT32, 0.125),
                                       (INT32, -7), (INT64, 2 ** 40), (INT8, 1))
    assert combine_words == words_of((POINTER, out.data_ptr()), (INT32, 9))


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine's driver has cuLaunchKernelEx")
def test_a_dependent_launch_gets_no_record_without_the_drivers_launch_kernel_ex(module):
    """A dependent launch needs ``cuLaunchKernelEx``: without a driver that has it the call keeps
    the Python path (Triton's launcher), the same launches without the flag are recorded."""
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    result = torch.empty(2, 1, 4, 8)
    call = make_call(out=result)
    split = CudaLaunch(0x1234, (3, 2, 1), 128, 0, (call[0], result), (POINTER, POINTER))
    combine = CudaLaunch(0x5678, (2, 1, 1), 128, 0, (result, 9), (POINTER, INT32), dependent=True)
    assert not path.add(call, [split, combine], result, None, (2, 4, 1))
    assert path.add(call, [split, dataclasses.replace(combine, dependent=False)], result, None, (2, 4, 1))


@pytest.mark.parametrize("arguments, kinds", [
    ((torch.zeros(4),), (INT32,)),  # a tensor is a pointer
    ((2 ** 31,), (INT32,)),  # does not fit
    ((300,), (INT8,)),
    ((0.5,), (INT64,)),  # a float is FLOAT32
    (("x",), (POINTER,)),
    ((1, 2), (INT32,)),  # one kind per argument
    ((1,), (9,)),  # no such kind
], ids=str)
def test_a_cuda_launch_whose_arguments_do_not_fit_their_kinds_gets_no_record(module, arguments, kinds):
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    call = make_call()
    result = torch.empty_like(call[0])
    assert not path.add(call, [CudaLaunch(1, (1, 1, 1), 32, 0, arguments, kinds)], result, None, (2, 4, 1))
    assert len(path) == 0


@pytest.mark.slow
def test_the_extension_builds_without_tvm_ffi(tmp_path, monkeypatch):
    """Triton-only installs: the library then takes CUDA launches only."""
    monkeypatch.setattr(host_path, "_tvm_ffi_package", lambda: None)
    monkeypatch.setenv("FLASHDECODE_CACHE_DIR", str(tmp_path))
    extension = host_path._Extension()
    module = extension.load()
    assert module is not None, extension.error
    assert not module.TVM_FFI and not hasattr(module, "recorded_calls")
    path = host_path.HostPath(module, real_launches=False)  # stand-in functions
    call = make_call()
    result, workspace = torch.empty_like(call[0]), torch.zeros(8)
    launch = CudaLaunch(1, (1, 1, 1), 32, 0, (workspace, call[0], 3), (POINTER, POINTER, INT32))
    assert path.add(call, [launch], result, None, (2, 4, 1))
    second = make_call()
    assert path.parameter_words(second) == [words_of((POINTER, workspace.data_ptr()), (POINTER, second[0].data_ptr()),
                                                     (INT32, 3))]


def test_a_record_needs_launches_of_one_kind(module):
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    call = make_call()
    result = torch.empty_like(call[0])
    cuda = CudaLaunch(1, (1, 1, 1), 32, 0, (result,), (POINTER,))
    assert not path.add(call, [], result, None, (2, 4, 1))
    if module.TVM_FFI:
        assert not path.add(call, [cuda, FfiLaunch(Kernel(module).function, (result,))], result, None, (2, 4, 1))
    assert len(path) == 0


def stand_in_context(module, monkeypatch, verified=True):
    """A CPU DecodeContext with a HostPath whose records launch a stand-in: the reference backend
    describes its launch as one TVM-FFI call of the recorder (which writes nothing). ``verified``:
    its first record is taken as checked (else the check's replay finds out unwritten)."""
    from flashdecode.context import DecodeContext
    from flashdecode.kernels.reference import ReferenceBackend

    kernel = Kernel(module)
    monkeypatch.setattr(ReferenceBackend, "host_launches", lambda self, plan, problem, args: [
        FfiLaunch(kernel.function, (args.q, args.out))], raising=False)
    context = DecodeContext("cpu")
    context._host_tried, context.host_path = True, host_path.HostPath(module, max_records=4, real_launches=False)
    if verified:
        context.host_path._verified.add("ffi")
    return context


def small_cache():
    return torch.randn(2, 16, 2, 8).half(), torch.randn(2, 16, 2, 8).half()


def test_a_call_run_on_copies_gets_no_record(module, monkeypatch):
    """A call whose q (or k, v, an index tensor) the context copies to make its last dimension
    contiguous takes the Python path every time: a record would launch later calls on the first
    call's copies."""
    from flashdecode.reference import reference_attention

    context = stand_in_context(module, monkeypatch)
    k_cache, v_cache = small_cache()

    def call(q):
        return context.run(q, k_cache, v_cache, cache_seqlens=5, backend="reference")  # no index tensor on the host

    call(torch.randn(2, 1, 4, 8).half())
    assert len(context.host_path) == 1  # a contiguous q: recorded
    strided = [last_dim_strided(q) for q in torch.randn(2, 2, 1, 4, 8).half()]
    outputs = [call(q) for q in strided]
    assert len(context.host_path) == 1 and context.host_path.hits == 0
    for q, out in zip(strided, outputs):  # each call's own q, not the first call's copy
        expected, _ = reference_attention(q, k_cache, v_cache, cache_seqlens=5)
        torch.testing.assert_close(out, expected)


def test_the_plain_call_goes_straight_to_its_default_contexts_record(module, monkeypatch):
    """``flash_attn_with_kvcache`` without a context: the first call records on the default context,
    the second launches from the record (``HostPath.run`` with the context's stream, no frame of the
    context's) into an out of its own."""
    from flashdecode import flash_attn_with_kvcache
    from flashdecode.context import default_context

    q, (k_cache, v_cache) = torch.randn(2, 1, 4, 8).half(), small_cache()
    stand_in = stand_in_context(module, monkeypatch)
    context = default_context(q)
    monkeypatch.setattr(context, "_host_tried", True)
    monkeypatch.setattr(context, "host_path", stand_in.host_path)
    first = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, backend="reference")
    assert len(context.host_path) == 1 and context.host_path.hits == 0
    monkeypatch.setattr(type(context), "run_call", lambda *arguments: pytest.fail("took the Python path"))
    second = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, backend="reference")
    assert context.host_path.hits == 1 and second.shape == first.shape and second.data_ptr() != first.data_ptr()


def test_a_captured_call_adds_no_record(module, monkeypatch):
    """A call made while its stream captures takes the Python path and leaves no record: later eager
    calls would launch into the graph's own buffers."""
    from flashdecode import workspace

    context = stand_in_context(module, monkeypatch)
    monkeypatch.setattr(workspace, "stream_capturing", lambda device: True)
    context.run(torch.randn(2, 1, 4, 8).half(), *small_cache(), cache_seqlens=5, backend="reference")
    assert len(context.host_path) == 0


def test_a_call_off_the_bound_stream_takes_no_record(module, monkeypatch):
    """An explicit context called from another stream (which it allows only while that stream
    captures) neither launches from its records nor adds one."""
    from flashdecode import context as context_module
    from flashdecode import workspace

    context = stand_in_context(module, monkeypatch)
    q, (k_cache, v_cache) = torch.randn(2, 1, 4, 8).half(), small_cache()
    context.run(q, k_cache, v_cache, cache_seqlens=5, backend="reference")
    assert len(context.host_path) == 1
    monkeypatch.setattr(workspace, "stream_capturing", lambda device: True)
    monkeypatch.setattr(context_module.DecodeContext, "_bind", lambda self, device: False)
    context.run(q, k_cache, v_cache, cache_seqlens=5, backend="reference")
    assert context.host_path.hits == 0 and len(context.host_path) == 1


def test_a_failed_check_of_the_first_record_says_why(module, monkeypatch):
    """The first record is replayed and compared with what the Python path wrote: the stand-in
    writes nothing, so the context drops its host path and says why."""
    context = stand_in_context(module, monkeypatch, verified=False)
    context.run(torch.randn(2, 1, 4, 8).half(), *small_cache(), cache_seqlens=5, backend="reference")
    assert context.host_path is None and "replay" in context.host_path_off_because


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA driver answers for the stream")
def test_a_record_misses_where_no_driver_says_the_stream_is_not_capturing(module):
    """With real launches the record's call must be on a stream the driver says is not capturing;
    with no driver to ask, a record misses rather than risk launching into a capture."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4)
    q = make_call()[0]
    assert path.add(make_call(), [FfiLaunch(kernel.function, (q,))], torch.empty_like(q), None, (2, 4, 1))
    assert len(path) == 1 and path.run(*make_call()) is None and path.hits == 0


def test_run_takes_the_calls_arguments_positionally_and_keeps_its_path_alive(module):
    """``HostPath.run`` is the extension's METH_FASTCALL function: the call's arguments and the stream
    as positional arguments (a count of them other than that is a TypeError that says so), usable
    after the HostPath that made it is gone (it holds the native path)."""
    import gc

    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = make_call()
    result = torch.empty_like(first[0])
    assert path.add(first, [FfiLaunch(kernel.function, (first[0], result))], result, None, (2, 4, 1))
    run = path.run
    with pytest.raises(TypeError, match=f"takes {len(first)} arguments .*, got 1"):
        run(make_call())
    del path
    gc.collect()
    second = make_call()
    out = run(*second)
    assert kernel.calls == [[second[0].data_ptr(), out.data_ptr()]]


def serving_call(batch=2, k_descale=(2,), v_descale=(2, 2), sinks=True):
    """An fp8-cache call with fresh descales and sinks (each a shape, a number, or None)."""
    def descale(given):
        return torch.rand(given) + 0.5 if isinstance(given, tuple) else given

    call = make_call(batch, k_descale=descale(k_descale), v_descale=descale(v_descale),
                     sinks=torch.randn(4) if sinks else None)
    fp8 = [tensor.to(torch.float8_e4m3fn) for tensor in call[1:3]]
    return (call[0], *fp8, *call[3:])


def serving_tensors(call) -> list:
    return [call[POSITION[name]] for name in ("k_descale", "v_descale", "sinks")]


def tilelang_launch(kernel, call, result):
    """A launch with the descales and sinks as TileLang's backend passes them: (batch, nheads_k)
    expanded, then flat views and their strides (``flat_descale``), sinks as themselves."""
    from flashdecode.kernels.tilelang.backend import flat_descale

    k_descale, v_descale, sinks = serving_tensors(call)
    batch = call[0].shape[0]
    (k_view, *k_strides), (v_view, *v_strides) = (flat_descale(descale.expand(batch, 2))
                                                  for descale in (k_descale, v_descale))
    return FfiLaunch(kernel.function, (call[0], result, k_view, v_view, *k_strides, *v_strides, sinks))


def test_descales_and_sinks_are_patched_per_call(module):
    """A record of an fp8 call with sinks launches each repeat with its own descales and sinks
    (new values in new tensors of the same metadata), never the first call's."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = serving_call()
    result = torch.empty_like(first[0])
    assert path.add(first, [tilelang_launch(kernel, first, result)], result, None, (2, 4, 1))
    second = serving_call()
    out = path.run(*second)
    k_descale, v_descale, sinks = serving_tensors(second)
    assert kernel.calls == [[second[0].data_ptr(), out.data_ptr(), k_descale.data_ptr(), v_descale.data_ptr(),
                             0, 1, 2, 1, sinks.data_ptr()]]
    assert {tensor.data_ptr() for tensor in serving_tensors(first)}.isdisjoint(
        tensor.data_ptr() for tensor in serving_tensors(second))


def test_a_cuda_launch_gets_each_calls_descales_and_sinks(module):
    """Triton's launch: the (batch, nheads_k) descale views' pointers and strides, the sinks' pointer."""
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    result = torch.empty(2, 1, 4, 8)

    def launch(call):
        k_descale, v_descale, sinks = serving_tensors(call)
        k_view, v_view = k_descale.expand(2, 2), v_descale.expand(2, 2)
        return CudaLaunch(0x1234, (2, 2, 1), 128, 0, (call[0], result, k_view, v_view, sinks,
                                                      *k_view.stride(), *v_view.stride()),
                          (POINTER,) * 5 + (INT32,) * 4)

    first = serving_call()
    first = first[:POSITION["out"]] + (result,) + first[POSITION["out"] + 1:]
    assert path.add(first, [launch(first)], result, None, (2, 4, 1))
    second = serving_call()
    second = second[:POSITION["out"]] + (result,) + second[POSITION["out"] + 1:]
    k_descale, v_descale, sinks = serving_tensors(second)
    assert path.parameter_words(second) == [words_of(
        (POINTER, second[0].data_ptr()), (POINTER, result.data_ptr()), (POINTER, k_descale.data_ptr()),
        (POINTER, v_descale.data_ptr()), (POINTER, sinks.data_ptr()), (INT32, 0), (INT32, 1), (INT32, 2),
        (INT32, 1))]


def with_transposed_v_descale(call):
    index = POSITION["v_descale"]
    return call[:index] + (call[index].t(),) + call[index + 1:]


@pytest.mark.parametrize("other", [
    lambda: serving_call(k_descale=()),  # a () descale: strides of 0 in both dimensions
    lambda: serving_call(k_descale=(2, 2)),
    lambda: serving_call(v_descale=(2,)),
    lambda: with_transposed_v_descale(serving_call()),  # other strides
    lambda: serving_call(k_descale=0.5),  # a number: keyed by value
    lambda: serving_call(sinks=False),
], ids=["k_descale ()", "k_descale (B, Hk)", "v_descale (Hk,)", "v_descale transposed", "k_descale number",
        "no sinks"])
def test_descales_or_sinks_of_other_metadata_miss(module, other):
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    first = serving_call()
    result = torch.empty_like(first[0])
    assert path.add(first, [FfiLaunch(kernel.function, (first[0], result))], result, None, (2, 4, 1))
    assert path.run(*other()) is None and kernel.calls == []
    assert path.run(*serving_call()) is not None


def test_a_launch_argument_elsewhere_in_a_call_tensors_memory_gets_no_record(module):
    """A view of a call tensor that does not start at its data pointer (here the sinks after the
    first) has no slot to be patched from: recorded, it would replay the first call's memory."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)
    call = serving_call()
    result = torch.empty_like(call[0])
    sinks = call[POSITION["sinks"]]
    assert not path.add(call, [FfiLaunch(kernel.function, (call[0], result, sinks[1:]))], result, None, (2, 4, 1))
    assert path.add(call, [FfiLaunch(kernel.function, (call[0], result, sinks))], result, None, (2, 4, 1))


def test_ragged_queries_are_patched_per_call_and_keyed_by_max_seqlen_q(module):
    """cu_seqlens_q is a slot; max_seqlen_q is keyed by value; a hit's lse is the ragged (Hq, total_q)."""
    kernel = Kernel(module)
    path = host_path.HostPath(module, max_records=4, real_launches=False)

    def ragged(rows=(0, 2, 5), longest=3):
        return make_call(q=torch.randn(rows[-1], 4, 8), return_lse=True,
                         cu_seqlens_q=torch.tensor(rows, dtype=torch.int32), max_seqlen_q=longest)

    first = ragged()
    result, lse = torch.empty_like(first[0]), torch.empty(4, 5)
    cu_seqlens_q = POSITION["cu_seqlens_q"]
    launch = FfiLaunch(kernel.function, (first[0], first[cu_seqlens_q], result, lse))
    assert path.add(first, [launch], result, lse, (4, 5))
    second = ragged(rows=(0, 4, 5))
    out, lse_out = path.run(*second)
    assert lse_out.shape == (4, 5) and out.shape == (5, 4, 8)
    assert kernel.calls == [[second[0].data_ptr(), second[cu_seqlens_q].data_ptr(), out.data_ptr(),
                             lse_out.data_ptr()]]
    assert path.run(*ragged(longest=4)) is None and path.run(*ragged(rows=(0, 1, 3, 5))) is None


def test_an_fp8_call_with_sinks_hits_its_record_with_new_tensors_or_the_same_numbers(module, monkeypatch):
    """Through a context: repeats of an fp8 call with descale tensors and sinks hit the record
    with their own tensors; descales given as numbers are keyed by value (the record holds the
    workspace's tensor of that value), so another number is a miss and a record of its own."""
    kernel = Kernel(module)
    context = stand_in_context(module, monkeypatch)
    launched = []

    def host_launches(self, plan, problem, args):
        launched.append((args.k_descale, args.v_descale))
        return [FfiLaunch(kernel.function, (args.q, args.out, args.k_descale, args.v_descale, args.sinks))]

    from flashdecode.kernels.reference import ReferenceBackend
    monkeypatch.setattr(ReferenceBackend, "host_launches", host_launches, raising=False)
    q = torch.randn(2, 1, 4, 8).half()
    k_cache, v_cache = (cache.to(torch.float8_e4m3fn) for cache in small_cache())

    def call(k_descale, v_descale):
        return context.run(q, k_cache, v_cache, cache_seqlens=5, backend="reference", k_descale=k_descale,
                           v_descale=v_descale, sinks=sinks)

    sinks = torch.randn(4)
    call(torch.rand(2) + 0.5, torch.rand(2, 2) + 0.5)
    k_descale, v_descale, sinks = torch.rand(2) + 0.5, torch.rand(2, 2) + 0.5, torch.randn(4)
    out = call(k_descale, v_descale)
    assert context.host_path.hits == 1
    assert kernel.calls == [[q.data_ptr(), out.data_ptr(), k_descale.data_ptr(), v_descale.data_ptr(),
                             sinks.data_ptr()]]
    call(0.5, 2.0)
    held = [tensor.data_ptr() for tensor in launched[-1]]
    assert [float(tensor[0, 0]) for tensor in launched[-1]] == [0.5, 2.0]
    out = call(0.5, 2.0)
    assert context.host_path.hits == 2 and kernel.calls == [[q.data_ptr(), out.data_ptr(), *held, sinks.data_ptr()]]
    call(0.25, 2.0)
    assert context.host_path.hits == 2 and len(context.host_path) == 3
