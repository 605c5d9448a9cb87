// The compiled host path (docs/design.md, "Host path"): a repeat call's metadata is hashed here,
// its launch record found, out (and lse) allocated and its kernels launched with the call's data
// pointers patched in place: TileLang's kernels through their TVM-FFI entry functions (DLTensor
// templates), Triton's as CUDA functions through the driver's cuLaunchKernel (parameter words;
// cuLaunchKernelEx for a programmatic dependent launch).
// Python builds each record once, on the first call of a metadata (flashdecode/host_path.py);
// everything it cannot express there (graph capture, host-side checks, other argument types) stays
// on the Python path.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>

// FLASHDECODE_TVM_FFI: built against TVM-FFI (it comes with TileLang); without it, records hold
// raw CUDA launches only.
#ifdef FLASHDECODE_TVM_FFI
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>
#endif

#include <dlfcn.h>

// CUDA's driver header, where the build finds it: only to check the launch structures copied below.
#if __has_include(<cuda.h>)
#include <cuda.h>
#define FLASHDECODE_HAS_CUDA_H 1
#else
#define FLASHDECODE_HAS_CUDA_H 0
#endif

#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// The call's arguments are declared once, in flashdecode/call.py (ARGUMENTS); a HostPath is made
// with their Layout (flashdecode/host_path.py: LAYOUT): how each is keyed, and where out and
// return_softmax_lse are. ``run`` takes them positionally, then the bound stream.
enum ArgumentKey : int {
  kKeyTensor,    // a tensor (keyed by its metadata; a launch slot) or a scalar
  kKeyScalar,    // a scalar, keyed by value; a tensor is a miss
  kKeyNoneOnly,  // None, else a miss (an argument only the Python path takes)
  kArgumentKeys
};
constexpr int kQ = 0;  // q is the call's first argument
// Tensors a launch argument can come from: the call's kKeyTensor arguments in order (at most
// kMaxCallSlots), then the allocated lse.
constexpr int kMaxCallSlots = 31;
constexpr int kLseSlot = kMaxCallSlots;
constexpr int kSlots = kMaxCallSlots + 1;
constexpr int kConstant = -1;

struct Layout {
  std::vector<int> keys;  // an ArgumentKey per position, the stream's (kKeyScalar) last
  std::vector<int> slot_positions;  // the position of each call slot's argument
  int out_position = 0, out_slot = 0, return_lse_position = 0, stream_position = 0;

  // From the call's keys (without the stream) and the positions of out and return_softmax_lse.
  Layout(const std::vector<int>& call_keys, int out, int return_lse)
      : keys(call_keys), out_position(out), return_lse_position(return_lse) {
    int count = static_cast<int>(call_keys.size());
    if (count < 1 || call_keys[kQ] != kKeyTensor) throw std::invalid_argument("host path: q must be a tensor first");
    if (out < 0 || out >= count || call_keys[out] != kKeyTensor || return_lse < 0 || return_lse >= count ||
        call_keys[return_lse] != kKeyScalar) {
      throw std::invalid_argument("host path: out must be a tensor argument, return_softmax_lse a scalar one");
    }
    for (int position = 0; position < count; ++position) {
      int key = call_keys[position];
      if (key < 0 || key >= kArgumentKeys) throw std::invalid_argument("host path: no such argument key");
      if (key != kKeyTensor) continue;
      if (position == out) out_slot = static_cast<int>(slot_positions.size());
      slot_positions.push_back(position);
    }
    if (slot_positions.size() > static_cast<size_t>(kMaxCallSlots)) {
      throw std::invalid_argument("host path: more tensor arguments than kMaxCallSlots");
    }
    stream_position = count;
    keys.push_back(kKeyScalar);
  }

  int count() const { return stream_position + 1; }
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t hash = 1469598103934665603ull;
    for (int64_t value : key) {
      hash ^= static_cast<uint64_t>(value);
      hash *= 1099511628211ull;
    }
    return static_cast<size_t>(hash);
  }
};

// Appends what the record depends on of one argument; false for a type the path does not take (a
// tensor too, unless ``tensor_allowed``).
bool push_argument(Key& key, PyObject* object, bool tensor_allowed = true) {
  // Cheap exact-type checks first: THPVariable_Check on a non-tensor goes through isinstance.
  if (object == Py_None) {
    key.push_back(-1);
  } else if (PyBool_Check(object)) {
    key.push_back(3);
    key.push_back(object == Py_True);
  } else if (PyLong_CheckExact(object)) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(object, &overflow);
    if (overflow) return false;
    key.push_back(2);
    key.push_back(value);
  } else if (PyFloat_CheckExact(object)) {
    double value = PyFloat_AS_DOUBLE(object);
    int64_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    key.push_back(4);
    key.push_back(bits);
  } else if (PyUnicode_CheckExact(object)) {
    key.push_back(5);
    key.push_back(PyObject_Hash(object));
  } else if (PyTuple_CheckExact(object)) {
    Py_ssize_t size = PyTuple_GET_SIZE(object);
    key.push_back(6);
    key.push_back(size);
    for (Py_ssize_t i = 0; i < size; ++i) {
      PyObject* item = PyTuple_GET_ITEM(object, i);
      if (!PyLong_CheckExact(item) || !push_argument(key, item)) return false;
    }
  } else if (THPVariable_Check(object)) {
    if (!tensor_allowed) return false;
    const at::Tensor& tensor = THPVariable_Unpack(object);
    key.push_back(1);
    key.push_back(static_cast<int64_t>(tensor.scalar_type()));
    key.push_back(static_cast<int64_t>(tensor.device().type()));
    key.push_back(tensor.device().index());
    key.push_back(tensor.dim());
    for (int64_t size : tensor.sizes()) key.push_back(size);
    for (int64_t stride : tensor.strides()) key.push_back(stride);
    key.push_back(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0);
  } else {
    return false;
  }
  return true;
}

// The call's arguments and the stream (``run``'s positional arguments, or a tuple's items): see Layout.
using Arguments = PyObject* const*;

// cuLaunchKernelEx's configuration as cuda.h (CUDA 12.0+) lays it out, with the one attribute a
// dependent launch sets; the library builds without CUDA headers, and checks these copies against
// them where it finds them.
struct alignas(8) LaunchAttribute {
  int id;  // CUlaunchAttributeID
  char pad[4];
  union alignas(8) {
    char bytes[64];
    int programmatic_stream_serialization_allowed;
  } value;
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  LaunchAttribute* attributes;
  unsigned attribute_count;
};
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
#if FLASHDECODE_HAS_CUDA_H && defined(CUDA_VERSION) && CUDA_VERSION >= 12000  // not an older system cuda.h
static_assert(sizeof(LaunchAttribute) == sizeof(::CUlaunchAttribute) &&
              alignof(LaunchAttribute) == alignof(::CUlaunchAttribute) &&
              offsetof(LaunchAttribute, value) == offsetof(::CUlaunchAttribute, value));
static_assert(sizeof(LaunchConfig) == sizeof(::CUlaunchConfig) && alignof(LaunchConfig) == alignof(::CUlaunchConfig) &&
              offsetof(LaunchConfig, stream) == offsetof(::CUlaunchConfig, hStream) &&
              offsetof(LaunchConfig, attributes) == offsetof(::CUlaunchConfig, attrs) &&
              offsetof(LaunchConfig, attribute_count) == offsetof(::CUlaunchConfig, numAttrs));
static_assert(kProgrammaticStreamSerialization == ::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
static_assert(::CU_STREAM_CAPTURE_STATUS_NONE == 0);
#endif

// The CUDA driver functions a raw launch needs, looked up in libcuda at first use (the library
// builds without CUDA headers; CPU machines have no libcuda, and never launch).
struct Driver {
  using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);
  using LaunchKernelEx = int (*)(const LaunchConfig*, void*, void**, void**);
  using CtxGetCurrent = int (*)(void**);
  using FuncGetParamInfo = int (*)(void*, size_t, size_t*, size_t*);
  using StreamIsCapturing = int (*)(void*, int*);
  LaunchKernel launch_kernel = nullptr;
  LaunchKernelEx launch_kernel_ex = nullptr;  // CUDA 12.0+ drivers
  CtxGetCurrent ctx_get_current = nullptr;
  FuncGetParamInfo func_get_param_info = nullptr;  // CUDA 12.4+ drivers
  StreamIsCapturing stream_is_capturing = nullptr;

  static const Driver& get() {
    static const Driver driver = [] {
      Driver found;
      void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_NOW);
      if (library != nullptr) {
        found.launch_kernel = reinterpret_cast<LaunchKernel>(dlsym(library, "cuLaunchKernel"));
        found.launch_kernel_ex = reinterpret_cast<LaunchKernelEx>(dlsym(library, "cuLaunchKernelEx"));
        found.ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(library, "cuCtxGetCurrent"));
        found.func_get_param_info = reinterpret_cast<FuncGetParamInfo>(dlsym(library, "cuFuncGetParamInfo"));
        found.stream_is_capturing = reinterpret_cast<StreamIsCapturing>(dlsym(library, "cuStreamIsCapturing"));
      }
      return found;
    }();
    return driver;
  }

  // A launch of ``function`` (cuLaunchKernel's arguments); ``dependent``: a programmatic dependent
  // launch, which may be scheduled before the previous kernel on the stream completes (the kernel
  // waits for it with griddepcontrol.wait). A CUresult, -1 where the driver lacks the function.
  int launch(void* function, const unsigned grid[3], unsigned block, unsigned shared, void* stream,
             void** parameters, bool dependent) const {
    if (!dependent) {
      if (launch_kernel == nullptr) return -1;
      return launch_kernel(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream, parameters, nullptr);
    }
    if (launch_kernel_ex == nullptr) return -1;
    LaunchAttribute attribute{};
    attribute.id = kProgrammaticStreamSerialization;
    attribute.value.programmatic_stream_serialization_allowed = 1;
    LaunchConfig config{grid[0], grid[1], grid[2], block, 1, 1, shared, stream, &attribute, 1};
    return launch_kernel_ex(&config, function, parameters, nullptr);
  }

  void* current_context() const {
    void* context = nullptr;
    if (ctx_get_current == nullptr || ctx_get_current(&context) != 0) return nullptr;
    return context;
  }
};

// A CUDA launch's parameter kinds (flashdecode/kernels/base.py: POINTER ... INT8), with their sizes.
enum ParameterKind : int { kPointer, kInt32, kInt64, kFloat32, kInt8, kParameterKinds };
constexpr size_t kParameterSize[kParameterKinds] = {8, 4, 8, 4, 1};

#ifdef FLASHDECODE_TVM_FFI
// One argument of a kernel's entry function: a tensor taken from a slot or held by the record
// (workspace, lse sink, lengths), or a scalar.
struct Argument {
  int slot = kConstant;
  at::Tensor held;
  std::vector<int64_t> shape, strides;
  DLTensor tensor{};
};

struct FfiLaunch {
  py::object function;  // keeps the TVM-FFI function alive
  TVMFFIObjectHandle handle = nullptr;
  std::vector<std::unique_ptr<Argument>> arguments;  // stable addresses: packed points into them
  std::vector<TVMFFIAny> packed;
  std::vector<std::pair<int, DLTensor*>> patched;  // (slot, tensor whose data each call sets)
};
#else
struct FfiLaunch {};
#endif

// A CUDA function launched with cuLaunchKernel (cuLaunchKernelEx where dependent): one 8-byte word
// per parameter, the call's data pointers written into theirs before each launch.
struct CudaLaunch {
  CudaLaunch() = default;
  CudaLaunch(const CudaLaunch&) = delete;  // parameters point into words: moved, never copied
  CudaLaunch& operator=(const CudaLaunch&) = delete;
  CudaLaunch(CudaLaunch&&) noexcept = default;
  CudaLaunch& operator=(CudaLaunch&&) noexcept = default;

  void* function = nullptr;  // CUfunction, loaded while owner (the compiled kernel) lives
  py::object owner;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 1;
  unsigned shared = 0;
  bool dependent = false;  // a programmatic dependent launch (Driver::launch)
  std::vector<uint64_t> words;
  std::vector<void*> parameters;  // points into words
  std::vector<at::Tensor> held;
  std::vector<std::pair<int, size_t>> patched;  // (slot, word whose pointer each call sets)
};

struct Record {
  std::vector<FfiLaunch> ffi_launches;
  std::vector<CudaLaunch> cuda_launches;  // a record has launches of one kind
  void* cuda_context = nullptr;  // the context raw launches' functions belong to
  std::vector<int64_t> lse_shape;  // (B, Hq, Sq), ragged (Hq, total_q): allocated per call when the caller wants lse
  int device_type = 0, device_id = 0;  // of the TVM-FFI launches' tensors (DLPack's numbering)
  // The allocator at::empty takes q's device's memory from, where q is a CUDA tensor (else null);
  // out_contiguous: q's strides are its shape's contiguous strides (at::empty_like's out is then
  // contiguous too). Both hold for every call of the record: its key has q's device and strides.
  c10::Allocator* cuda_allocator = nullptr;
  bool out_contiguous = false;
  // Pairs of call slots that had one data pointer when the record was made, each pair's first the
  // slot its launch arguments take: a call hits only where they still share it.
  std::vector<std::pair<int, int>> same_slots;
};

// A hit's out or lse, contiguous: what at::empty gives, from the record's allocator on the current
// device without the dispatcher (on the H200 machine's host 0.5 us a call where at::empty_like took
// 1.2, docs/design.md "Host path"); at::empty where the record has no allocator or the current CUDA
// device is not q's (the caching allocator serves the current device).
at::Tensor empty_contiguous(const Record& record, const at::Tensor& q, at::IntArrayRef sizes, at::ScalarType type) {
  if (record.cuda_allocator != nullptr &&
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() == q.device().index()) {
    return at::Tensor(at::detail::empty_generic(sizes, record.cuda_allocator,
                                                c10::DispatchKeySet(c10::DispatchKey::CUDA), type, std::nullopt));
  }
  return at::empty(sizes, q.options().dtype(type));
}

#ifdef FLASHDECODE_TVM_FFI
DLDataType dl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kFloat8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};  // fp8 caches, coded as torch's DLPack export
    case at::kFloat8_e5m2: return {kDLFloat8_e5m2, 8, 1};
    default: throw std::invalid_argument("host path: unsupported tensor dtype in a launch");
  }
}

DLDevice dl_device(const at::Tensor& tensor) {
  if (tensor.is_cuda()) return {kDLCUDA, static_cast<int32_t>(tensor.device().index())};
  return {kDLCPU, 0};
}

void fill_template(Argument& argument, const at::Tensor& tensor) {
  argument.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  argument.strides.assign(tensor.strides().begin(), tensor.strides().end());
  DLTensor& dl = argument.tensor;
  dl.data = tensor.data_ptr();
  dl.device = dl_device(tensor);
  dl.ndim = static_cast<int32_t>(tensor.dim());
  dl.dtype = dl_dtype(tensor.scalar_type());
  dl.shape = argument.shape.data();
  dl.strides = argument.strides.data();
  dl.byte_offset = 0;
}
#endif

class HostPath {
 public:
  // real_launches: compare a CUDA launch's words with the function's parameter list where the
  // driver can tell, and ask the driver whether the call's stream is capturing (off only for tests
  // whose functions and streams are not real). call_keys, out, return_lse: the call's Layout.
  HostPath(size_t max_records, bool real_launches, const std::vector<int>& call_keys, int out, int return_lse)
      : max_records_(max_records), real_launches_(real_launches), layout_(call_keys, out, return_lse) {}

  // The arguments ``run`` takes: the call's, then the stream.
  int argument_count() const { return layout_.count(); }

  // None on a miss (the caller takes the Python path), else out or (out, lse). A call on a stream
  // that is capturing a CUDA graph misses: the Python path gives a graph buffers of its own.
  py::object run(Arguments args) {
    if (!make_key(args, key_)) return py::none();
    auto found = records_.find(key_);
    if (found == records_.end() || (real_launches_ && !driver_says_not_capturing(args))) return py::none();
    py::object result = execute(found->second, args, nullptr, nullptr);
    if (!result.is_none()) ++hits_;
    return result;
  }

  // The record of ``call`` (a tuple as ``run`` takes), run into the given out and lse (a check).
  py::object replay(py::tuple call, at::Tensor out, py::object lse) {
    Key key;
    Arguments args = tuple_arguments(call);
    if (!make_key(args, key)) throw std::invalid_argument("host path: call not expressible");
    auto found = records_.find(key);
    if (found == records_.end()) throw std::invalid_argument("host path: no record for this call");
    at::Tensor lse_tensor;
    if (!lse.is_none()) lse_tensor = lse.cast<at::Tensor>();
    return execute(found->second, args, &out, lse.is_none() ? nullptr : &lse_tensor);
  }

  // launches: [("ffi", function, [argument...], [slot...])] or [("cuda", CUfunction as an int, its
  // owner, (grid x, y, z), block x, shared bytes, [argument...], [slot...], [ParameterKind...],
  // dependent)]: slot >= 0 names the call tensor an argument is (its data pointer changes per call),
  // -1 a tensor the record holds; scalars are ints/floats. same_slots: Record::same_slots.
  bool add(py::tuple call, py::list launches, std::vector<int64_t> lse_shape,
           std::vector<std::pair<int, int>> same_slots) {
    Key key;
    Arguments args = tuple_arguments(call);
    if (!make_key(args, key)) return false;
    Record record;
    record.lse_shape = std::move(lse_shape);
    for (auto [slot, same] : same_slots) {
      if (slot < 0 || slot >= kSlots || same < 0 || same >= kSlots) return false;
    }
    record.same_slots = std::move(same_slots);
    const at::Tensor& q = THPVariable_Unpack(args[kQ]);
    if (q.is_cuda()) {  // the allocator of a tensor at::empty makes (the caching allocator, or the one set in its place)
      c10::Allocator* allocator = at::empty({1}, q.options()).storage().allocator();
      if (allocator == c10::GetAllocator(c10::DeviceType::CUDA)) record.cuda_allocator = allocator;
    }
    record.out_contiguous = q.strides() == at::IntArrayRef(c10::contiguous_strides(q.sizes()));
    for (py::handle entry : launches) {
      py::tuple spec = entry.cast<py::tuple>();
      std::string kind = spec[0].cast<std::string>();
      if (kind == "cuda" ? !add_cuda(record, spec) : kind != "ffi" || !add_ffi(record, spec)) return false;
    }
    if (record.ffi_launches.empty() == record.cuda_launches.empty()) return false;  // one kind, at least one
    if (records_.size() >= max_records_) records_.clear();  // bounded, as the Python memo tables are
    records_[key] = std::move(record);
    return true;
  }

  // The parameter words of the record of ``call``'s raw launches, with ``call``'s data pointers
  // patched in (what the driver's launch would read): the CPU tests' view of a raw launch.
  std::vector<std::vector<uint64_t>> parameter_words(py::tuple call) {
    Key key;
    Arguments args = tuple_arguments(call);
    if (!make_key(args, key)) throw std::invalid_argument("host path: call not expressible");
    auto found = records_.find(key);
    if (found == records_.end()) throw std::invalid_argument("host path: no record for this call");
    void* data[kSlots] = {};
    call_data(args, data);
    std::vector<std::vector<uint64_t>> words;
    for (CudaLaunch& launch : found->second.cuda_launches) {  // (the words the function takes)
      for (auto& [slot, word] : launch.patched) launch.words[word] = reinterpret_cast<uintptr_t>(data[slot]);
      words.push_back(launch.words);
    }
    return words;
  }

  size_t size() const { return records_.size(); }
  int64_t hits() const { return hits_; }
  void clear() { records_.clear(); }

 private:
  // A tuple's items as Arguments; nullptr unless it holds the call's arguments and the stream.
  Arguments tuple_arguments(const py::tuple& call) const {
    return PyTuple_GET_SIZE(call.ptr()) == layout_.count() ? &PyTuple_GET_ITEM(call.ptr(), 0) : nullptr;
  }

  bool make_key(Arguments args, Key& key) const {
    if (args == nullptr) return false;
    key.clear();
    key.reserve(96);
    for (int i = 0; i < layout_.count(); ++i) {
      int kind = layout_.keys[i];
      if (kind == kKeyNoneOnly) {
        if (args[i] != Py_None) return false;
        key.push_back(-1);
      } else if (!push_argument(key, args[i], kind == kKeyTensor)) {
        // (a tensor where the call takes a scalar is a miss: the key would hold its metadata, not its value)
        return false;
      }
    }
    return true;
  }

  void* stream(Arguments args) const { return PyLong_AsVoidPtr(args[layout_.stream_position]); }

  // Whether the driver says the call's stream is not capturing a CUDA graph (a captured call must get
  // buffers of its own from the Python path, docs/design.md "Host path"); false where it cannot tell.
  bool driver_says_not_capturing(Arguments args) const {
    const Driver& driver = Driver::get();
    if (driver.stream_is_capturing == nullptr) return false;
    int status = 1;  // CU_STREAM_CAPTURE_STATUS_NONE is 0
    return driver.stream_is_capturing(stream(args), &status) == 0 && status == 0;
  }

  // One TVM-FFI launch from spec ("ffi", function, arguments, slots); false for an argument type
  // it does not take, and always without TVM-FFI.
  bool add_ffi(Record& record, py::tuple spec) {
#ifdef FLASHDECODE_TVM_FFI
    FfiLaunch launch;
    launch.function = spec[1].cast<py::object>();
    launch.handle = reinterpret_cast<TVMFFIObjectHandle>(launch.function.attr("__chandle__")().cast<uintptr_t>());
    py::list values = spec[2].cast<py::list>();
    py::list slots = spec[3].cast<py::list>();
    for (size_t i = 0; i < values.size(); ++i) {
      auto argument = std::make_unique<Argument>();
      PyObject* value = values[i].ptr();
      TVMFFIAny any{};
      if (THPVariable_Check(value)) {
        const at::Tensor& tensor = THPVariable_Unpack(value);
        argument->slot = slots[i].cast<int>();
        if (argument->slot == kConstant) argument->held = tensor;
        fill_template(*argument, tensor);
        if (tensor.is_cuda()) {
          record.device_type = kDLCUDA;
          record.device_id = static_cast<int>(tensor.device().index());
        }
        any.type_index = kTVMFFIDLTensorPtr;
        any.v_ptr = &argument->tensor;
        if (argument->slot != kConstant) launch.patched.emplace_back(argument->slot, &argument->tensor);
      } else if (PyBool_Check(value)) {
        any.type_index = kTVMFFIBool;
        any.v_int64 = value == Py_True;
      } else if (PyLong_Check(value)) {
        any.type_index = kTVMFFIInt;
        any.v_int64 = PyLong_AsLongLong(value);
      } else if (PyFloat_Check(value)) {
        any.type_index = kTVMFFIFloat;
        any.v_float64 = PyFloat_AsDouble(value);
      } else {
        return false;
      }
      launch.packed.push_back(any);
      launch.arguments.push_back(std::move(argument));
    }
    record.ffi_launches.push_back(std::move(launch));
    return true;
#else
    return false;
#endif
  }

  // One CUDA launch from spec ("cuda", function, owner, grid, block, shared, arguments, slots, kinds); false
  // when an argument does not fit its kind or the function's parameters (where the driver can say)
  // are not the words given.
  bool add_cuda(Record& record, py::tuple spec) {
    CudaLaunch launch;
    launch.function = reinterpret_cast<void*>(spec[1].cast<uintptr_t>());
    launch.owner = spec[2].cast<py::object>();
    py::tuple grid = spec[3].cast<py::tuple>();
    for (int d = 0; d < 3; ++d) launch.grid[d] = grid[d].cast<unsigned>();
    launch.block = spec[4].cast<unsigned>();
    launch.shared = spec[5].cast<unsigned>();
    py::list values = spec[6].cast<py::list>();
    py::list slots = spec[7].cast<py::list>();
    py::list kinds = spec[8].cast<py::list>();
    launch.dependent = spec[9].cast<bool>();
    if (values.size() != kinds.size() || values.size() != slots.size()) return false;
    if (launch.dependent && Driver::get().launch_kernel_ex == nullptr) return false;  // the Python path launches it
    launch.words.assign(values.size(), 0);
    for (size_t i = 0; i < values.size(); ++i) {
      PyObject* value = values[i].ptr();
      int kind = kinds[i].cast<int>();
      if (kind < 0 || kind >= kParameterKinds) return false;
      uint64_t& word = launch.words[i];
      if (value == Py_None) {
        if (kind != kPointer) return false;  // a null pointer (Triton's scratch buffers)
      } else if (THPVariable_Check(value)) {
        if (kind != kPointer) return false;
        const at::Tensor& tensor = THPVariable_Unpack(value);
        int slot = slots[i].cast<int>();
        word = reinterpret_cast<uintptr_t>(tensor.data_ptr());
        if (slot == kConstant) {
          launch.held.push_back(tensor);
        } else {
          launch.patched.emplace_back(slot, i);
        }
      } else if (PyFloat_Check(value) && kind == kFloat32) {
        float single = static_cast<float>(PyFloat_AsDouble(value));
        std::memcpy(&word, &single, sizeof single);
      } else if (PyLong_Check(value) && (kind == kInt32 || kind == kInt64 || kind == kInt8)) {
        int overflow = 0;
        int64_t integer = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) return false;
        if (kind == kInt32) {
          int32_t narrow = static_cast<int32_t>(integer);
          if (narrow != integer) return false;
          std::memcpy(&word, &narrow, sizeof narrow);
        } else if (kind == kInt8) {
          int8_t narrow = static_cast<int8_t>(integer);
          if (narrow != integer) return false;
          std::memcpy(&word, &narrow, sizeof narrow);
        } else {
          std::memcpy(&word, &integer, sizeof integer);
        }
      } else {
        return false;
      }
    }
    const Driver& driver = Driver::get();
    if (real_launches_ && driver.func_get_param_info != nullptr) {  // where the driver can tell
      size_t count = 0, offset = 0, size = 0;
      while (count <= values.size() && driver.func_get_param_info(launch.function, count, &offset, &size) == 0) {
        if (count < values.size() && size != kParameterSize[kinds[count].cast<int>()]) return false;
        ++count;
      }
      if (count > values.size()) return false;
      for (size_t i = count; i < values.size(); ++i) {  // trailing null pointers the function does not take
        if (values[i].ptr() != Py_None) return false;
      }
      launch.words.resize(count);
    }
    for (uint64_t& word : launch.words) launch.parameters.push_back(&word);
    record.cuda_context = driver.current_context();
    record.cuda_launches.push_back(std::move(launch));
    return true;
  }

  void call_data(Arguments args, void** data) const {
    for (size_t slot = 0; slot < layout_.slot_positions.size(); ++slot) {
      PyObject* object = args[layout_.slot_positions[slot]];
      if (object != Py_None && THPVariable_Check(object)) data[slot] = THPVariable_Unpack(object).data_ptr();
    }
  }

  py::object execute(Record& record, Arguments args, at::Tensor* out_given, at::Tensor* lse_given) {
    const Driver& driver = Driver::get();
    if (!record.cuda_launches.empty() && driver.current_context() != record.cuda_context) {
      if (out_given != nullptr) throw std::invalid_argument("host path: another CUDA context is current");
      return py::none();  // the functions belong to another device's context: the Python path
    }
    void* data[kSlots] = {};
    call_data(args, data);
    for (auto [slot, same] : record.same_slots) {
      if (data[slot] != data[same]) {  // the record's launches take one of the two: the Python path
        if (out_given != nullptr) throw std::invalid_argument("host path: the record's aliased tensors differ");
        return py::none();
      }
    }
    const at::Tensor& q = THPVariable_Unpack(args[kQ]);
    at::Tensor out;
    if (out_given != nullptr) {
      out = *out_given;
    } else if (args[layout_.out_position] != Py_None) {
      out = THPVariable_Unpack(args[layout_.out_position]);
    } else if (record.out_contiguous) {
      out = empty_contiguous(record, q, q.sizes(), q.scalar_type());
    } else {
      out = at::empty_like(q);
    }
    data[layout_.out_slot] = out.data_ptr();
    int want_lse = PyObject_IsTrue(args[layout_.return_lse_position]);  // keyed as a bool, int or None
    if (want_lse < 0) throw py::error_already_set();
    at::Tensor lse;
    if (lse_given != nullptr) {
      lse = *lse_given;
    } else if (want_lse) {
      lse = empty_contiguous(record, q, record.lse_shape, at::kFloat);
    }
    if (lse.defined()) data[kLseSlot] = lse.data_ptr();

    if (!record.cuda_launches.empty()) {
      void* on = stream(args);
      for (CudaLaunch& launch : record.cuda_launches) {
        for (auto& [slot, word] : launch.patched) launch.words[word] = reinterpret_cast<uintptr_t>(data[slot]);
        if (launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0) continue;
        int status = driver.launch(launch.function, launch.grid, launch.block, launch.shared, on,
                                   launch.parameters.data(), launch.dependent);
        if (status != 0) {
          const char* called = launch.dependent ? "cuLaunchKernelEx" : "cuLaunchKernel";
          throw std::runtime_error(
              std::string("flashdecode's compiled host path: ") + called + " failed (CUresult " +
              std::to_string(status) + "); set FLASHDECODE_HOST_PATH=0 to see the error from the Python path");
        }
      }
      if (want_lse && lse_given == nullptr) return py::make_tuple(out, lse);
      return py::cast(out);
    }
    launch_ffi(record, args, data);
    if (want_lse && lse_given == nullptr) return py::make_tuple(out, lse);
    return py::cast(out);
  }

  // The record's TVM-FFI launches on the call's stream, with the call's data pointers.
  void launch_ffi(Record& record, Arguments args, void** data) const {
#ifdef FLASHDECODE_TVM_FFI
    TVMFFIStreamHandle previous = nullptr;
    bool on_cuda = record.device_type == kDLCUDA;
    if (on_cuda) {
      TVMFFIEnvSetStream(kDLCUDA, record.device_id, stream(args), &previous);
    }
    int failed = 0;
    for (FfiLaunch& launch : record.ffi_launches) {
      for (auto& [slot, tensor] : launch.patched) tensor->data = data[slot];
      TVMFFIAny result{};
      result.type_index = kTVMFFINone;
      failed = TVMFFIFunctionCall(launch.handle, launch.packed.data(), static_cast<int32_t>(launch.packed.size()),
                                  &result);
      if (failed) break;
      if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
    }
    if (on_cuda) TVMFFIEnvSetStream(kDLCUDA, record.device_id, previous, nullptr);
    if (failed) {
      TVMFFIObjectHandle error = nullptr;
      TVMFFIErrorMoveFromRaised(&error);
      if (error != nullptr) TVMFFIObjectDecRef(error);
      throw std::runtime_error(
          "flashdecode's compiled host path: a kernel launch failed; set FLASHDECODE_HOST_PATH=0 to see the "
          "error from the Python path");
    }
#endif
  }

  size_t max_records_;
  bool real_launches_;
  Layout layout_;
  int64_t hits_ = 0;
  std::unordered_map<Key, Record, KeyHash> records_;
  Key key_;  // reused by run: no allocation on a hit
};

// ``HostPath.run_function()``: ``run`` as a METH_FASTCALL function bound to one HostPath, taking the
// call's arguments and the stream positionally: neither an argument tuple nor pybind11's dispatch on the
// path every eager call takes (docs/design.md, "Host path"). Its self is a capsule of the HostPath
// that holds a reference to the Python object owning it.
constexpr const char* kRunCapsule = "flashdecode.HostPath";

PyObject* run_positional(PyObject* capsule, PyObject* const* args, Py_ssize_t count) {
  auto* path = static_cast<HostPath*>(PyCapsule_GetPointer(capsule, kRunCapsule));
  if (path == nullptr) return nullptr;
  if (count != path->argument_count()) {
    PyErr_Format(PyExc_TypeError, "HostPath.run takes %d arguments (the call's, then the stream), got %zd",
                 path->argument_count(), count);
    return nullptr;
  }
  try {
    return path->run(args).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

PyMethodDef run_method = {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(run_positional)),
                          METH_FASTCALL, "out, (out, lse), or None on a miss: the call's arguments, then the stream."};

void release_owner(PyObject* capsule) { Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(capsule))); }

py::object run_function(py::object self) {
  HostPath* path = self.cast<HostPath*>();
  PyObject* capsule = PyCapsule_New(path, kRunCapsule, release_owner);
  if (capsule == nullptr) throw py::error_already_set();
  PyCapsule_SetContext(capsule, self.inc_ref().ptr());
  PyObject* function = PyCFunction_New(&run_method, capsule);
  Py_DECREF(capsule);
  if (function == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(function);
}

#ifdef FLASHDECODE_TVM_FFI
// A TVM-FFI function that records what it is called with, the CPU tests' stand-in for a kernel:
// a tensor as its data pointer, an int as itself, a float as itself. When the last argument is a
// float, it also fills its first argument (a contiguous float32 CPU tensor) with that value.
std::vector<py::list>& recorded() {
  static auto* calls = new std::vector<py::list>();  // never destroyed: Python objects outlive no GIL
  return *calls;
}

int record_call(void*, const TVMFFIAny* args, int32_t count, TVMFFIAny* result) {
  py::gil_scoped_acquire gil;
  py::list call;
  for (int32_t i = 0; i < count; ++i) {
    const TVMFFIAny& arg = args[i];
    if (arg.type_index == kTVMFFIDLTensorPtr) {
      call.append(reinterpret_cast<uintptr_t>(static_cast<DLTensor*>(arg.v_ptr)->data));
    } else if (arg.type_index == kTVMFFIFloat) {
      call.append(arg.v_float64);
    } else {
      call.append(arg.v_int64);
    }
  }
  if (count > 1 && args[count - 1].type_index == kTVMFFIFloat && args[0].type_index == kTVMFFIDLTensorPtr) {
    DLTensor* tensor = static_cast<DLTensor*>(args[0].v_ptr);
    int64_t elements = 1;
    for (int32_t d = 0; d < tensor->ndim; ++d) elements *= tensor->shape[d];
    float* data = static_cast<float*>(tensor->data);
    for (int64_t e = 0; e < elements; ++e) data[e] = static_cast<float>(args[count - 1].v_float64);
  }
  recorded().push_back(call);
  result->type_index = kTVMFFINone;
  return 0;
}

void register_recorder() {
  TVMFFIObjectHandle function = nullptr;
  if (TVMFFIFunctionCreate(nullptr, record_call, nullptr, &function) != 0) return;
  static const char name[] = "flashdecode.host_path.record";
  TVMFFIByteArray bytes{name, sizeof(name) - 1};
  TVMFFIFunctionSetGlobal(&bytes, function, 1);
  TVMFFIObjectDecRef(function);
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("MAX_CALL_SLOTS") = kMaxCallSlots;
  m.attr("LSE_SLOT") = kLseSlot;
  m.attr("ARGUMENT_KEYS") = static_cast<int>(kArgumentKeys);
  m.attr("PARAMETER_KINDS") = static_cast<int>(kParameterKinds);
#ifdef FLASHDECODE_TVM_FFI
  m.attr("TVM_FFI") = true;
  register_recorder();
  m.def("recorded_calls", [] {
    py::list calls;
    for (const py::list& call : recorded()) calls.append(call);
    recorded().clear();
    return calls;
  }, "The calls the recorder (TVM-FFI global flashdecode.host_path.record) took since the last read.");
#else
  m.attr("TVM_FFI") = false;
#endif
  py::class_<HostPath>(m, "HostPath")
      .def(py::init<size_t, bool, const std::vector<int>&, int, int>())
      .def_property_readonly("hits", &HostPath::hits)
      .def("run_function", &run_function)
      .def("replay", &HostPath::replay)
      .def("add", &HostPath::add, py::arg("call"), py::arg("launches"), py::arg("lse_shape"),
           py::arg("same_slots") = std::vector<std::pair<int, int>>())
      .def("parameter_words", &HostPath::parameter_words)
      .def("clear", &HostPath::clear)
      .def("__len__", &HostPath::size);
}
