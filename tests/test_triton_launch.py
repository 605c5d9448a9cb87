"""The Triton backend's direct launch (``flashdecode.kernels.triton.launch``): when it is used, what
it passes, and, on a GPU, that it computes exactly what Triton's own launch path computes."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from conftest import HAS_CUDA
from flashdecode import compat, plan_for
from flashdecode.kernels.base import FLOAT32, INT32, INT64, POINTER, CudaLaunch, LaunchArgs
from flashdecode.kernels.triton import launch
from flashdecode.kernels.triton.backend import TritonBackend
from flashdecode.kernels.triton.launch import Launcher, describe, probe_direct_launch, specialization


class CudaTensor:
    """Stands for a CUDA tensor: the launcher reads its device, dtype and address."""

    def __init__(self, address=256, dtype=torch.float16):
        self.device = torch.device("cuda", 0)
        self.dtype = dtype
        self.address = address

    def data_ptr(self):
        return self.address


class FakeKernel:
    """A JIT kernel (X, n, f, C: constexpr) whose launches are recorded in ``calls``."""

    arg_names = ["X", "n", "f", "C"]

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.calls)
        return run

    def warmup(self, *args, grid, **kwargs):
        """A compile without a launch; the compiled kernel uses ``registers`` registers a thread."""
        self.calls.append(("warmup", grid, args, kwargs))
        compiled = FakeCompiled(self.calls)
        compiled.n_regs = self.registers
        return compiled

    registers = 100


class FakeCompiled:
    """A compiled kernel: its launches recorded in ``calls``, and the fields ``describe`` reads."""

    def __init__(self, calls, signature=None, **metadata):
        self.calls = calls
        self.function = 0xF00
        self.src = types.SimpleNamespace(signature=signature or {"X": "*fp16", "n": "i32", "f": "fp32",
                                                                 "C": "constexpr"})
        self.metadata = types.SimpleNamespace(**{"num_warps": 4, "shared": 2048, "num_ctas": 1,
                                                 "global_scratch_size": 0, "profile_scratch_size": 0, **metadata})

    def __getitem__(self, grid):
        return lambda *args, stream: self.calls.append(("direct", grid, args, stream))


def fast_launcher(probe=lambda device, stream_handle: None, **kwargs):
    return Launcher(stream_handle=lambda index: 77, probe=probe, unavailable=None, is_capturing=lambda: False,
                    **kwargs)


def test_second_call_of_a_specialization_goes_direct():
    """First call through Triton, later ones through the compiled kernel: 3-d grid, constexprs
    appended in signature order, the current stream."""
    calls = []
    launcher, kernel, x = fast_launcher(), FakeKernel(calls), CudaTensor()
    for _ in range(2):
        launcher.launch(kernel, (4, 2), (x,), (9, 0.5), {"C": 16}, {"num_warps": 4})
    assert calls == [("triton", (4, 2), (x, 9, 0.5), {"C": 16, "num_warps": 4}),
                     ("direct", (4, 2, 1), (x, 9, 0.5, 16), 77)]
    assert launcher.fast_path is True and len(launcher) == 1


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "float", "none", "constexpr", "options"])
def test_a_new_specialization_goes_through_triton_again(change):
    """Any change Triton may compile differently for takes Triton's path first (a new key)."""
    calls = []
    launcher, kernel = fast_launcher(), FakeKernel(calls)
    base = dict(tensors=(CudaTensor(),), scalars=(9, 0.5), constexprs={"C": 16}, options={"num_warps": 4})
    changed = dict(base, **{
        "alignment": dict(tensors=(CudaTensor(address=258),)),
        "dtype": dict(tensors=(CudaTensor(dtype=torch.bfloat16),)),
        "int": dict(scalars=(16, 0.5)), "float": dict(scalars=(9, 0.25)), "none": dict(scalars=(9, None)),
        "constexpr": dict(constexprs={"C": 32}), "options": dict(options={"num_warps": 8})}[change])
    for arguments in (base, changed):
        launcher.launch(kernel, (1,), arguments["tensors"], arguments["scalars"], arguments["constexprs"],
                        arguments["options"])
    assert [call[0] for call in calls] == ["triton", "triton"]


def test_specialization_key_ignores_what_triton_ignores():
    """Another tensor at an address of the same 16-byte alignment reuses the compiled kernel."""
    key = specialization(FakeKernel, 0, (CudaTensor(256), None), (3, None), (16,), ())
    assert key == specialization(FakeKernel, 0, (CudaTensor(4096), None), (3, None), (16,), ())
    assert key != specialization(FakeKernel, 0, (CudaTensor(256), CudaTensor(256)), (3, None), (16,), ())
    assert key != specialization(FakeKernel, 1, (CudaTensor(256), None), (3, None), (16,), ())


def test_table_is_bounded():
    calls = []
    launcher, kernel = fast_launcher(max_compiled=2), FakeKernel(calls)
    for n in range(5):
        launcher.launch(kernel, (1,), (CudaTensor(),), (n, 0.5), {"C": 16}, {})
        assert len(launcher) <= 2


def test_failed_probe_keeps_tritons_path():
    calls = []
    launcher = fast_launcher(probe=lambda device, stream_handle: "the probe wrote other values")
    for _ in range(3):
        launcher.launch(FakeKernel(calls), (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, {})
    assert [call[0] for call in calls] == ["triton"] * 3
    assert launcher.fast_path is False and launcher.fast_path_off_because == "the probe wrote other values"


def test_probe_waits_for_a_call_outside_graph_capture():
    calls, probes, capturing = [], [], [True]
    launcher = Launcher(stream_handle=lambda index: 77, probe=lambda device, handle: probes.append(device),
                        unavailable=None, is_capturing=lambda: capturing[0])
    kernel = FakeKernel(calls)
    launcher.launch(kernel, (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, {})
    assert probes == [] and launcher.fast_path is None
    capturing[0] = False
    launcher.launch(kernel, (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, {})
    assert len(probes) == 1 and launcher.fast_path is True


def test_unavailable_fast_path_and_cpu_tensors_take_tritons_path():
    calls = []
    off = Launcher(unavailable="no launcher", stream_handle=lambda index: 77)
    for _ in range(2):
        off.launch(FakeKernel(calls), (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, {})
    cpu = torch.zeros(4)
    for _ in range(2):
        fast_launcher().launch(FakeKernel(calls), (1,), (cpu,), (9, 0.5), {"C": 16}, {})
    assert [call[0] for call in calls] == ["triton"] * 4 and off.fast_path is False


def test_constexprs_must_be_the_last_parameters():
    """The direct path passes constexprs by position, so a kernel whose signature disagrees fails loudly."""
    launcher = fast_launcher()
    with pytest.raises(TypeError, match="expected the constexprs"):
        launcher.launch(FakeKernel([]), (1,), (CudaTensor(),), (9,), {"C": 16}, {})


@pytest.mark.parametrize("registers, ceiling, maxnreg", [(141, 128, 128), (128, 128, None), (107, 128, None),
                                                        (200, None, None)])
def test_register_ceiling_binds_only_where_the_compiler_exceeds_it(registers, ceiling, maxnreg):
    """The ceiling becomes Triton's maxnreg only for a kernel compiled with more registers; decided
    once per specialisation (one compile without launch), never passed to Triton itself."""
    calls = []
    launcher, kernel = fast_launcher(), FakeKernel(calls)
    kernel.registers = registers
    options = {"num_warps": 4, launch.REGISTER_CEILING: ceiling}
    for _ in range(3):
        launcher.launch(kernel, (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, options)
    triton_calls = [call for call in calls if call[0] == "triton"]
    assert len(triton_calls) == 1 and [call[0] for call in calls].count("warmup") == (ceiling is not None)
    expected = {"C": 16, "num_warps": 4, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    assert triton_calls[0][3] == expected
    assert [call[0] for call in calls][-2:] == ["direct", "direct"]


def test_register_ceiling_on_tritons_path_is_decided_once():
    """Without the direct path every call goes through Triton, with the ceiling's options decided by
    one compile without launch."""
    calls = []
    launcher, kernel = fast_launcher(probe=lambda device, stream_handle: "off"), FakeKernel(calls)
    kernel.registers = 141
    for _ in range(3):
        launcher.launch(kernel, (1,), (CudaTensor(),), (9, 0.5), {"C": 16}, {launch.REGISTER_CEILING: 128})
    assert [call[0] for call in calls] == ["warmup", "triton", "triton", "triton"]
    assert all(call[3] == {"C": 16, "maxnreg": 128} for call in calls[1:])


def test_register_ceiling_is_dropped_without_a_compiled_register_count():
    """CPU tensors (Triton's interpreter) and kernels without ``warmup`` launch without the ceiling."""
    calls = []
    for tensor, kernel in ((torch.zeros(4), FakeKernel(calls)), (CudaTensor(), type("NoWarmup", (FakeKernel,), {
            "warmup": None})(calls))):
        fast_launcher().launch(kernel, (1,), (tensor,), (9, 0.5), {"C": 16}, {launch.REGISTER_CEILING: 64})
    assert [call[3] for call in calls] == [{"C": 16}, {"C": 16}]


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's selection")
def test_interpreter_turns_the_fast_path_off():
    assert "interpreted" in launch.FAST_PATH_UNAVAILABLE
    assert Launcher().fast_path is False


@pytest.mark.gpu
def test_probe_passes_on_this_gpu():
    assert launch.FAST_PATH_UNAVAILABLE is None
    assert probe_direct_launch(torch.device("cuda"), compat.current_stream_handle) is None


def route_args(route, q, k_cache, v_cache, kwargs) -> LaunchArgs:
    """The launch arguments of ``route``: fresh out, lse, partials and ticket counters; the caches
    as given."""
    problem, plan = route.problem, route.plan
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    part_o = torch.empty(plan.workspace_rows, problem.nheads_k * problem.q_rows, q.shape[3], device=q.device)
    part_lse = torch.empty(plan.workspace_rows, problem.nheads_k * problem.q_rows, device=q.device)
    tickets = torch.zeros(plan.ticket_count(problem), dtype=torch.int32, device=q.device) if plan.merge_in_split \
        else None
    return LaunchArgs(
        q, k_cache, v_cache, kwargs["cache_seqlens"], torch.empty_like(q), lse, part_o, part_lse, q.shape[3] ** -0.5,
        0.0, kwargs.get("k"), kwargs.get("v"), kwargs.get("rotary_cos"), kwargs.get("rotary_sin"),
        block_table=kwargs.get("block_table"), alibi_slopes=kwargs.get("alibi_slopes"),
        tickets=tickets)


def launch_route(backend, route, q, k_cache, v_cache, kwargs):
    """out, lse and the caches after ``backend`` launched ``route`` on copies of the caches."""
    args = route_args(route, q, k_cache.clone(), v_cache.clone(), kwargs)
    backend.launch(route.plan, route.problem, args)
    return args.out, args.lse, args.k_cache, args.v_cache


@pytest.mark.gpu
def test_register_ceiling_holds_on_this_gpu():
    """Pages of 64 with 32 query rows a KV head (group 8, 4 query tokens), head dim 128: the split
    kernel keeps to the config's ceiling, so the 4 programs per SM the planner counts on fit (Triton
    3.6 on the CPU machine: 138 registers uncapped for 32 rows with pages of 64; group 4 with one
    query token fits without the cap since block ids are checked before the loop)."""
    generator = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(2, 4, 32, 128, device="cuda", generator=generator).half()
    k_cache, v_cache = (torch.randn(64, 64, 4, 128, device="cuda", generator=generator).half() for _ in range(2))
    kwargs = dict(cache_seqlens=torch.tensor([2000, 900], dtype=torch.int32, device="cuda"),
                  block_table=torch.randperm(64, device="cuda", generator=generator).view(2, 32).int())
    route = plan_for(q, k_cache, v_cache, backend="triton", num_splits=4, **kwargs)
    ceiling = route.plan.config.max_registers
    assert ceiling == 128
    backend = TritonBackend()
    args = route_args(route, q, k_cache, v_cache, kwargs)
    kernel, grid, tensors, scalars, constexprs, options = backend.launches(route.plan, route.problem, args)[0]
    uncapped = launch.register_options(kernel, grid, tensors, scalars, constexprs, options)
    if "maxnreg" not in uncapped:
        pytest.skip("this Triton compiles the kernel within the ceiling: nothing to cap")
    for _ in range(2):
        backend.launch(route.plan, route.problem, args)
    split = backend.host_launches(route.plan, route.problem, args)[0]
    assert split.owner.n_regs <= ceiling


@pytest.mark.gpu
@pytest.mark.parametrize("features", ["plain", "paged-append-rotary-alibi"])
@pytest.mark.parametrize("num_splits, merge, dependent", [(1, False, False), (4, False, False), (4, False, True),
                                                       (4, True, False)],
                         ids=["one", "combine", "dependent-combine", "merge"])
def test_direct_launch_matches_tritons_launch(features, num_splits, merge, dependent):
    """The backend's kernels launched directly write exactly what Triton's path writes (4 splits:
    merged by the combine kernel, launched after the split kernel or as a dependent launch, or in
    the split kernel), and the dependent combine writes what the plain one does."""
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=generator).half()

    q = randn(3, 2, 8, 128)
    kwargs = dict(cache_seqlens=torch.tensor([690, 65, 1], dtype=torch.int32, device="cuda"), causal=True,
                  num_splits=num_splits)
    if features == "plain":
        k_cache, v_cache = randn(3, 700, 2, 128), randn(3, 700, 2, 128)
    else:
        k_cache, v_cache = randn(140, 16, 2, 128), randn(140, 16, 2, 128)
        kwargs.update(block_table=torch.randperm(140, device="cuda", generator=generator)[:3 * 44].view(3, 44).int(),
                      k=randn(3, 2, 2, 128), v=randn(3, 2, 2, 128), rotary_cos=randn(704, 32),
                      rotary_sin=randn(704, 32),
                      alibi_slopes=torch.rand(8, device="cuda", generator=generator))
    route = plan_for(q, k_cache, v_cache, backend="triton", **kwargs)
    if num_splits > 1:
        route = dataclasses.replace(route, plan=dataclasses.replace(route.plan, merge_in_split=merge,
                                                                    dependent_combine=dependent))
    if dependent and launch.DEPENDENT_LAUNCH_UNAVAILABLE:
        pytest.skip(launch.DEPENDENT_LAUNCH_UNAVAILABLE)
    public = TritonBackend()
    public.launcher = Launcher(unavailable="compared against")
    fast = TritonBackend()
    launch_route(fast, route, q, k_cache, v_cache, kwargs)  # a new specialisation: Triton's path
    direct = launch_route(fast, route, q, k_cache, v_cache, kwargs)
    assert fast.launcher.fast_path is True and len(fast.launcher) == (2 if route.plan.needs_combine else 1)
    expected = launch_route(public, route, q, k_cache, v_cache, kwargs)
    for got, want in zip(direct, expected):
        assert torch.equal(got, want)
    if dependent:
        assert [described.dependent for described in fast.host_launches(route.plan, route.problem, route_args(
            route, q, k_cache, v_cache, kwargs))] == [False, True]
        plain = dataclasses.replace(route, plan=dataclasses.replace(route.plan, dependent_combine=False))
        for got, want in zip(direct, launch_route(TritonBackend(), plain, q, k_cache, v_cache, kwargs)):
            assert torch.equal(got, want)


def compiled_findings(script: str) -> dict:
    """The JSON that ``script`` prints last, run in a process of its own without Triton's
    interpreter (the tests' conftest turns it on), so that it can compile kernels for sm_90a."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=pathlib.Path(__file__).resolve().parents[1],
                          env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


#: Compiles the split and combine kernels of a plan with a dependent combine for sm_90a (no GPU needed:
#: Triton's own ptxas) and prints, for each, the PTX lines that load or store global memory before
#: the combine's griddepcontrol.wait, and whether the split kernel signals its dependents.
DEPENDENT_PTX_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tools")
    from triton_resources import compile_for_hopper, plan_launches
    from flashdecode.hardware import PROFILES
    from flashdecode.kernels import get_backend
    from flashdecode.kernels.triton.launch import _without_ceiling
    from flashdecode.planner import plan
    from flashdecode.problem import Problem
    problem = Problem(1, 8192, 32, 4, 128, "bfloat16")
    the_plan = plan(problem, PROFILES["h200"], get_backend("triton"))
    ptx = [compile_for_hopper(kernel, tensors, scalars, constexprs, _without_ceiling(options)).asm["ptx"]
           for kernel, _, tensors, scalars, constexprs, options in plan_launches(problem, the_plan)]
    wait = ptx[1].index("griddepcontrol.wait")
    print(json.dumps(dict(dependent=the_plan.dependent_combine,
                          signals="griddepcontrol.launch_dependents" in ptx[0],
                          before_wait=[line.strip() for line in ptx[1][:wait].splitlines()
                                       if "ld.global" in line or "st.global" in line])))
""")


@pytest.mark.slow
def test_dependent_combine_reads_only_the_lengths_before_it_waits():
    """The compiled kernels of a dependent combine: the split kernel signals its dependents, and
    the combine touches no partial and writes nothing before griddepcontrol.wait (one load: the
    lengths, which the split kernel does not write)."""
    if launch.gdc_wait is None:
        pytest.skip(launch.DEPENDENT_LAUNCH_UNAVAILABLE)
    found = compiled_findings(DEPENDENT_PTX_SCRIPT)
    assert found["dependent"] and found["signals"]
    assert len(found["before_wait"]) == 1 and "ld.global" in found["before_wait"][0], found["before_wait"]


TRITON_PTX_SCRIPT = textwrap.dedent("""
    import json, pathlib, shutil, sys, tempfile
    sys.path.insert(0, "tools")
    import triton_ptx
    import flashdecode
    from flashdecode.problem import Problem
    triton_ptx.PROBLEMS = {"one-token": Problem(1, 1, 32, 4, 128, "bfloat16")}
    folder = pathlib.Path(tempfile.mkdtemp()) / "mine"
    names = triton_ptx.write(folder)
    text = (folder / names[0]).read_text()
    other = folder.with_name("other")
    shutil.copytree(folder, other)
    same = triton_ptx.compare(folder, other)
    (other / names[0]).write_text(text.replace("ld.global", "ld.global.nc", 1))
    (other / "extra-0.ptx").write_text(text)
    print(json.dumps(dict(names=names, located=[line for line in text.splitlines()
                                                 if line.strip().startswith(triton_ptx.LOCATORS)],
                          loads="ld.global" in text, debug=".debug" in text,
                          kept=triton_ptx.instructions("\\t.loc 1 2 3\\n\\tadd.s32 %r1, %r2, 1;\\n$L__tmp3:\\n"),
                          same=same, changed=triton_ptx.compare(folder, other),
                          own_tree=pathlib.Path(flashdecode.__file__).resolve().parents[1]
                          == pathlib.Path(triton_ptx.__file__).resolve().parents[1])))
""")


@pytest.mark.slow
def test_triton_ptx_writes_instructions_without_source_locations():
    """tools/triton_ptx.py: a plan's kernel written as its instructions only (no .loc lines,
    debug labels or sections), so two trees compare equal where they compile alike; a changed
    file differs, and a file one folder alone has is named; the kernels are the script's tree's."""
    found = compiled_findings(TRITON_PTX_SCRIPT)
    assert found["names"] == ["one-token-0.ptx"] and found["loads"] and found["own_tree"]
    assert found["located"] == [] and not found["debug"]
    assert found["kept"] == "\tadd.s32 %r1, %r2, 1;\n"
    assert found["same"] == {"one-token-0.ptx": "same"}
    assert found["changed"]["one-token-0.ptx"] == "differs"
    assert found["changed"]["extra-0.ptx"].startswith("only in") and found["changed"]["extra-0.ptx"].endswith("other")


def test_describe_lists_the_parameters_triton_passes():
    """Constexprs left out, each scalar as its signature type, a null pointer per scratch buffer."""
    x, y = torch.zeros(4), torch.zeros(2)
    compiled = FakeCompiled([], {"X": "*fp16", "Y": "*i32", "n": "i32", "m": "i64", "f": "fp32", "C": "constexpr",
                                 "D": "constexpr"})
    launch = describe(compiled, (5, 2), (x, y, 3, 2 ** 40, 0.5, 16, None))
    assert launch == CudaLaunch(0xF00, (5, 2, 1), 128, 2048, (x, y, 3, 2 ** 40, 0.5, None, None),
                                (POINTER, POINTER, INT32, INT64, FLOAT32, POINTER, POINTER), owner=compiled)
    del compiled.metadata.profile_scratch_size  # a Triton with one scratch buffer
    assert describe(compiled, (5,), (x, y, 3, 2 ** 40, 0.5, 16, None)).kinds[-2:] == (FLOAT32, POINTER)
    assert not describe(compiled, (5,), (x, y, 3, 2 ** 40, 0.5, 16, None)).dependent
    compiled.metadata.launch_pdl = True  # compiled for a programmatic dependent launch
    assert describe(compiled, (5,), (x, y, 3, 2 ** 40, 0.5, 16, None)).dependent


@pytest.mark.parametrize("change", [
    {"num_ctas": 2}, {"shared": 229 * 1024}, {"launch_cooperative_grid": True},
    {"global_scratch_size": 64},
    {"profile_scratch_size": 8}, {"tensordesc_meta": [{}]}, {"signature": {"X": "*fp16", "n": "fp16"}},
    {"signature": {"X": "*fp16"}}, {"values": (torch.zeros(1), 2.5)}, {"values": (3, 4)}, {"function": None},
], ids=str)
def test_describe_declines_what_a_plain_launch_cannot_do(change):
    change = dict(change)
    signature = change.pop("signature", {"X": "*fp16", "n": "i32"})
    values = change.pop("values", (torch.zeros(1), 2))
    function = change.pop("function", 0xF00)
    compiled = FakeCompiled([], signature, **change)
    compiled.function = function
    assert describe(compiled, (1,), values) is None
    assert describe(FakeCompiled([], {"X": "*fp16", "n": "i32"}), (1,), (torch.zeros(1), 2)) is not None


def test_cuda_launch_describes_the_compiled_specialization(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher, kernel = fast_launcher(), FakeKernelCompiling()
    x = CudaTensorLike()
    arguments = (kernel, (4,), (x,), (9, 0.5), {"C": 16}, {"num_warps": 4})
    assert launcher.cuda_launch(*arguments) is None  # not compiled yet
    launcher.launch(*arguments)
    launch = launcher.cuda_launch(*arguments)
    assert launch.function == 0xF00 and launch.grid == (4, 1, 1) and launch.arguments[:3] == (x, 9, 0.5)
    assert Launcher(unavailable="Triton lacks it").cuda_launch(*arguments) is None


def test_cuda_launch_finds_the_kernel_compiled_under_a_ceiling(monkeypatch):
    """The compiled host path describes the capped kernel the launcher compiled (same key)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []
    launcher, kernel = fast_launcher(), FakeKernel(calls)
    kernel.registers = 141
    arguments = (kernel, (4,), (CudaTensorLike(),), (9, 0.5), {"C": 16},
                 {"num_warps": 4, launch.REGISTER_CEILING: 128})
    launcher.launch(*arguments)
    assert calls[-1][0] == "triton" and calls[-1][3]["maxnreg"] == 128
    assert launcher.cuda_launch(*arguments).function == 0xF00


class CudaTensorLike(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (what the launcher reads of a CUDA tensor)."""

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_subclass(cls, torch.zeros(4))

    @property
    def device(self):
        return torch.device("cuda", 0)


class FakeKernelCompiling(FakeKernel):
    def __init__(self):
        super().__init__([])

    def __getitem__(self, grid):
        return lambda *args, **kwargs: FakeCompiled(self.calls)
