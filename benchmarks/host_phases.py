"""Where a repeat call's host time goes on the compiled host path, piece by piece (GPU machine).

The extension is built from an instrumented copy of ``csrc/host_path.cpp`` (steady_clock marks in
``HostPath.run``: the key and lookup, the capture check, the context check, the allocation of out
and lse, each launch, the return), which also times primitives in C++ loops: allocations
(``at::empty_like``, ``at::empty``, ``at::detail::empty_generic``), the driver queries, one plain
torch launch (``add_``), and the launch floor: ``cuLaunchKernel`` / ``cuLaunchKernelEx`` (with and
without a dependent launch's attribute) of two trivial Triton kernels
(``launch_floor_kernels.py``). Then per (case, backend): the whole call, the default-context
lookup, ``DecodeContext.run_call`` and ``HostPath.run`` from Python, each the median of 7 loops of
CALLS calls back to back (a case whose GPU time exceeds its host time shows the GPU instead), and
the C++ phases of the ``HostPath.run`` loops.

Usage: python benchmarks/host_phases.py [--pairs 3:triton,3:tilelang,6:triton,10:triton,14:triton] [--calls 2000]
(set FLASHDECODE_CACHE_DIR to keep the instrumented build apart from the real one)
"""
import argparse
import importlib.util
import pathlib
import statistics
import tempfile

import torch

import flashdecode
from host_calls import loop_us
from flashdecode import compat, host_path
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call
from flashdecode.call import Call
from flashdecode.context import default_context
from flashdecode.kernels.triton.launch import describe

PHASES = ["key+find", "capture?", "ctx+data", "alloc", "launch1", "launch2", "return"]


def instrumented_source() -> pathlib.Path:
    """A copy of the extension's source with the marks and the primitives' loops (asserts that each
    place it patches is still there)."""
    text = host_path.SOURCE.read_text()
    def sub(old, new, count=1):
        nonlocal text
        assert text.count(old) == count, (old, text.count(old))
        text = text.replace(old, new)
    sub("#include <dlfcn.h>\n", """#include <dlfcn.h>
#include <chrono>
#include <ATen/EmptyTensor.h>
static int64_t g_phase[8] = {};
static int64_t g_last = 0;
static int64_t g_calls = 0;
static inline int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
#define MARK(i) do { int64_t t_ = now_ns(); g_phase[i] += t_ - g_last; g_last = t_; } while (0)
""")
    sub("""  py::object run(Arguments args) {
    if (!make_key(args, key_)) return py::none();
    auto found = records_.find(key_);
    if (found == records_.end() || (real_launches_ && !driver_says_not_capturing(args))) return py::none();
    py::object result = execute(found->second, args, nullptr, nullptr);""",
"""  py::object run(Arguments args) {
    g_last = now_ns(); ++g_calls;
    if (!make_key(args, key_)) return py::none();
    auto found = records_.find(key_);
    MARK(0);
    if (found == records_.end() || (real_launches_ && !driver_says_not_capturing(args))) return py::none();
    MARK(1);
    py::object result = execute(found->second, args, nullptr, nullptr);
    MARK(6);""")
    sub("""    void* data[kSlots] = {};
    call_data(args, data);
    const at::Tensor& q = THPVariable_Unpack(args[kQ]);""",
"""    void* data[kSlots] = {};
    call_data(args, data);
    const at::Tensor& q = THPVariable_Unpack(args[kQ]);
    MARK(2);""")
    sub("""    if (lse.defined()) data[kLseSlot] = lse.data_ptr();
""", """    if (lse.defined()) data[kLseSlot] = lse.data_ptr();
    MARK(3);
    int launch_index = 0;
""")
    sub("""              std::to_string(status) + "); set FLASHDECODE_HOST_PATH=0 to see the error from the Python path");
        }
      }""", """              std::to_string(status) + "); set FLASHDECODE_HOST_PATH=0 to see the error from the Python path");
        }
        MARK(launch_index < 1 ? 4 : 5); ++launch_index;
      }""")
    sub("""    launch_ffi(record, args, data);
""", """    launch_ffi(record, args, data);
    MARK(4);
""")
    sub("""  py::class_<HostPath>(m, "HostPath")""", """  m.def("phases", [] { std::vector<double> r; for (int i = 0; i < 7; ++i) { r.push_back(g_calls ? g_phase[i] / 1e3 / g_calls : 0); g_phase[i] = 0; } g_calls = 0; return r; });
  m.def("primitives", [](at::Tensor q, uintptr_t stream, int n) {
    std::vector<std::pair<std::string, double>> r;
    auto time_it = [&](const char* name, auto&& fn) { int64_t t = now_ns(); for (int i = 0; i < n; ++i) fn(); r.emplace_back(name, (now_ns() - t) / 1e3 / n); };
    time_it("empty_like", [&] { at::Tensor t = at::empty_like(q); });
    time_it("empty(sizes, options)", [&] { at::Tensor t = at::empty(q.sizes(), q.options()); });
    c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
    time_it("empty_generic", [&] { at::Tensor t = at::Tensor(at::detail::empty_generic(q.sizes(), allocator, c10::DispatchKeySet(c10::DispatchKey::CUDA), q.scalar_type(), std::nullopt)); });
    const Driver& driver = Driver::get();
    time_it("cuStreamIsCapturing", [&] { int s = 0; driver.stream_is_capturing(reinterpret_cast<void*>(stream), &s); });
    time_it("cuCtxGetCurrent", [&] { driver.current_context(); });
    time_it("py::cast(tensor)", [&] { py::object o = py::cast(q); });
    return r;
  });
  m.def("launch_loop", [](uintptr_t function, unsigned block, unsigned shared, uintptr_t stream, std::vector<uint64_t> words, int n, int mode) {
    const Driver& driver = Driver::get();
    std::vector<void*> parameters; for (auto& w : words) parameters.push_back(&w);
    unsigned grid[3] = {1, 1, 1};
    int64_t t = now_ns();
    for (int i = 0; i < n; ++i) {
      int status;
      if (mode == 0) status = driver.launch(reinterpret_cast<void*>(function), grid, block, shared, reinterpret_cast<void*>(stream), parameters.data(), false);
      else if (mode == 1) status = driver.launch(reinterpret_cast<void*>(function), grid, block, shared, reinterpret_cast<void*>(stream), parameters.data(), true);
      else { LaunchConfig config{1, 1, 1, block, 1, 1, shared, reinterpret_cast<void*>(stream), nullptr, 0}; status = driver.launch_kernel_ex(&config, reinterpret_cast<void*>(function), parameters.data(), nullptr); }
      if (status != 0) throw std::runtime_error("launch failed " + std::to_string(status));
    }
    return (now_ns() - t) / 1e3 / n;
  });
  m.def("torch_add_loop", [](at::Tensor x, int n) { int64_t t = now_ns(); for (int i = 0; i < n; ++i) x.add_(0); return (now_ns() - t) / 1e3 / n; });
  py::class_<HostPath>(m, "HostPath")""")
    path = pathlib.Path(tempfile.mkdtemp()) / "host_path.cpp"
    path.write_text(text)
    return path

def print_floor(module, calls: int) -> None:
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    stream = compat.current_stream_handle(0)
    for name, us in module.primitives(q, stream, 20000):
        print(f"primitive {name:24s} {us:6.2f} us")
    spec = importlib.util.spec_from_file_location("launch_floor_kernels",
                                                  pathlib.Path(__file__).with_name("launch_floor_kernels.py"))
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    x = torch.zeros(64, device="cuda")
    for name, kernel, values in (("1 pointer", kernels.store_one, (x,)),
                                 ("1 pointer + 31 ints", kernels.store_sum, (x, *range(1, 32)))):
        launch = describe(kernel[(1,)](*values), (1,), values)
        words = [a.data_ptr() if isinstance(a, torch.Tensor) else (0 if a is None else a) for a in launch.arguments]
        for _ in range(3):
            cells = [f"{label} {module.launch_loop(launch.function, launch.block, launch.shared, stream, words, calls, mode):5.2f}"
                     for mode, label in ((0, "cuLaunchKernel"), (1, "Ex+PDL"), (2, "Ex plain"))]
            torch.cuda.synchronize()
            print(f"launch floor, trivial Triton kernel, {name}: " + "  ".join(cells) + " us")
    for _ in range(3):
        print(f"torch add_ from C++ {module.torch_add_loop(x, calls):5.2f} us; "
              f"from Python {loop_us(lambda: x.add_(0), calls):5.2f} us")


def print_case(module, number: int, backend: str, calls: int) -> None:
    call = make_call(CASES_BY_NUMBER[number], VARIANTS["plain"], "cuda")
    q, k_cache, v_cache, lengths = call.q, call.k_cache, call.v_cache, call.kwargs()["cache_seqlens"]

    def whole():
        return flashdecode.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend=backend)

    for _ in range(5):
        expected = whole()  # the first records its launches
    context = default_context(q)
    host = context.host_path
    call = Call(q, k_cache, v_cache, cache_seqlens=lengths, backend=backend)
    arguments = (*call, compat.current_stream_handle(q.device.index or 0))
    got = host.run(*arguments)
    assert got is not None, "the call missed its record"
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    scratch = torch.zeros(1024, device="cuda")
    pieces = {"torch launch": lambda: scratch.add_(0), "whole call": whole,
              "default_context(q)": lambda: default_context(q),
              "context.run_call": lambda: context.run_call(call), "HostPath.run": lambda: host.run(*arguments)}
    rows = {name: [] for name in pieces}
    phases = []
    for _ in range(7):
        for name, function in pieces.items():
            module.phases()
            rows[name].append(loop_us(function, calls))
            if name == "HostPath.run":
                phases.append(module.phases())
    print(f"case {number:2d} {backend:8s} " + " | ".join(f"{n} {statistics.median(v):5.2f}" for n, v in rows.items()))
    print("    C++ phases: " + "  ".join(
        f"{name} {statistics.median(p[i] for p in phases):5.2f}" for i, name in enumerate(PHASES)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="3:triton,3:tilelang,6:triton,10:triton,14:triton")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    host_path.SOURCE = instrumented_source()
    module = host_path.EXTENSION.load(verbose=True)
    assert module is not None, host_path.EXTENSION.error
    print_floor(module, 3000)
    for pair in args.pairs.split(","):
        number, backend = pair.split(":")
        print_case(module, int(number), backend, args.calls)


if __name__ == "__main__":
    main()
