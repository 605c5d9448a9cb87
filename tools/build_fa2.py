"""Build FlashAttention 2's forward kernels for the benchmark's ``fa2`` peer: sm_90 only, head dims
64/128/256, fp16 and bf16, the forward and split-KV forward kernels, causal and not.

Two steps, because the GPU machine has no network and the carried tree is small:

  prepare (here):  python tools/build_fa2.py prepare /tmp/fa/flash_attn-2.8.3.tar.gz
      packs from the sdist only what the build reads into .fa2-src.tar.xz (git-excluded, carried;
      about 0.4 MiB, 13 MiB unpacked): the selected kernel files, flash_api.cpp, the FlashAttention
      and CUTLASS headers they include (followed #include by #include), the flash_attn Python
      package's two modules and the license.
  build (GPU machine, one call):  python3 tools/build_fa2.py build
      unpacks .fa2-src.tar.xz and compiles it with torch.utils.cpp_extension (ninja, one job per
      core) into .fa2-build/: flash_attn_2_cuda.so, the flash_attn package and BUILD.json (what was
      built, with which flags). The benchmark imports it from there when FLASHDECODE_FA2_PATH names
      the folder.

flash_api.cpp dispatches every head dim FlashAttention has (HEADDIM_SWITCH in static_switch.h) and
references the backward kernels; the kernels this build leaves out get generated definitions that
raise a Python error naming what is missing, so the module imports normally and a call outside the
build fails loudly instead of crashing the process. Dropout, ALiBi, softcap, sliding windows and
head dims off 64/128/256 are compiled out with FlashAttention's own FLASHATTENTION_DISABLE_*
switches (its calls then raise "This flash attention build does not support ..."): the benchmark's
variants use none of them, and each halves the template instances to compile.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE_ARCHIVE = REPO / ".fa2-src.tar.xz"
ARCHIVE_TOP = "fa2-src"  # the folder the archive holds
BUILD_DIR = REPO / ".fa2-build"
MODULE = "flash_attn_2_cuda"  # the name flash_attn_interface imports

HEADDIMS = (64, 128, 256)
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
#: (file stem prefix, FlashAttention's launcher template) of the kernels built.
KERNELS = (("flash_fwd", "run_mha_fwd_"), ("flash_fwd_split", "run_mha_fwd_splitkv_dispatch"))
BACKWARD = "run_mha_bwd_"
DISABLED = ("DROPOUT", "ALIBI", "SOFTCAP", "LOCAL", "UNEVEN_K")
ARCH = ("-gencode", "arch=compute_90,code=sm_90")
#: setup.py's flags of FlashAttention 2.8.3, minus the architectures.
NVCC_FLAGS = ("-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math")
CXX_FLAGS = ("-O3", "-std=c++17")

API = "csrc/flash_attn/flash_api.cpp"
INCLUDE_DIRS = ("csrc/flash_attn", "csrc/flash_attn/src", "csrc/cutlass/include")
# bert_padding: transformers' flash_attention_2 imports its pad_input and unpad_input (it needs einops)
PYTHON_MODULES = ("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py", "flash_attn/bert_padding.py")
LEGAL = ("LICENSE", "AUTHORS")
_INCLUDE = re.compile(rb'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def kernel_sources() -> list[str]:
    """The sdist's kernel files this build compiles (24: 3 head dims x 2 dtypes x 2 kernels x causal)."""
    return [f"csrc/flash_attn/src/{stem}_hdim{d}_{dtype}{'_causal' if causal else ''}_sm80.cu"
            for (stem, _), d, dtype, causal in itertools.product(KERNELS, HEADDIMS, DTYPES, (False, True))]


def defines() -> list[str]:
    return [f"-DFLASHATTENTION_DISABLE_{feature}" for feature in DISABLED]


def include_closure(files: dict[str, bytes], roots: list[str]) -> set[str]:
    """``roots`` and every file of ``files`` they include, transitively. A quoted include is looked
    up beside its file, then in INCLUDE_DIRS; an angle include in INCLUDE_DIRS; includes found in
    neither (CUDA, torch, the C++ library) are the build machine's. Every #include counts, whatever
    #if surrounds it: a superset is harmless."""
    seen, pending = set(), list(roots)
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        if path not in files:
            raise FileNotFoundError(f"{path} is not in the FlashAttention sources")
        seen.add(path)
        here = path.rpartition("/")[0]
        for kind, name in _INCLUDE.findall(files[path]):
            name = name.decode()
            candidates = ([f"{here}/{name}"] if kind == b'"' else []) + [f"{d}/{name}" for d in INCLUDE_DIRS]
            found = next((os.path.normpath(c) for c in candidates if os.path.normpath(c) in files), None)
            if found is not None:
                pending.append(found)
    return seen


def read_sdist(path: pathlib.Path) -> dict[str, bytes]:
    """The sdist's files under csrc/flash_attn, csrc/cutlass/include and flash_attn/, and its
    license, by path below the sdist's top folder."""
    wanted = ("csrc/flash_attn/", "csrc/cutlass/include/", "flash_attn/")
    files = {}
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            name = member.name.partition("/")[2]
            if member.isfile() and (name.startswith(wanted) or name in LEGAL):
                files[name] = archive.extractfile(member).read()
    return files


def selected_files(files: dict[str, bytes]) -> list[str]:
    """Everything the build reads, sorted: the kernels, flash_api.cpp, their headers, the Python
    modules, the license."""
    chosen = include_closure(files, [API, *kernel_sources()])
    chosen |= {name for name in (*PYTHON_MODULES, *LEGAL) if name in files}
    missing = [name for name in PYTHON_MODULES if name not in files]
    if missing:
        raise FileNotFoundError(f"the sdist lacks {missing}")
    return sorted(chosen)


def prepare(sdist: pathlib.Path, archive: pathlib.Path) -> list[str]:
    """Pack the files the build reads from ``sdist`` (a .tar.gz) into ``archive`` (.tar.xz, replaced),
    under the folder ARCHIVE_TOP."""
    files = read_sdist(sdist)
    chosen = selected_files(files)
    partial = archive.with_name(archive.name + ".tmp")
    with tarfile.open(partial, "w:xz") as packed:
        for name in chosen:
            member = tarfile.TarInfo(f"{ARCHIVE_TOP}/{name}")
            member.size, member.mode = len(files[name]), 0o644
            packed.addfile(member, io.BytesIO(files[name]))
    partial.replace(archive)
    return chosen


def unpack(archive: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    """Unpack a prepared archive into ``work``; returns the source folder."""
    with tarfile.open(archive) as packed:
        packed.extractall(work, filter="data")
    return work / ARCHIVE_TOP


def switch_headdims(static_switch: str) -> list[int]:
    """Head dims FlashAttention's HEADDIM_SWITCH dispatches (flash_api.cpp references each)."""
    block = static_switch[static_switch.index("#define HEADDIM_SWITCH"):]
    return [int(d) for d in re.findall(r"kHeadDim = (\d+);", block)]


def unbuilt_kernels_source(all_headdims: list[int]) -> str:
    """C++ defining, as a Python error, every launcher flash_api.cpp references but this build does
    not compile: forward kernels of other head dims, and all backward kernels."""
    definitions = []
    for dtype_name, dtype in DTYPES.items():
        for d, causal in itertools.product(all_headdims, ("false", "true")):
            launchers = [BACKWARD] + ([] if d in HEADDIMS else [launcher for _, launcher in KERNELS])
            for launcher in launchers:
                params = "Flash_bwd_params" if launcher == BACKWARD else "Flash_fwd_params"
                what = f"{launcher}<{dtype_name}, head dim {d}, causal={causal}>"
                definitions.append(
                    f"template<> void {launcher}<{dtype}, {d}, {causal}>({params} &, cudaStream_t) {{\n"
                    f'    TORCH_CHECK(false, "this FlashAttention build (tools/build_fa2.py) has no {what}");\n'
                    f"}}")
    return ("// Generated by tools/build_fa2.py: launchers this build leaves out, as errors.\n"
            "#include <c10/util/Exception.h>\n#include <cutlass/numeric_types.h>\n"
            '#include "namespace_config.h"\n#include "flash.h"\n\nnamespace FLASH_NAMESPACE {\n\n'
            + "\n\n".join(definitions) + "\n\n}  // namespace FLASH_NAMESPACE\n")


def flash_attn_version(src: pathlib.Path) -> str:
    text = (src / "flash_attn" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def build(archive: pathlib.Path, out: pathlib.Path, work: pathlib.Path, jobs: int) -> dict:
    """Compile a prepared ``archive`` in ``work`` into ``out`` (replaced); returns what BUILD.json records."""
    import torch
    from torch.utils import cpp_extension

    src = unpack(archive, work)
    stub = work / "unbuilt_kernels.cpp"
    stub.write_text(unbuilt_kernels_source(switch_headdims((src / "csrc/flash_attn/src/static_switch.h").read_text())))
    os.environ["MAX_JOBS"] = str(jobs)
    cuda_flags = [*NVCC_FLAGS, *ARCH, *defines()]
    cxx_flags = [*CXX_FLAGS, *defines()]
    module = cpp_extension.load(
        name=MODULE, sources=[str(src / API), *(str(src / name) for name in kernel_sources()), str(stub)],
        extra_cflags=cxx_flags, extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(src / d) for d in INCLUDE_DIRS], build_directory=str(work), verbose=True)
    if out.exists():
        shutil.rmtree(out)
    (out / "flash_attn").mkdir(parents=True)
    shutil.copy2(module.__file__, out / f"{MODULE}.so")
    for name in PYTHON_MODULES:
        shutil.copy2(src / name, out / name)
    record = {"flash_attn": flash_attn_version(src), "torch": torch.__version__, "cuda": torch.version.cuda,
              "arch": " ".join(ARCH), "headdims": list(HEADDIMS), "dtypes": list(DTYPES),
              "kernels": [stem for stem, _ in KERNELS] + ["causal and not"],
              "disabled": list(DISABLED), "nvcc_flags": cuda_flags, "cxx_flags": cxx_flags}
    (out / "BUILD.json").write_text(json.dumps(record, indent=1) + "\n")
    check = subprocess.run([sys.executable, "-c", "import flash_attn; print(flash_attn.__version__)"],
                           env={**os.environ, "PYTHONPATH": str(out)}, capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"the built package does not import from {out}: {check.stderr}")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    step = steps.add_parser("prepare", help="copy what the build reads from the sdist (here)")
    step.add_argument("sdist", type=pathlib.Path, help="flash_attn-2.8.3.tar.gz")
    step.add_argument("--dest", type=pathlib.Path, default=SOURCE_ARCHIVE)
    step = steps.add_parser("build", help="compile the prepared sources (GPU machine)")
    step.add_argument("--src", type=pathlib.Path, default=SOURCE_ARCHIVE, help="the prepared archive")
    step.add_argument("--out", type=pathlib.Path, default=BUILD_DIR)
    step.add_argument("--work", type=pathlib.Path, default=None, help="build folder (default: a temporary one)")
    step.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs (default: cores)")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        chosen = prepare(args.sdist, args.dest)
        print(f"{args.dest}: {len(chosen)} files, {args.dest.stat().st_size / 2 ** 20:.2f} MiB")
        return 0
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="fa2-build-"))
    record = build(args.src, args.out, work, args.jobs)
    size = (args.out / f"{MODULE}.so").stat().st_size
    print(f"{args.out}: flash_attn {record['flash_attn']}, {MODULE}.so {size / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
