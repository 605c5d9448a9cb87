"""Every bad input raises the documented error, naming the argument."""
import pytest
import torch

import flashdecode
from flashdecode import flash_decode_with_kvcache


def good(batch=2, seqlen=16, nheads=8, nheads_k=2, headdim=64, dtype=torch.float16):
    q = torch.randn(batch, 1, nheads, headdim, dtype=dtype)
    k = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype)
    v = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype)
    return q, k, v, torch.full((batch,), seqlen, dtype=torch.int32)


def call(q, k, v, seqlens=None, **kwargs):
    return flash_decode_with_kvcache(q, k, v, seqlens, **kwargs)


BAD_INPUTS = {
    "q not a tensor": (lambda q, k, v, s: call(q.tolist(), k, v, s), TypeError, "q must be a torch.Tensor"),
    "q float32": (lambda q, k, v, s: call(q.float(), k, v, s), TypeError, "q must be float16 or bfloat16"),
    "mixed dtypes": (lambda q, k, v, s: call(q, k.bfloat16(), v, s), TypeError, "k_cache must have q's dtype"),
    "v dtype": (lambda q, k, v, s: call(q, k, v.bfloat16(), s), TypeError, "v_cache must have q's dtype"),
    "q rank": (lambda q, k, v, s: call(q[:, 0], k, v, s), ValueError, "q must have 4 dimensions"),
    "k rank": (lambda q, k, v, s: call(q, k[0], v, s), ValueError, "k_cache must have 4 dimensions"),
    "seqlen_q 2": (lambda q, k, v, s: call(q.expand(2, 2, 8, 64), k, v, s), ValueError, "seqlen_q == 1"),
    "head dim 32": (lambda q, k, v, s: call(q[..., :32], k[..., :32], v[..., :32], s), ValueError, "head dim"),
    "k batch": (lambda q, k, v, s: call(q, k[:1], v[:1], s), ValueError, "k_cache must have shape"),
    "k headdim": (lambda q, k, v, s: call(q, torch.cat([k, k], -1), v, s), ValueError, "k_cache must have shape"),
    "v shape": (lambda q, k, v, s: call(q, k, v[:, :8], s), ValueError, "v_cache must have k_cache's shape"),
    "gqa ratio": (lambda q, k, v, s: call(q[:, :, :7], k, v, s), ValueError, "multiple of k_cache's nheads_k"),
    "k last dim strided": (lambda q, k, v, s: call(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, s),
                           ValueError, "k_cache must be contiguous in its last dimension"),
    "seqlens dtype": (lambda q, k, v, s: call(q, k, v, s.long()), TypeError, "cache_seqlens must be int32"),
    "seqlens shape": (lambda q, k, v, s: call(q, k, v, s[:1]), ValueError, r"cache_seqlens must be a contiguous tensor of shape \(2,\)"),
    "seqlens strided": (lambda q, k, v, s: call(q, k, v, torch.stack([s, s], 1)[:, 0]), ValueError,
                        r"cache_seqlens must be a contiguous tensor"),
    "seqlens type": (lambda q, k, v, s: call(q, k, v, [16, 16]), TypeError, "cache_seqlens must be an int32 tensor"),
    "seqlens above": (lambda q, k, v, s: call(q, k, v, s + 1), ValueError, r"\[0, seqlen_cache=16\], got values in \[17, 17\]"),
    "seqlens below": (lambda q, k, v, s: call(q, k, v, s - 17), ValueError, "cache_seqlens must be in"),
    "seqlens int above": (lambda q, k, v, s: call(q, k, v, 17), ValueError, "cache_seqlens must be in"),
    "num_splits": (lambda q, k, v, s: call(q, k, v, s, num_splits=-1), ValueError, "num_splits must be an int >= 0"),
    "backend": (lambda q, k, v, s: call(q, k, v, s, backend="cuda"), ValueError, "backend must be one of"),
    "scale": (lambda q, k, v, s: call(q, k, v, s, softmax_scale="x"), TypeError, "softmax_scale"),
    "out shape": (lambda q, k, v, s: call(q, k, v, s, out=torch.empty(2, 1, 8, 32, dtype=torch.float16)),
                  ValueError, "out must match q"),
    "batch 0": (lambda q, k, v, s: call(q[:0], k[:0], v[:0], s[:0]), ValueError, "batch >= 1"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises(name):
    make_call, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        make_call(*good())


def test_device_mismatch_named():
    q, k, v, s = good()
    meta_k = k.to("meta")
    with pytest.raises(ValueError, match="k_cache must be on q's device"):
        call(q, meta_k, v, s)
    with pytest.raises(ValueError, match="cache_seqlens must be on q's device"):
        call(q, k, v, s.to("meta"))


def test_seqlens_check_switch(monkeypatch):
    """The host bounds check of device lengths is off by default and can be switched on."""
    import flashdecode.validate as validate

    assert validate._check_seqlens_on_device is False
    flashdecode.set_seqlens_check(True)
    try:
        assert validate._check_seqlens_on_device is True
    finally:
        flashdecode.set_seqlens_check(False)


def test_good_input_accepted_in_every_form():
    q, k, v, s = good()
    expected = call(q, k, v, s)
    for seqlens in (None, 16):
        torch.testing.assert_close(call(q, k, v, seqlens), expected)
    out = torch.empty_like(q)
    assert call(q, k, v, s, out=out) is out


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError)])
def test_softmax_scale_must_be_a_finite_number(scale, error):
    with pytest.raises(error, match="softmax_scale"):
        call(*good(), softmax_scale=scale)


def test_zero_query_heads_rejected():
    q, k, v, s = good()
    with pytest.raises(ValueError, match="nheads"):
        call(q[:, :, :0], k, v, s)


def test_numpy_scalars_accepted():
    import numpy as np

    q, k, v, s = good()
    torch.testing.assert_close(call(q, k, v, s, softmax_scale=np.float32(0.125), num_splits=np.int64(2)),
                               call(q, k, v, s, softmax_scale=0.125))


def test_auto_backend_rule(monkeypatch):
    """'auto' on CUDA without a problem: TileLang where it can run, Triton where TileLang cannot take
    the call, is not installed, or the GPU is not a Hopper; CPU tensors go to the reference."""
    from flashdecode import api

    cuda = torch.device("cuda", 0)
    for available, hopper, limit, expected in [
            (True, True, None, "tilelang"), (True, True, "a GQA group of at most 64 (got 128)", "triton"),
            (False, True, None, "triton"), (True, False, None, "triton")]:
        monkeypatch.setattr(api, "tilelang_available", lambda: available)
        monkeypatch.setattr(api, "is_hopper", lambda index: hopper)
        assert api.resolve_backend("auto", cuda, limit) == expected
    assert api.resolve_backend("auto", torch.device("cpu")) == "reference"


@pytest.mark.parametrize("number,expected", [(1, "tilelang"), (6, "tilelang"), (8, "tilelang"), (10, "tilelang"),
                                             (13, "tilelang"), (14, "tilelang"), (7, "triton"), (9, "triton"),
                                             (11, "triton"), (12, "triton")])
def test_auto_takes_triton_for_large_caches(monkeypatch, number, expected):
    """The size rule of 'auto' on the matrix (docs/benchmarks.md, "How auto chooses"): Triton from
    AUTO_TRITON_FROM_BYTES of K/V capacity (cases 7, 9, 11, 12), TileLang below; Triton wherever
    TileLang cannot run, whatever the size."""
    from flashdecode import api
    from flashdecode.cases import CASES_BY_NUMBER
    from flashdecode.planner import Problem

    case = CASES_BY_NUMBER[number]
    problem = Problem(case.batch, case.seqlen_cache, case.nheads, case.nheads_k, 128, "bfloat16")
    monkeypatch.setattr(api, "tilelang_available", lambda: True)
    monkeypatch.setattr(api, "is_hopper", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert api.resolve_backend("auto", cuda, None, problem) == expected
    assert api.resolve_backend("auto", cuda, "a GQA group of at most 64 (got 128)", problem) == "triton"
    assert api.resolve_backend("tilelang", cuda, None, problem) == "tilelang"


def test_tilelang_limitation_names_what_tilelang_needs(monkeypatch):
    """TileLang's kernels are sm_90a-only (TMA, wgmma): naming TileLang for other GPUs, odd groups or
    strided tensors is an error that says what is missing."""
    from flashdecode import api

    q = torch.randn(2, 1, 8, 64)
    k = torch.randn(2, 16, 2, 64)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(api, "tilelang_available", lambda: True)
    monkeypatch.setattr(api, "is_hopper", lambda index: False)
    assert api.resolve_backend("auto", cuda, api.tilelang_limitation((q, k, k), 4)) == "triton"
    with pytest.raises(ValueError, match="backend 'tilelang' needs a Hopper GPU"):
        api.resolve_backend("tilelang", cuda, api.tilelang_limitation((q, k, k), 4))
    monkeypatch.setattr(api, "is_hopper", lambda index: True)
    assert api.tilelang_limitation((q, k, k), 4) is None
    assert api.resolve_backend("tilelang", cuda, None) == "tilelang"
    assert "group of at most 64" in api.tilelang_limitation((q, k, k), 128)
    assert "contiguous" in api.tilelang_limitation((q, k.transpose(1, 2), k), 4)
    with pytest.raises(ValueError, match="backend 'tilelang' needs contiguous"):
        api.resolve_backend("tilelang", cuda, api.tilelang_limitation((q, k.transpose(1, 2), k), 4))
    assert api.resolve_backend("triton", cuda, None) == "triton"


def test_validation_outcome_is_cached_per_metadata_not_per_values():
    """The checks run once per distinct metadata; new values with the same metadata reuse them, and
    different metadata (here a wrong dtype) is checked again, never served from the cache."""
    from flashdecode.validate import _checked_problem, validate

    q, k, v, s = good()
    _checked_problem.cache_clear()
    first, _ = validate(q, k, v, s, None, 0, "auto", None)
    second, _ = validate(torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), s.clone(), None, 0, "auto", None)
    assert first == second and _checked_problem.cache_info().hits == 1
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        validate(q, k.float(), v, s, None, 0, "auto", None)
    with pytest.raises(ValueError, match="cache_seqlens must be in"):  # CPU lengths are read every call
        validate(q, k, v, s.clone().fill_(k.shape[1] + 1), None, 0, "auto", None)


def test_lse_sink_is_shared_and_never_freed():
    """Calls that do not ask for lse share one sink per device; a larger batch gets a larger buffer
    and the old one stays alive (a captured CUDA graph may still write it)."""
    from flashdecode import api

    device = torch.device("cpu")
    small = api._lse_sink(device, 2, 8)
    assert small.shape == (2, 8) and api._lse_sink(device, 2, 8) is small
    assert api._lse_sink(device, 1, 8).data_ptr() == small.data_ptr()
    large = api._lse_sink(device, 64, 8)
    assert large.shape == (64, 8) and large.data_ptr() != small.data_ptr()
    assert any(buffer.data_ptr() == small.data_ptr() for buffer in api._SINK_BUFFERS[device])
    sizes = [buffer.numel() for buffer in api._SINK_BUFFERS[device]]
    assert sizes == sorted(sizes) and sum(sizes) < 4 * sizes[-1]  # the largest is last; total < 4x


def test_lse_sink_from_many_threads():
    """Threads missing the sink at once each get a view of their own shape over a large enough
    buffer, and the largest buffer stays last."""
    import threading

    from flashdecode import api

    device = torch.device("cpu")
    api._LSE_SINKS.clear()
    api._SINK_BUFFERS.pop(device, None)
    results, errors = {}, []

    def take(batch):
        try:
            results[batch] = api._lse_sink(device, batch, 3)
        except Exception as error:  # noqa: BLE001 - collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=take, args=(batch,)) for batch in range(1, 65)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and all(results[batch].shape == (batch, 3) for batch in range(1, 65))
    sizes = [buffer.numel() for buffer in api._SINK_BUFFERS[device]]
    assert sizes == sorted(sizes) and sizes[-1] >= 64 * 3


def test_partials_are_disjoint_aligned_views_of_one_allocation():
    from flashdecode import api

    part_o, part_lse = api._partials(5, 8, 64, torch.device("cpu"))
    assert part_o.shape == (5, 8, 64) and part_o.is_contiguous()
    assert part_lse.shape == (5, 8) and part_lse.is_contiguous()
    assert part_lse.data_ptr() == part_o.data_ptr() + part_o.numel() * 4 and part_lse.data_ptr() % 16 == 0
    part_o.fill_(1.0)
    part_lse.fill_(2.0)
    assert (part_o == 1).all() and (part_lse == 2).all()


def test_eager_workspace_is_reused_per_stream_and_thread_fresh_under_capture(monkeypatch):
    """api._workspace: one buffer per (device, stream, thread) for eager CUDA calls, so a call's
    split kernel never writes partials another thread's queued combine kernel still reads, grown to
    the largest shape asked and cut into views per shape; fresh partials while a graph is captured
    (the graph owns them) and on CPU. CPU tensors stand in for the device's."""
    import threading

    from flashdecode import api

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: streams[-1], raising=False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    real_workspace = api._StreamWorkspace
    monkeypatch.setattr(api, "_StreamWorkspace", lambda device: real_workspace(torch.device("cpu")))
    api._stream_workspace.cache_clear()
    cuda = torch.device("cuda", 0)
    streams = [11]
    first = api._workspace(5, 8, 64, cuda)
    assert api._workspace(5, 8, 64, cuda) is first                    # same stream, thread, shape
    smaller = api._workspace(2, 8, 64, cuda)                          # another shape: same buffer
    assert smaller[0].data_ptr() == first[0].data_ptr() and smaller[0].shape == (2, 8, 64)
    larger = api._workspace(50, 8, 64, cuda)                          # grows: a new buffer
    assert larger[0].shape == (50, 8, 64) and larger[1].data_ptr() == larger[0].data_ptr() + 50 * 8 * 64 * 4
    assert api._workspace(5, 8, 64, cuda)[0].data_ptr() == larger[0].data_ptr()  # views cut again
    streams.append(12)
    assert api._workspace(5, 8, 64, cuda)[0].data_ptr() != larger[0].data_ptr()  # another stream
    streams.append(11)
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(api._workspace(5, 8, 64, cuda)))
    worker.start()
    worker.join()
    assert other_thread[0][0].data_ptr() != larger[0].data_ptr()     # another thread, same stream
    capturing[0] = True
    monkeypatch.setattr(api, "_partials", lambda *shape: object())
    assert api._workspace(5, 8, 64, cuda) is not api._workspace(5, 8, 64, cuda)   # capture: fresh
    assert api._workspace(5, 8, 64, torch.device("cpu")) is not api._workspace(5, 8, 64, torch.device("cpu"))
    api._stream_workspace.cache_clear()
