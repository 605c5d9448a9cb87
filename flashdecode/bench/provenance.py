"""What ran, where: the device, package versions, the code's commit and source digest, the date."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import pathlib
import platform
import subprocess
import sys

import torch
import triton

import flashdecode


def version(distribution: str) -> str | None:
    """Installed version of a distribution, or of an imported module without metadata; else None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(distribution), "__version__", None)


def git_commit() -> str | None:
    """HEAD of the repository flashdecode is imported from, with "-dirty" appended when tracked files
    differ from it (the numbers then belong to uncommitted code); None when not a checkout or no git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=pathlib.Path(flashdecode.__file__).parent,
                              capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if changed.returncode != 0:
        return head.stdout.strip() + "-unknown-state"
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def source_digest() -> str:
    """sha256 (first 12 hex digits) of the package's Python sources, path by path: names the code that
    ran even where git's view of the checkout is stale (the GPU machine's copy of the working tree
    carried an old HEAD, so git_commit read "<old>-dirty"). The same digest of a commit's tree:
    ``git worktree``/``git archive`` it and call this on that copy."""
    return _digest(pathlib.Path(flashdecode.__file__).parent.rglob("*.py"))


def extension_digest() -> str:
    """The same digest of the compiled host path's C++ sources (``csrc/*.cpp``), which
    ``source_digest`` leaves out (its value for earlier trees stays what their runs recorded)."""
    return _digest(pathlib.Path(flashdecode.__file__).parent.joinpath("csrc").glob("*.cpp"))


def _digest(paths) -> str:
    root = pathlib.Path(flashdecode.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def environment(cuda: bool, peer_versions: dict[str, str]) -> dict:
    """The run's device, versions (ours and each peer's), commit, source digests and UTC date."""
    if cuda:
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.machine()}, {platform.processor() or 'unknown'}), Triton interpreter"
    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "tilelang": version("tilelang"), "flashdecode": flashdecode.__version__, **peer_versions}
    return {"device": device, "cuda": cuda, "versions": versions, "git_commit": git_commit(),
            "source_digest": source_digest(), "extension_digest": extension_digest(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
