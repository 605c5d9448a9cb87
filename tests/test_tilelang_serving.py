"""The TileLang kernels' serving extensions (sinks, fp8 caches, left pads, heads-first caches): what the
backend takes, the arguments it passes, and ``auto``, which keeps such calls on Triton until TileLang is
measured with them
(``hardware.TILELANG_AUTO_FEATURES``). No compile and no GPU here: the kernels' builds are in
``test_tilelang_compile.py``, their results against the reference in the ``gpu`` tests of
``test_sinks.py``, ``test_fp8.py`` and ``test_tilelang_compile.py``.
"""
import dataclasses

import pytest
import torch

from flashdecode.hardware import PROFILES, TILELANG_AUTO_FEATURES
from flashdecode.kernels.base import auto_choice
from flashdecode.kernels.tilelang import occupancy
from flashdecode.kernels.tilelang.backend import FEATURES, TileLangBackend, flat_descale, problem_limitation
from flashdecode.planner import SHORT_CACHE, SPLIT
from flashdecode.problem import Problem

H200 = PROFILES["h200"]
#: Serving extensions TileLang takes and ``auto`` does not give it: name -> Problem fields.
EXTENSIONS = {"sinks": dict(sinks=True), "fp8": dict(cache_dtype="float8_e4m3fn"),
              "fp8-e5m2+sinks": dict(cache_dtype="float8_e5m2", sinks=True), "leftpad": dict(leftpad=True)}


def can_take(problem):
    """``auto_choice``'s question for a Hopper GPU with both backends installed: TileLang by its
    limitation, Triton always."""
    return lambda name: name == "triton" or (name == "tilelang" and problem_limitation(problem) is None)


#: (batch, capacity, nheads_k, head dim, features): short and long caches at head dims 64, 128 and
#: 256, contiguous, paged, with query rows; the plain call of each goes to TileLang on some.
SHAPES = [(16, 64, 8, 64, {}), (16, 64, 8, 128, {}), (8, 64, 4, 256, {}), (1, 8192, 4, 128, {}),
          (8, 32768, 1, 256, {}), (16, 362, 8, 256, dict(page_size=64)), (16, 64, 8, 128, dict(seqlen_q=4)),
          (4, 2048, 8, 256, dict(seqlen_q=2, window_right=0, seqlen_new=2, page_size=16))]


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_auto_keeps_the_extensions_on_triton(extension, shape):
    """TileLang takes every such call, yet ``auto`` routes it to Triton, where it went before TileLang
    took it; the same call without the extension goes where it went (TileLang for some)."""
    batch, capacity, nheads_k, headdim, features = shape
    plain = Problem(batch, capacity, 4 * nheads_k, nheads_k, headdim, "bfloat16", **features)
    problem = dataclasses.replace(plain, **EXTENSIONS[extension])
    extensions = set(problem.features()) - set(plain.features())
    assert extensions and extensions <= FEATURES and not extensions & set(TILELANG_AUTO_FEATURES)
    assert problem_limitation(problem) is None
    assert auto_choice(problem, H200, can_take(problem)) == "triton"
    assert auto_choice(plain, H200, can_take(plain)) == auto_choice(plain, H200, can_take(problem))


@pytest.mark.parametrize("shape", [shape for shape in SHAPES if "page_size" not in shape[4]], ids=str)
def test_auto_keeps_transformers_caches_on_triton(shape):
    """Heads-first caches (contiguous only), with and without left pads: TileLang takes them when
    named, ``auto`` routes them to Triton."""
    batch, capacity, nheads_k, headdim, features = shape
    for extension in (dict(heads_first=True), dict(heads_first=True, leftpad=True)):
        problem = Problem(batch, capacity, 4 * nheads_k, nheads_k, headdim, "bfloat16", **features, **extension)
        assert problem_limitation(problem) is None and "heads_first" in FEATURES
        assert auto_choice(problem, H200, can_take(problem)) == "triton"


def test_plain_calls_still_reach_tilelang():
    """The rules' feature lists drop only the extensions: a short contiguous call and a long head dim
    256 one still go to TileLang."""
    for problem in (Problem(16, 64, 32, 8, 128, "bfloat16"), Problem(8, 32768, 4, 1, 256, "bfloat16"),
                    Problem(16, 362, 32, 8, 256, "bfloat16", page_size=64, seqlen_q=2, window_right=0)):
        assert auto_choice(problem, H200, can_take(problem)) == "tilelang"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_caches_keep_the_tiles_and_the_residency(head_dim):
    """An fp8 cache keeps the tiles of q's dtype: its pipelined stages take half the bytes and the
    converted K/V pair the other half, so one program's shared memory and the programs per SM stay."""
    backend = TileLangBackend()
    plain = Problem(8, 4096, 32, 8, head_dim, "bfloat16")
    fp8 = dataclasses.replace(plain, cache_dtype="float8_e4m3fn")
    for kernel in (SPLIT, SHORT_CACHE):
        config = backend.default_config(plain, H200, kernel)
        assert backend.default_config(fp8, H200, kernel) == config
        assert backend.resident_programs(fp8, config, H200) == backend.resident_programs(plain, config, H200)
    config = backend.default_config(plain, H200, SPLIT)
    assert occupancy.split_shared_bytes(fp8, config, H200) == occupancy.split_shared_bytes(plain, config, H200)


@pytest.mark.parametrize("given", ["table", "strided table", "head", "scalar"])
def test_flat_descale_reads_every_sequence_and_head(given):
    """The kernels read sequence b's and KV head h's descale at b * stride_b + h * stride_h of one
    contiguous view, which ``flat_descale`` makes of the (batch, nheads_k) view a call passes: a
    table, a column of a wider one, a head's row or a scalar expanded (strides 0), without a copy."""
    batch, heads = 3, 4
    table = torch.arange(1.0, 1 + batch * heads * 2).view(batch, heads * 2)
    view = {"table": table[:, :heads].contiguous(), "strided table": table[:, ::2], "head": table[0, :heads],
            "scalar": table[0, 0]}[given].expand(batch, heads)
    flat, stride_b, stride_h = flat_descale(view)
    assert flat.is_contiguous() and flat.data_ptr() == view.data_ptr()
    read = torch.stack([torch.stack([flat[b * stride_b + h * stride_h] for h in range(heads)]) for b in range(batch)])
    assert torch.equal(read, view)


def test_fp8_split_tiles_stay_within_a_page():
    """Pages smaller than the split kernel's tile: an fp8 cache's tiles are one page each (TileLang
    cannot convert a tile gathered from several), a cache of q's dtype keeps gathering them."""
    backend = TileLangBackend()
    plain = Problem(8, 4096, 32, 8, 128, "bfloat16", page_size=16)
    fp8 = dataclasses.replace(plain, cache_dtype="float8_e4m3fn")
    assert backend.default_config(plain, H200, SPLIT).block_n == 64
    assert backend.default_config(fp8, H200, SPLIT).block_n == 16
    assert backend.default_config(dataclasses.replace(fp8, page_size=256), H200, SPLIT).block_n == 64
