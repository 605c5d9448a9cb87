"""Test setup: without CUDA, Triton kernels run under its interpreter (set before triton is imported)
and ``gpu`` tests are deselected. Tiers: ``python -m pytest`` (fast), ``python -m pytest -m slow``
(interpreter grids and a build of each TileLang kernel kind; CI runs both), ``-m gpu`` (CUDA),
``-m build`` (TileLang's sm_90a builds of every specialisation and feature), ``-m model`` (whole models)."""
import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def shard_of(nodeid: str, count: int) -> int:
    """The shard (of ``count``) a test belongs to: by a hash of its id, the same in every process."""
    return zlib.crc32(nodeid.encode()) % count


def pytest_collection_modifyitems(config, items):
    """Without CUDA, ``gpu``-marked tests are deselected, not skipped: a CPU run reports only the
    skips that say something (each with its reason, ``-rs``). FLASHDECODE_TEST_SHARD=I/N keeps the
    I-th of N shards of the tests (N runs, one shard each, run them all: e.g. a GPU tier longer
    than one device call)."""
    drop = []
    if not HAS_CUDA:
        drop = [item for item in items if item.get_closest_marker("gpu") is not None]
    shard = os.environ.get("FLASHDECODE_TEST_SHARD")
    if shard:
        index, _, count = shard.partition("/")
        if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
            raise pytest.UsageError(f"FLASHDECODE_TEST_SHARD must be I/N with 0 <= I < N, got {shard!r}")
        index, count = int(index), int(count)
        drop += [item for item in items if shard_of(item.nodeid, count) != index]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_terminal_summary(terminalreporter):
    """Print the max relative error per (backend, case) gathered by the GPU tests."""
    try:
        from test_gpu import CASE_ERRORS
    except ImportError:
        return
    if CASE_ERRORS:
        terminalreporter.write_line("max rel L2 error per case (2 seeds):")
        for (backend, case), error in sorted(CASE_ERRORS.items()):
            terminalreporter.write_line(f"  {backend:9s} case {case:2d}: {error:.2e}")


def cli_fails(capsys, argv, message):
    """`flashdecode ARGV` exits 2 with ``message`` on stderr."""
    from flashdecode import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def last_dim_strided(tensor):
    """``tensor``'s values in a view whose last dimension has stride 2 (FlashAttention's wrapper
    copies such q, k, v and index tensors; so does the call)."""
    return torch.stack([tensor, torch.zeros_like(tensor)], -1)[..., 0]


def tiered(values, kept, mark, kept_mark=(), several=False):
    """``values`` as parameters of a grid, each marked ``mark`` unless it is in ``kept`` (marked
    ``kept_mark``). ``several``: each value is a tuple of several arguments."""
    return [pytest.param(*(value if several else (value,)), marks=kept_mark if value in kept else mark)
            for value in values]


def slow_except(values, fast, several=False):
    """The fast tier keeps a representative few (``fast``) of an interpreter grid, ``-m slow`` runs the rest."""
    return tiered(values, fast, pytest.mark.slow, several=several)


def build_except(values, slow, several=False):
    """A TileLang build grid: ``-m build`` (tens of seconds to two minutes a kernel on 2 cores: outside
    CI) but for ``slow``, which CI's slow tier keeps."""
    return tiered(values, slow, pytest.mark.build, pytest.mark.slow, several=several)
