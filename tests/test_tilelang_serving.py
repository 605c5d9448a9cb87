"""The TileLang kernels' serving extensions (sinks, fp8 caches): what the backend takes, the arguments
it passes, and ``auto``, which keeps such calls on Triton until TileLang is measured with them
(``hardware.TILELANG_AUTO_FEATURES``). No compile and no GPU here: the kernels' builds are in
``test_tilelang_compile.py``, their results against the reference in the ``gpu`` tests of
``test_sinks.py``, ``test_fp8.py`` and ``test_tilelang_compile.py``.
"""
import dataclasses

import pytest

from flashdecode.hardware import PROFILES, TILELANG_AUTO_FEATURES
from flashdecode.kernels.base import auto_choice
from flashdecode.kernels.tilelang.backend import FEATURES, problem_limitation
from flashdecode.problem import Problem

H200 = PROFILES["h200"]
#: Serving extensions TileLang takes and ``auto`` does not give it: (name, Problem fields).
EXTENSIONS = {"sinks": dict(sinks=True)}


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
    assert extension in problem.features() and extension in FEATURES and extension not in TILELANG_AUTO_FEATURES
    assert problem_limitation(problem) is None
    assert auto_choice(problem, H200, can_take(problem)) == "triton"
    assert auto_choice(plain, H200, can_take(plain)) == auto_choice(plain, H200, can_take(problem))


def test_plain_calls_still_reach_tilelang():
    """The rules' feature lists drop only the extensions: a short contiguous call and a long head dim
    256 one still go to TileLang."""
    for problem in (Problem(16, 64, 32, 8, 128, "bfloat16"), Problem(8, 32768, 4, 1, 256, "bfloat16"),
                    Problem(16, 362, 32, 8, 256, "bfloat16", page_size=64, seqlen_q=2, window_right=0)):
        assert auto_choice(problem, H200, can_take(problem)) == "tilelang"
