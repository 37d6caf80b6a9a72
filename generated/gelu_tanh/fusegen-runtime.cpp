// fusegen-runtime.cpp: the part of every fusegen op that does not depend on its expression.
// Compiled once per torch/CUDA version into a shared library that op libraries link
// against (or, in a standalone build of generated/<name>/, into the op's own library).
// Each op describes itself with an OpDef (fusegen-runtime.h) and calls register_op; this
// file turns that into the schemas fusegen::<name> and fusegen::<name>_backward with
// boxed CPU, Meta, CUDA and Autograd kernels: argument checks, type promotion, the layout
// of every call by ATen's TensorIterator (broadcasting, strides, memory format, output
// allocation), its parallel CPU loop, the CUDA device guard and stream, and autograd: the
// forward records a hand-written node (FusedBackward) that calls <name>_backward, whose own
// autograd kernel records another (FusedDoubleBackward) that calls <name>_grad2_backward;
// forward-mode AD sets the output's tangent from <name>_jvp, as PyTorch's generated
// autograd kernels do. Hand-written, not templated.
#include "fusegen-runtime.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/TensorIterator.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/native/TypeProperties.h>
#include <torch/csrc/autograd/custom_function.h>  // (with compiled autograd's PackedArgs)
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#ifdef FUSEGEN_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

// The fp16/bf16 conversions of the CPU loop use F16C and AVX2 in functions of their own,
// chosen at run time, so that the library still loads on any x86-64 machine.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define FUSEGEN_X86_CONVERT 1
#include <immintrin.h>
#endif

namespace fusegen {
namespace {

using torch::autograd::variable_list;

// One tensor argument with the name it has in the schema, for error messages.
struct Arg {
  const char* name;
  const at::Tensor& tensor;
};
using Args = std::vector<Arg>;

// Elements per CPU task: large enough that at::parallel_for's overhead is noise.
constexpr int64_t kCpuGrain = 32768;

bool is_computed_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// A 0-dim CPU tensor is allowed with tensors of any device, as eager allows it.
bool is_cpu_scalar(const at::Tensor& t) { return t.dim() == 0 && t.device().is_cpu(); }

// Undefined tensors (None from Python) fail here with the op's and the argument's name,
// before anything asks them for a size, dtype or device.
void check_defined(const std::string& op, const Args& args) {
  for (const Arg& arg : args) {
    TORCH_CHECK(arg.tensor.defined(), "fusegen::", op, ": argument '", arg.name,
                "' is None (an undefined tensor); expected a tensor");
  }
}

// The device the op runs on: that of the first argument that is not a 0-dim CPU tensor.
const Arg& device_arg(const Args& args) {
  for (const Arg& arg : args) {
    if (!is_cpu_scalar(arg.tensor)) return arg;
  }
  return args.front();
}

// Checks every argument (defined, a real dtype, one device) and returns the dtype the op
// computes and returns in: torch's type promotion over the arguments, as eager does (bool
// and integer tensors promote, a 0-dim tensor only within its category). The kernels
// compute in floating point, so a promoted type that is not floating (every argument
// integer or bool, where eager's `a*b+c` would return an integer tensor and its `sigmoid`
// a float one) is refused rather than returned in a dtype eager would not give.
at::ScalarType check_args(const std::string& op, const Args& args) {
  check_defined(op, args);
  const Arg& first = device_arg(args);
  at::native::ResultTypeState state = {};
  for (const Arg& arg : args) {
    const at::Tensor& t = arg.tensor;
    const at::ScalarType type = t.scalar_type();
    TORCH_CHECK(is_computed_dtype(type) || at::isIntegralType(type, /*includeBool=*/true), "fusegen::", op,
                ": argument '", arg.name, "' must be a floating, integer or bool tensor, got ", type);
    TORCH_CHECK(t.device() == first.tensor.device() || is_cpu_scalar(t), "fusegen::", op, ": argument '",
                arg.name, "' is on ", t.device(), ", expected ", first.tensor.device(), " (the device of '",
                first.name, "')");
    state = at::native::update_result_type_state(t, state);
  }
  const at::ScalarType dtype = at::native::result_type(state);
  if (!is_computed_dtype(dtype)) {
    std::string types;
    for (const Arg& arg : args) types += std::string(types.empty() ? "" : ", ") + arg.name + ": " + c10::toString(arg.tensor.scalar_type());
    TORCH_CHECK(false, "fusegen::", op, ": the arguments promote to ", dtype, " (", types,
                "), but fusegen computes in float32, float64, float16 or bfloat16; make one argument "
                "floating (e.g. a.float()), or pass a float number");
  }
  return dtype;
}

// The broadcast shape of all arguments, with an error that names the one that does not fit.
c10::SymDimVector broadcast_shape(const std::string& op, const Args& args) {
  c10::SymDimVector shape;
  for (const Arg& arg : args) {
    const c10::SymIntArrayRef sizes = arg.tensor.sym_sizes();
    const size_t ndim = std::max(shape.size(), sizes.size());
    c10::SymDimVector merged(ndim, c10::SymInt(1));
    for (size_t i = 0; i < ndim; ++i) {
      const c10::SymInt a = i < ndim - shape.size() ? c10::SymInt(1) : shape[i - (ndim - shape.size())];
      const c10::SymInt b = i < ndim - sizes.size() ? c10::SymInt(1) : sizes[i - (ndim - sizes.size())];
      TORCH_CHECK(a == 1 || b == 1 || a == b, "fusegen::", op, ": argument '", arg.name, "' of shape ",
                  sizes, " does not broadcast with shape ", c10::SymIntArrayRef(shape),
                  " of the arguments before it");
      merged[i] = a == 1 ? b : a;
    }
    shape = std::move(merged);
  }
  return shape;
}

// The tensors the kernels read: each in the computed dtype (a converting copy only for an
// argument of another dtype: the kernels read one dtype, as eager's CPU kernels do after
// TensorIterator's own promotion copies) and on the op's device: a 0-dim CPU tensor with
// CUDA tensors becomes a 0-dim device tensor filled from its value (a fill kernel, no host
// synchronisation). Broadcast, strided and channels_last tensors are not copied.
std::vector<at::Tensor> kernel_inputs(const Args& args, at::ScalarType dtype, const c10::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(args.size());
  for (const Arg& arg : args) {
    at::Tensor t = arg.tensor;
    if (t.device() != device) {  // a CPU scalar (check_args allowed nothing else)
      const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
      t = device.is_meta() ? at::empty({}, options) : at::full({}, t.item(), options);
    }
    out.push_back(t.scalar_type() == dtype ? t : t.to(dtype));
  }
  return out;
}

// Symbolic sizes (torch.compile with dynamic shapes, in the Meta impl) cannot go through
// TensorIterator, which needs concrete ones.
bool any_symbolic(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return true;
  }
  return false;
}

// An output of `shape` laid out as TensorIterator lays one out for `inputs`, worked out on
// symbolic sizes and strides (torch.compile with dynamic shapes: the Meta impl, where
// TensorIterator cannot run), so that the Meta strides are the real kernel's; inductor
// asserts them (a transposed input failed there with contiguous Meta outputs). As
// TensorIterator's fast setup: inputs all of the output's shape and all contiguous, all
// channels_last, or all dense with one set of strides give that layout. Otherwise as its
// reorder_dimensions: an insertion sort of the dimensions, fastest first, where the first
// input whose strides tell two dimensions apart decides (a broadcast dimension, stride 0,
// tells nothing; equal strides put the smaller size first), then strides contiguous in
// that order. Comparing symbolic strides guards on the answer, as PyTorch's own
// elementwise meta functions do.
at::Tensor empty_as_iterator(const c10::SymDimVector& shape, const std::vector<at::Tensor>& inputs) {
  const at::TensorOptions options = inputs.front().options();
  const c10::SymIntArrayRef full(shape);
  bool same_shape = true, contiguous = true, channels_last = true, dense = true;
  for (const at::Tensor& t : inputs) {
    same_shape = same_shape && t.sym_sizes() == full;
    contiguous = contiguous && t.is_contiguous();
    channels_last = channels_last && t.is_contiguous(at::MemoryFormat::ChannelsLast);
    dense = dense && t.is_non_overlapping_and_dense() && t.sym_strides() == inputs.front().sym_strides();
  }
  if (same_shape && contiguous) return at::empty_symint(full, options);
  if (same_shape && channels_last) return at::empty_symint(full, options.memory_format(at::MemoryFormat::ChannelsLast));
  if (same_shape && dense) return at::empty_strided_symint(full, inputs.back().sym_strides(), options);
  const size_t ndim = shape.size();
  std::vector<c10::SymDimVector> strides;  // per input, along the output's dimensions
  for (const at::Tensor& t : inputs) {
    const c10::SymIntArrayRef sizes = t.sym_sizes();
    const c10::SymIntArrayRef steps = t.sym_strides();
    const size_t offset = ndim - sizes.size();
    c10::SymDimVector along(ndim, c10::SymInt(0));
    for (size_t d = offset; d < ndim; ++d) {
      if (!(sizes[d - offset] == 1 && shape[d] != 1)) along[d] = steps[d - offset];
    }
    strides.push_back(std::move(along));
  }
  // 1: dimension a goes after b (is slower); -1: before; 0: no input tells.
  const auto order = [&](size_t a, size_t b) {
    for (const c10::SymDimVector& s : strides) {
      if (s[a] == 0 || s[b] == 0) continue;
      if (s[a] < s[b]) return -1;
      if (s[b] < s[a]) return 1;
      if (shape[b] < shape[a]) return 1;
    }
    return 0;
  };
  std::vector<size_t> perm(ndim);  // fastest first, starting from the last dimension
  for (size_t i = 0; i < ndim; ++i) perm[i] = ndim - 1 - i;
  for (size_t i = 1; i < ndim; ++i) {
    size_t b = i;
    for (size_t a = i; a-- > 0;) {
      const int c = order(perm[a], perm[b]);
      if (c > 0) {
        std::swap(perm[a], perm[b]);
        b = a;
      } else if (c < 0) {
        break;
      }
    }
  }
  c10::SymDimVector out(ndim, c10::SymInt(1));
  c10::SymInt next(1);
  for (size_t d : perm) {
    out[d] = next;
    next = next * shape[d];
  }
  return at::empty_strided_symint(full, c10::SymIntArrayRef(out), options);
}

// `num_outputs` new outputs and the inputs, laid out by ATen's TensorIterator: the
// broadcast shape, the outputs allocated in the inputs' dtype with the memory format
// eager would give them (channels_last in, channels_last out), dimensions coalesced and
// ordered for the loop. Works for Meta tensors too, so the Meta impl's strides are the
// real impl's. `sums` (accumulates_in_kernel's float sums, written by the kernel) come
// after the inputs, laid out as inputs: step 0 along the dimensions they sum; undefined
// ones are left out (Operands gives them no operand either). `given`: an output tensor per
// iterator output to write into (SplitHalves: the halves of one gradient), undefined or
// absent ones allocated.
at::TensorIterator make_iterator(int num_outputs, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& sums = {}, c10::ArrayRef<at::Tensor> given = {}) {
  at::TensorIteratorConfig config;
  config.set_check_mem_overlap(false);  // the outputs are new or disjoint; inputs may overlap each other
  if (!sums.empty()) config.check_all_same_dtype(false).declare_static_dtype(inputs.front().scalar_type());
  for (int k = 0; k < num_outputs; ++k) {  // owned: `given` may not outlive the iterator
    config.add_owned_output(k < static_cast<int>(given.size()) ? given[k] : at::Tensor());
  }
  for (const at::Tensor& t : inputs) config.add_const_input(t);
  for (const at::Tensor& t : sums) {
    if (t.defined()) config.add_const_input(t);
  }
  return config.build();
}

Dtype kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return Dtype::kFloat64;
    case at::kHalf: return Dtype::kFloat16;
    case at::kBFloat16: return Dtype::kBFloat16;
    default: return Dtype::kFloat32;
  }
}

// The kernel's operands for one step of TensorIterator's loop: `present[k]` says whether
// output k of the kernel is one of the iterator's outputs (a requested gradient); absent
// ones get a null pointer and stride 0. Inputs follow, as the iterator has them, then (a
// backward that sums in the kernel: fusegen-cuda.cuh, Accumulating) one operand per
// entry of `sums`, the iterator's inputs after the kernel's where defined.
struct Operands {
  std::vector<int> slot;  // per kernel operand: its index in the iterator, or -1

  Operands(const std::vector<bool>& present, int num_inputs, const std::vector<at::Tensor>& sums = {}) {
    int next = 0;
    for (bool p : present) slot.push_back(p ? next++ : -1);
    for (int j = 0; j < num_inputs; ++j) slot.push_back(next++);
    for (const at::Tensor& t : sums) slot.push_back(t.defined() ? next++ : -1);
  }
  int size() const { return static_cast<int>(slot.size()); }
};

// A new CPU output of 4 MiB or more is advised to Linux as transparent huge pages before
// the kernel first writes it, as NumPy advises its arrays (and c10 does with
// THP_MEM_ALLOC_ENABLE=1): the first touch of a 64 MB output then takes 32 page faults of
// 2 MB instead of 16384 of 4 KB, which were half of `a*b+c`'s forward on the 2-core CPU
// machine (README, "CPU benchmark"). Advice only: the memory stays the allocator's, and a
// kernel set to `never` ignores it. Outputs not wanted (undefined) are skipped.
void advise_huge_pages(const std::vector<at::Tensor>& outputs) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t(1) << 21;
  for (const at::Tensor& t : outputs) {
    if (!t.defined()) continue;
    const std::size_t bytes = t.storage().nbytes();
    if (bytes < (std::size_t(1) << 22)) continue;
    const auto start = reinterpret_cast<std::uintptr_t>(t.storage().data());
    const std::uintptr_t begin = (start + kHuge - 1) & ~(kHuge - 1);
    const std::uintptr_t end = (start + bytes) & ~(kHuge - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#else
  (void)outputs;
#endif
}

// The CPU kernel over the iterator: TensorIterator::for_each splits it over threads
// (at::parallel_for) and calls back with 1-D runs; each run goes to the kernel with the
// kernel's operand order (absent outputs null).
void launch_cpu(at::TensorIterator& iter, const Operands& ops, CpuKernel kernel, Dtype dtype, const double* scalars) {
  const int count = ops.size();
  iter.for_each([&](char** data, const int64_t* strides, int64_t n) {
    c10::SmallVector<char*, 16> d(count);
    c10::SmallVector<int64_t, 16> s(count);
    for (int k = 0; k < count; ++k) {
      const int i = ops.slot[k];
      d[k] = i < 0 ? nullptr : data[i];
      s[k] = i < 0 ? 0 : strides[i];
    }
    kernel(dtype, d.data(), s.data(), n, scalars);
  }, kCpuGrain);
}

#ifdef FUSEGEN_WITH_CUDA
// The CUDA kernel over the whole iterator, on the current stream: pointers, and sizes and
// byte strides unless it is contiguous.
void launch_cuda(const at::TensorIterator& iter, const Operands& ops, CudaKernel kernel, Dtype dtype,
                 const double* scalars) {
  const int count = ops.size();
  std::vector<char*> data(count);
  for (int k = 0; k < count; ++k) data[k] = ops.slot[k] < 0 ? nullptr : static_cast<char*>(iter.data_ptr(ops.slot[k]));
  // Contiguous after coalescing: the kernels' 16-byte path needs no strides.
  const bool contiguous = iter.is_contiguous();
  const int ndim = contiguous ? 0 : iter.ndim();
  TORCH_INTERNAL_ASSERT(ndim <= kMaxDims);
  std::vector<int64_t> sizes(iter.shape().begin(), iter.shape().end());
  std::vector<int64_t> strides(static_cast<size_t>(ndim) * count, 0);
  for (int d = 0; d < ndim; ++d) {
    for (int k = 0; k < count; ++k) {
      if (ops.slot[k] >= 0) strides[d * count + k] = iter.strides(ops.slot[k])[d];
    }
  }
  const CudaLoop loop{iter.numel(), ndim, count, sizes.data(), strides.data(), data.data()};
  kernel(dtype, loop, scalars, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

// ---------------------------------------------------------------------------------------
// One registered op: its descriptor, plus the names the runtime derives from it.

struct Op {
  const OpDef* def;
  std::string name;           // "<name>"
  std::string backward_name;  // "<name>_backward"
  std::string backward_event;  // "fusegen::<name>_backward": the profiler's name of a backward call
  std::string node_name;      // "FusedBackward(fusegen::<name>)": its autograd node's name (grad_fn.name(),
                              // the profiler's backward events; not "fusegen::...", which names ops)
  std::string double_node_name;  // "FusedDoubleBackward(fusegen::<name>_backward)": the backward's node
  std::optional<c10::OperatorHandle> forward_op;   // fusegen::<name>, looked up once
  std::optional<c10::OperatorHandle> backward_op;  // fusegen::<name>_backward
  bool has_backward() const { return def->num_kernel_grads > 0; }
};

// A tensor argument off the dispatcher's stack; None (from Python) is an undefined tensor,
// which check_defined reports by name.
at::Tensor tensor_arg(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }

// The forward's arguments off the stack (tensors, then scalars), which stay on it.
struct ForwardArgs {
  std::vector<at::Tensor> tensors;
  std::vector<double> scalars;

  ForwardArgs(const OpDef& def, const torch::jit::Stack& stack) {
    const size_t first = stack.size() - def.num_inputs - def.num_scalars;
    for (int i = 0; i < def.num_inputs; ++i) tensors.push_back(tensor_arg(stack[first + i]));
    for (int i = 0; i < def.num_scalars; ++i) scalars.push_back(stack[first + def.num_inputs + i].toDouble());
  }
  Args named(const OpDef& def) const {
    Args args;
    for (int i = 0; i < def.num_inputs; ++i) args.push_back({def.input_names[i], tensors[i]});
    return args;
  }
};

// The backward's arguments: dout, the inputs it reads, its scalars, output_mask.
struct BackwardArgs {
  std::vector<at::Tensor> tensors;  // dout first
  std::vector<double> scalars;
  std::vector<bool> mask;

  BackwardArgs() = default;
  BackwardArgs(const OpDef& def, const torch::jit::Stack& stack) {
    const size_t count = 1 + def.num_backward_inputs + def.num_backward_scalars + 1;
    const size_t first = stack.size() - count;
    for (int i = 0; i <= def.num_backward_inputs; ++i) tensors.push_back(tensor_arg(stack[first + i]));
    for (int i = 0; i < def.num_backward_scalars; ++i) {
      scalars.push_back(stack[first + 1 + def.num_backward_inputs + i].toDouble());
    }
    const c10::List<bool> list = stack[first + count - 1].toBoolList();
    // The schema's bool[K] is not checked by the dispatcher: a longer or shorter mask would
    // index past the kernel's outputs.
    TORCH_CHECK(static_cast<int>(list.size()) == def.num_kernel_grads, "fusegen::", def.name,
                "_backward: argument 'output_mask' must have ", def.num_kernel_grads,
                " entries (one per gradient the backward kernel computes), got ", list.size());
    for (bool b : list) mask.push_back(b);
  }
  // Named arguments (dout, then the tensors the backward reads, by the user's names).
  static Args of(const OpDef& def, const std::vector<at::Tensor>& tensors) {
    Args args{{"dout", tensors[0]}};
    for (int i = 0; i < def.num_backward_inputs; ++i) args.push_back({def.backward_input_names[i], tensors[i + 1]});
    return args;
  }
  Args named(const OpDef& def) const { return of(def, tensors); }
  void push(torch::jit::Stack& stack) const {
    for (const at::Tensor& t : tensors) stack.emplace_back(t);
    for (double s : scalars) stack.emplace_back(s);
    c10::List<bool> list;
    for (bool b : mask) list.push_back(b);
    stack.emplace_back(std::move(list));
  }
};

// The gradients that were asked for (defined), in order: what <name>_backward returns.
std::vector<at::Tensor> requested(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& g : grads) {
    if (g.defined()) out.push_back(g);
  }
  return out;
}

enum class Device { kCpu, kMeta, kCuda };

// The common case of a training step: every tensor of the computed dtype, on the op's
// device, of one shape with the contiguous strides and no dimension of size 0 or 1 (where
// TensorIterator may order dimensions of equal strides differently). TensorIterator lays
// it out as one contiguous run with contiguous outputs; building it is about 0.3 us of a
// call (CPU machine, n = 4096), so this case skips it (run_contiguous) with the same result.
bool is_plain_contiguous(const Args& args, at::ScalarType dtype, c10::Device device) {
  const at::Tensor& first = args.front().tensor;
  if (first.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  const c10::IntArrayRef sizes = first.sizes();
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1, stride = 1; d >= 0; stride *= sizes[d--]) {
    if (sizes[d] < 2 || first.strides()[d] != stride) return false;
  }
  for (const Arg& arg : args) {
    const at::Tensor& t = arg.tensor;
    if (t.scalar_type() != dtype || t.device() != device || t.layout() != at::kStrided) return false;
    if (&t != &first && (t.sizes() != sizes || t.strides() != first.strides())) return false;
  }
  return true;
}

// The kernel over is_plain_contiguous arguments: contiguous outputs (present[k]) of their
// shape, one run of numel elements (on the CPU, on one thread: run_kernel sends a run that
// threads would split to TensorIterator); returns the outputs, as run_kernel does.
std::vector<at::Tensor> run_contiguous(const Args& args, const std::vector<bool>& present, Device device, CpuKernel cpu,
                                       CudaKernel cuda, Dtype dtype, const double* scalars) {
  const at::Tensor& first = args.front().tensor;
  std::vector<at::Tensor> outputs(present.size());
  c10::SmallVector<char*, 16> data;
  c10::SmallVector<int64_t, 16> strides;
  const int64_t size = static_cast<int64_t>(first.element_size());
  for (size_t k = 0; k < present.size(); ++k) {
    // On the CPU straight from the allocator, as eager's structured kernels allocate their
    // outputs (at::empty's trip through the dispatcher was a sixth of a call at n = 1024).
    // The kernel writes every element, so nothing differs from at::empty's tensor.
    if (present[k]) {
      outputs[k] = device == Device::kCpu ? at::Tensor(at::detail::empty_cpu(first.sizes(), first.options()))
                                          : at::empty(first.sizes(), first.options());
    }
    data.push_back(present[k] ? static_cast<char*>(outputs[k].data_ptr()) : nullptr);
    strides.push_back(present[k] ? size : 0);
  }
  for (const Arg& arg : args) {
    data.push_back(static_cast<char*>(const_cast<void*>(arg.tensor.const_data_ptr())));
    strides.push_back(size);
  }
  const int64_t n = first.numel();
  if (device == Device::kCpu) {
    advise_huge_pages(outputs);
    cpu(dtype, data.data(), strides.data(), n, scalars);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    // What launch_cuda hands the kernel for a contiguous iterator (ndim 0: no strides).
    const CudaLoop loop{n, 0, static_cast<int>(data.size()), first.sizes().data(), nullptr, data.data()};
    cuda(dtype, loop, scalars, c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
    (void)cuda;
#endif
  }
  return outputs;
}

// What the forward and the backward share: check the arguments, then lay out `num_outputs`
// outputs over the kernel's inputs and run `cpu` or `cuda` on them. present[k]: whether the
// kernel's output k is wanted (allocated); returns the outputs, an undefined tensor for
// each absent one. given[k] (optional, per kernel output): a tensor of the broadcast shape
// and the computed dtype that output k is written into instead of a new one.
std::vector<at::Tensor> run_kernel(const std::string& name, Device device, const Args& args,
                                   const std::vector<bool>& present, CpuKernel cpu, CudaKernel cuda,
                                   const double* scalars, const std::vector<at::Tensor>& given = {}) {
  const at::ScalarType dtype = check_args(name, args);
  const c10::Device on = device_arg(args).tensor.device();
#ifdef FUSEGEN_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> device_guard;
  if (device == Device::kCuda) device_guard.emplace(on);  // checked: one device
#endif
  // On the CPU only where one thread runs it anyway: at::parallel_for, a header template,
  // splits work over threads only in a unit compiled with -fopenmp, which this one is not,
  // while TensorIterator::for_each (compiled into libtorch) splits it as eager's ops do.
  const bool serial = device != Device::kCpu || args.front().tensor.numel() < kCpuGrain ||
                      at::get_num_threads() == 1;
  if (device != Device::kMeta && given.empty() && serial && is_plain_contiguous(args, dtype, on)) {
    return run_contiguous(args, present, device, cpu, cuda, kernel_dtype(dtype), scalars);
  }
  const std::vector<at::Tensor> inputs = kernel_inputs(args, dtype, on);
  int num_outputs = 0;
  for (bool p : present) num_outputs += p;
  std::vector<at::Tensor> outputs(present.size());
  if (device == Device::kMeta && any_symbolic(inputs)) {
    const c10::SymDimVector shape = broadcast_shape(name, args);
    for (size_t k = 0; k < present.size(); ++k) {
      if (present[k]) outputs[k] = empty_as_iterator(shape, inputs);
    }
    return outputs;
  }
  // TensorIterator checks the broadcast; only when it fails is the shape worked out again,
  // for an error that names the argument that does not fit (not on every call).
  at::TensorIterator iter = [&] {
    try {
      std::vector<at::Tensor> into;  // given, per iterator output
      for (size_t k = 0; k < given.size(); ++k) {
        if (present[k]) into.push_back(given[k]);
      }
      return make_iterator(num_outputs, inputs, {}, into);
    } catch (const c10::Error&) {
      broadcast_shape(name, args);  // throws the named error when the shapes are the cause
      throw;
    }
  }();
  for (size_t k = 0, next = 0; k < present.size(); ++k) {
    if (present[k]) outputs[k] = iter.output(static_cast<int64_t>(next++));
  }
  if (device == Device::kMeta || iter.numel() == 0 || num_outputs == 0) return outputs;
  const Operands ops(present, static_cast<int>(inputs.size()));
  if (device == Device::kCpu) {
    advise_huge_pages(outputs);
    launch_cpu(iter, ops, cpu, kernel_dtype(dtype), scalars);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    launch_cuda(iter, ops, cuda, kernel_dtype(dtype), scalars);
#else
    (void)cuda;
#endif
  }
  return outputs;
}

// The forward on one device: one output.
at::Tensor run_forward(const Op& op, Device device, const ForwardArgs& a) {
  const OpDef& def = *op.def;
  return run_kernel(op.name, device, a.named(def), {true}, def.forward_cpu, def.forward_cuda, a.scalars.data())[0];
}

// The backward on one device: the gradients selected by output_mask, in order, at the
// broadcast shape (the autograd Function sums them to each input's shape).
std::vector<at::Tensor> run_backward(const Op& op, Device device, const BackwardArgs& a,
                                     const std::vector<at::Tensor>& given = {}) {
  const OpDef& def = *op.def;
  return requested(run_kernel(op.backward_name, device, a.named(def), a.mask, def.backward_cpu, def.backward_cuda,
                              a.scalars.data(), given));
}

// ---------------------------------------------------------------------------------------
// Autograd: the forward redispatches below autograd to fusegen::<name>; the backward calls
// fusegen::<name>_backward. Both go through the dispatcher, so torch.compile and opcheck
// see ordinary ops.

// What a gradient needs of its input: the dtype and the sizes it is summed back to.
struct InputMeta {
  at::ScalarType dtype;
  c10::SymDimVector sizes;

  explicit InputMeta(const at::Tensor& t) : dtype(t.scalar_type()), sizes(t.sym_sizes().begin(), t.sym_sizes().end()) {}
  InputMeta(at::ScalarType type, c10::SymIntArrayRef shape) : dtype(type), sizes(shape.begin(), shape.end()) {}
};

// Each input's dtype and sizes in one list (compiled autograd's packed state): per input,
// the dtype, the number of dimensions, the sizes.
std::vector<c10::SymInt> pack_metadata(c10::ArrayRef<InputMeta> meta) {
  std::vector<c10::SymInt> packed;
  for (const InputMeta& m : meta) {
    packed.emplace_back(static_cast<int64_t>(m.dtype));
    packed.emplace_back(static_cast<int64_t>(m.sizes.size()));
    packed.insert(packed.end(), m.sizes.begin(), m.sizes.end());
  }
  return packed;
}

std::vector<InputMeta> unpack_metadata(const std::vector<c10::SymInt>& all) {
  std::vector<InputMeta> out;
  for (size_t k = 0; k < all.size();) {
    const auto dtype = static_cast<at::ScalarType>(all[k].expect_int());
    const int64_t ndim = all[k + 1].expect_int();
    out.emplace_back(dtype, c10::SymIntArrayRef(all.data() + k + 2, static_cast<size_t>(ndim)));
    k += 2 + ndim;
  }
  return out;
}

// A gradient computed at the broadcast shape, summed back to the input's shape and cast
// to its dtype. A gradient that already fits is returned as is (no kernel: at::sum_to
// sums even then when the shape is 0-d).
at::Tensor reduce_to_input(const InputMeta& meta, const at::Tensor& grad) {
  const c10::SymIntArrayRef sizes(meta.sizes);
  at::Tensor g = grad.sym_sizes() == sizes ? grad : at::sum_to(grad, sizes);
  return g.scalar_type() == meta.dtype ? g : g.to(meta.dtype);
}

// A gradient of dout alone (GradDef::steps): the eager ops, in order.
at::Tensor apply_steps(const GradDef& grad, const at::Tensor& dout) {
  at::Tensor g = dout;
  for (int s = 0; s < grad.num_steps; ++s) {
    const DoutStep& step = grad.steps[s];
    g = step.op == '-' ? at::neg(g) : step.op == '*' ? at::mul(g, step.value) : at::div(g, step.value);
  }
  return g;
}

// The backward kernel's outputs that the gradients for which needs(i) holds come from
// (`mask`: one per distinct gradient, identical ones share it), and whether the kernel
// must run: when every requested one is also a function of dout alone, eager ops on dout
// compute them instead (they read dout only, the kernel would read the inputs too).
struct KernelRequest {
  std::vector<bool> mask;
  bool run = false;
};

template <typename Needs>
KernelRequest kernel_request(const OpDef& def, Needs&& needs) {
  KernelRequest r{std::vector<bool>(def.num_kernel_grads, false)};
  for (int i = 0; i < def.num_inputs; ++i) {
    const GradDef& g = def.grads[i];
    if (!needs(i) || g.output < 0) continue;
    r.mask[g.output] = true;
    r.run = r.run || g.num_steps < 0;
  }
  return r;
}

// The gradients of `def`'s inputs for which needs(i) holds, into grads[i], from the kernel
// outputs kernel_request asks for or from eager ops on dout. `call(mask)` runs the
// backward kernel (through the dispatcher, or directly: first_order_grads) and returns the
// requested outputs.
template <typename Needs, typename Call>
void gradients_of(const OpDef& def, const at::Tensor& dout, c10::ArrayRef<InputMeta> meta, Needs&& needs,
                  Call&& call, variable_list& grads) {
  const KernelRequest request = kernel_request(def, needs);
  std::vector<at::Tensor> computed(def.num_kernel_grads);
  if (request.run) {
    const std::vector<at::Tensor> out = call(request.mask);
    for (int k = 0, next = 0; k < def.num_kernel_grads; ++k) {
      if (request.mask[k]) computed[k] = out[next++];
    }
  }
  std::vector<at::Tensor> from_dout(def.num_inputs);  // by the first input with the same steps
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    at::Tensor full = g.output >= 0 ? computed[g.output] : at::Tensor();
    if (!full.defined() && g.num_steps >= 0) {
      for (int j = 0; j < i && !full.defined(); ++j) {
        if (from_dout[j].defined() && def.grads[j].steps == g.steps && def.grads[j].num_steps == g.num_steps) full = from_dout[j];
      }
      if (!full.defined()) full = from_dout[i] = apply_steps(g, dout);
    }
    if (full.defined()) grads[i] = reduce_to_input(meta[i], full);
  }
}

// The node pointer of this torch's autograd graph: std::shared_ptr<Node> up to torch 2.12
// (made with deleteNode, which frees a long graph without deep recursion), and
// c10::intrusive_ptr<Node> from 2.13 on. Both spellings compile: only the matching one is
// instantiated (deleteNode is found through its argument, when it exists).
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename Ptr>
struct NodeMaker;
template <typename N>
struct NodeMaker<c10::intrusive_ptr<N>> {
  template <typename T, typename... A>
  static NodePtr make(A&&... args) { return c10::make_intrusive<T>(std::forward<A>(args)...); }
};
template <typename N>
struct NodeMaker<std::shared_ptr<N>> {
  template <typename T, typename... A>
  static NodePtr make(A&&... args) {
    return std::shared_ptr<T>(new T(std::forward<A>(args)...), [](N* node) { deleteNode(node); });
  }
};

const Op* find_op(const std::string& name);

// An auxiliary op of the family (<name>_grad2, <name>_jvp): fusegen's Python side builds
// them on first use, not with the op, and registers fusegen::__auxiliary, which builds and
// loads the one named (its library registers it here) and returns once it is. A standalone
// build has them in its own library, and no hook. nullptr: not loaded, and no way to load it.
const Op* find_auxiliary(const std::string& name) {
  if (const Op* op = find_op(name)) return op;
  const auto hook = c10::Dispatcher::singleton().findOp({"fusegen::__auxiliary", ""});
  if (!hook.has_value()) return nullptr;
  torch::jit::Stack stack;
  stack.emplace_back(name);
  hook->callBoxed(stack);
  return find_op(name);
}

// A plain dense CPU or CUDA tensor: no subclass (DTensor, FakeTensor, functorch's
// wrappers), no lazy conjugate or negative view, no symbolic sizes.
bool is_plain(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Conjugate,
                                            c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  return t.defined() && (t.is_cpu() || t.is_cuda()) && t.layout() == at::kStrided && !t.key_set().has_any(wrapped) &&
         !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// Whether t has a forward-mode tangent. Level 0 is the one level eager forward AD has, and
// torch.func's jvp gives each of its levels wrapper tensors of their own, whose tangent is
// at level 0 too: PyTorch's generated autograd kernels read the same (isFwGradDefined). A
// tensor without autograd metadata (no requires_grad, no tangent) answers with a pointer test.
bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// Whether a backward may run its kernel directly instead of through the dispatcher: grad
// mode off (nothing to record for a double backward), no forward-mode tangent (forward over
// reverse), no dispatch key forced on for the
// thread (a TorchDispatchMode, FakeTensorMode under torch.compile, functorch's transforms,
// the Python dispatcher), and every tensor a plain dense CPU or CUDA tensor (no subclass
// such as DTensor or FakeTensor, no lazy conjugate or negative view). The dispatcher would
// then reach this file's own CPU or CUDA kernel, after boxing the call; the direct call
// keeps the profiler's event of that op.
bool direct_call_ok(const at::Tensor& dout, const std::vector<at::Tensor>& saved) {
  // Included beyond the defaults (BackendSelect, ADInplaceOrView), that is.
  const c10::DispatchKeySet forced = c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set;
  if (at::GradMode::is_enabled() || !forced.empty() || !is_plain(dout) || has_tangent(dout)) return false;
  for (const at::Tensor& t : saved) {
    if (!is_plain(t) || has_tangent(t)) return false;  // a tangent: the autograd kernel computes its own
  }
  return true;
}

// Two inputs that are the two halves of one split of a tensor u (`a, b = u.chunk(2, -1)`,
// as a GLU's gate and value come): autograd's split node (SplitBackward0) would
// concatenate their gradients into u's, a read and a write of u's size after the backward
// kernel wrote them. Instead the op's node takes the split's own edge to u in the first
// half's place (the second half's edge is left empty), and its backward writes both
// gradients into the halves of one tensor of u's shape (run_kernel's given outputs), or
// concatenates them itself where the kernel cannot (create_graph, tracing, a reduced or
// cast gradient: join_halves). low, high: the inputs that are the split's outputs 0 and 1;
// dim: the dimension split. What is lost is only what the split's node itself would see
// (README, "Chunk halves"): a hook or retain_grad put on a half after this op's call, and
// torch.autograd.grad asked for a half's gradient (reported unused).
struct SplitHalves {
  int low = -1, high = -1;
  int64_t dim = 0;
  bool active() const { return low >= 0; }
  std::vector<int64_t> packed() const { return {low, high, dim}; }  // compiled autograd's state
  static SplitHalves unpacked(const std::vector<int64_t>& v) { return {int(v[0]), int(v[1]), v[2]}; }
};

// The SplitHalves among a forward call's inputs (edges: theirs), if any: plain tensors at
// the two outputs of one split node (chunk or split into two), views of a contiguous base
// u whose gradient edge the split's is (the split of u itself, not of a view of it), with
// u's strides and disjoint along one dimension, and no hook or retain_grad on the split's
// node (those would see the halves' gradients).
SplitHalves find_split_halves(const std::vector<at::Tensor>& tensors, const torch::autograd::edge_list& edges) {
  static const std::array<std::string, 2> kSplits = {"SplitBackward0", "SplitWithSizesBackward0"};
  SplitHalves h;
  torch::autograd::Node* split = nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::autograd::Edge& e = edges[i];
    if (!e.is_valid() || !tensors[i].is_view() || e.function->num_inputs() != 2) continue;  // is_view first: cheap
    if (std::find(kSplits.begin(), kSplits.end(), e.function->name()) == kSplits.end()) continue;
    int& half = e.input_nr == 0 ? h.low : h.high;
    if (half >= 0 || (split != nullptr && split != e.function.get())) return {};  // a half twice, or two splits
    half = static_cast<int>(i);
    split = e.function.get();
  }
  if (h.low < 0 || h.high < 0) return {};
  if (!split->pre_hooks().empty() || !split->tensor_pre_hooks().empty() || !split->retains_grad_hooks().empty() ||
      !split->post_hooks().empty() || split->num_outputs() != 1) {
    return {};
  }
  const at::Tensor& a = tensors[h.low];
  const at::Tensor& b = tensors[h.high];
  const at::Tensor u(a._base());
  if (!is_plain(a) || !is_plain(b) || !b._base().is_same(u) || !u.is_contiguous() ||
      !(torch::autograd::impl::gradient_edge(u) == split->next_edge(0)) || a.strides() != u.strides() ||
      b.strides() != u.strides() || a.dim() != u.dim() || a.storage_offset() != u.storage_offset()) {
    return {};
  }
  for (int64_t d = 0; d < u.dim(); ++d) {
    if (a.size(d) + b.size(d) == u.size(d) && a.size(d) > 0 && b.size(d) > 0 &&
        b.storage_offset() == u.storage_offset() + a.size(d) * u.stride(d)) {
      h.dim = d;
      return h;
    }
  }
  return {};
}

// The tensor of u's shape that a split's two gradients are written into by the kernel
// (SplitHalves), with given[k] its halves for the kernel outputs k of the two gradients;
// undefined when the kernel cannot write them there: one of them is not a kernel output,
// both are the same one, or one must still be summed to its input's shape or cast
// (reduce_to_input). The order of u's elements: contiguous, as autograd's cat gives it.
at::Tensor split_gradient(const OpDef& def, const SplitHalves& split, const at::Tensor& dout,
                          c10::ArrayRef<InputMeta> meta, std::vector<at::Tensor>& given) {
  const GradDef& low = def.grads[split.low];
  const GradDef& high = def.grads[split.high];
  const auto fits = [&](int i) {
    return c10::SymIntArrayRef(meta[i].sizes) == dout.sym_sizes() && meta[i].dtype == dout.scalar_type();
  };
  if (low.output < 0 || high.output < 0 || low.output == high.output || !fits(split.low) || !fits(split.high)) {
    return {};
  }
  std::vector<int64_t> sizes(dout.sizes().begin(), dout.sizes().end());
  const int64_t first = sizes[split.dim];
  sizes[split.dim] += meta[split.high].sizes[split.dim].expect_int();
  at::Tensor whole = at::empty(sizes, dout.options());
  given.assign(def.num_kernel_grads, at::Tensor());
  given[low.output] = whole.narrow(split.dim, 0, first);
  given[high.output] = whole.narrow(split.dim, first, sizes[split.dim] - first);
  return whole;
}

// u's gradient into grads[split.low] (grads[split.high] is the empty edge's): `whole` where
// the kernel wrote both halves into it, else the two gradients concatenated, an undefined
// one as zeros (as autograd's split node does; differentiable, for create_graph).
void join_halves(const SplitHalves& split, c10::ArrayRef<InputMeta> meta, const at::Tensor& whole,
                 const std::vector<at::Tensor>& given, const OpDef& def, variable_list& grads) {
  at::Tensor& low = grads[split.low];
  at::Tensor& high = grads[split.high];
  if (whole.defined() && low.is_same(given[def.grads[split.low].output]) &&
      high.is_same(given[def.grads[split.high].output])) {
    low = whole;
  } else if (low.defined() || high.defined()) {
    const at::Tensor& like = low.defined() ? low : high;
    const auto zeros = [&](int i) { return at::zeros_symint(meta[i].sizes, like.options().dtype(meta[i].dtype)); };
    low = at::cat({low.defined() ? low : zeros(split.low), high.defined() ? high : zeros(split.high)}, split.dim);
  }
  high = at::Tensor();
}

#ifdef FUSEGEN_WITH_CUDA
// The gradients of broadcast inputs summed in the backward kernel itself (CUDA), into
// grads: a per-channel scale's sum(dout * x) and a bias's sum(dout) read dout and x once,
// in the kernel that writes x's gradient, instead of being written at the broadcast shape
// and summed by ATen (reduce_to_input). A kernel output whose inputs all have one shape,
// not the broadcast shape, is summed to it; so is dout for the first such input whose
// gradient is steps of dout alone (others of that kind, and outputs shared by inputs of
// different shapes, are summed by ATen as before). The sums are float (fp16 and bf16
// too, as ATen's sum accumulates) and take the input's dtype at the end; they add in no
// fixed order (atomics), so not under torch.use_deterministic_algorithms. Returns false,
// having computed no gradient (at most the zeroed sums, which the iterator needs to decide),
// when nothing is summed or the loop is not one the accumulating kernel takes (fp64, an
// odd fast dimension, offsets past 2^31): then first_order_grads computes them the usual way.
template <typename Needs>
bool accumulates_in_kernel(const Op& op, const at::Tensor& dout, const std::vector<at::Tensor>& saved,
                           c10::ArrayRef<double> scalars, c10::ArrayRef<InputMeta> meta, Needs&& needs,
                           variable_list& grads) {
  const OpDef& def = *op.def;
  const int count = def.num_kernel_grads;
  if (def.backward_cuda == nullptr || !def.backward_accumulates || !dout.is_cuda() ||
      at::globalContext().deterministicAlgorithms() ||
      1 + def.num_backward_inputs + 2 * count + 1 > kMaxVectorOperands) {  // Accumulating<F>::kOperands
    return false;
  }
  // A gradient with as many elements as dout has nothing to sum (at most size-1 dimensions to drop).
  const auto nothing_to_sum = [&](int i) {
    int64_t numel = 1;
    for (const c10::SymInt& d : meta[i].sizes) numel *= d.expect_int();
    return numel == dout.numel();
  };
  // Per kernel output (and dout, at index count): the input whose shape it is summed to;
  // kFull: computed at the broadcast shape.
  constexpr int kNone = -1, kFull = -2;
  const KernelRequest request = kernel_request(def, needs);
  std::vector<int> target(count + 1, kNone);
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    const int k = g.output >= 0 ? g.output : g.num_steps >= 0 ? count : kNone;
    if (k == kNone || target[k] == kFull) continue;
    if (nothing_to_sum(i)) {
      if (k < count) target[k] = kFull;
    } else if (target[k] == kNone) {
      target[k] = i;
    } else if (k < count && meta[target[k]].sizes != meta[i].sizes) {
      target[k] = kFull;
    }
  }
  bool any = false;
  for (int t : target) any = any || t >= 0;
  if (!request.run || !any) return false;

  std::vector<at::Tensor> tensors{dout};
  tensors.insert(tensors.end(), saved.begin(), saved.end());
  const Args args = BackwardArgs::of(def, tensors);
  const at::ScalarType dtype = check_args(op.backward_name, args);
  if (dtype == at::kDouble) return false;
  const c10::Device on = device_arg(args).tensor.device();
  c10::cuda::CUDAGuard device_guard(on);
  const std::vector<at::Tensor> inputs = kernel_inputs(args, dtype, on);
  std::vector<at::Tensor> sums(count + 1);  // undefined where the kernel sums nothing
  std::vector<bool> present(count, false);
  int num_outputs = 0;
  for (int k = 0; k < count; ++k) {
    present[k] = request.mask[k] && target[k] < 0;
    num_outputs += present[k];
  }
  for (int k = 0; k <= count; ++k) {
    if (target[k] < 0) continue;  // (a kernel output's target is one of the inputs that requested it)
    std::vector<int64_t> sizes;
    for (const c10::SymInt& d : meta[target[k]].sizes) sizes.push_back(d.expect_int());
    sums[k] = at::zeros(sizes, inputs.front().options().dtype(at::kFloat));
  }
  at::TensorIterator iter = make_iterator(num_outputs, inputs, sums);
  if (iter.numel() == 0 || iter.is_contiguous() || iter.shape()[0] % kAccumulatingWidth != 0 ||
      !iter.can_use_32bit_indexing()) {
    return false;
  }
  {
    RECORD_FUNCTION(op.backward_event.c_str(), std::vector<c10::IValue>());
    launch_cuda(iter, Operands(present, static_cast<int>(inputs.size()), sums), def.backward_cuda,
                kernel_dtype(dtype), scalars.data());
  }
  std::vector<at::Tensor> full(count);
  for (int k = 0, next = 0; k < count; ++k) {
    if (present[k]) full[k] = iter.output(next++);
  }
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    at::Tensor grad;
    if (g.output >= 0) {
      grad = sums[g.output].defined() ? sums[g.output] : full[g.output];
    } else if (g.num_steps >= 0) {
      const bool from_sum = sums[count].defined() && meta[target[count]].sizes == meta[i].sizes;
      grad = apply_steps(g, from_sum ? sums[count] : dout);
    }
    if (grad.defined()) grads[i] = reduce_to_input(meta[i], grad);
  }
  return true;
}
#endif

// The first-order gradients of `op`'s inputs for which needs(i) holds: the eager ops of dout
// alone, or <name>_backward over dout and `saved` (the tensors the backward reads). Without
// create_graph nothing differentiates the backward, so its autograd kernel is skipped, and
// for plain tensors its kernel is called directly (direct_call_ok), on CUDA summing the
// gradients of broadcast inputs in the kernel where it can (accumulates_in_kernel); with
// create_graph, the autograd kernel records FusedDoubleBackward (double backward).
// With SplitHalves, both halves' gradients are computed when u's is needed (its edge is in
// the low half's place) and joined into it (split_gradient, join_halves).
template <typename Needs>
variable_list first_order_grads(const Op& op, const at::Tensor& dout, std::vector<at::Tensor> saved,
                                c10::ArrayRef<double> scalars, c10::ArrayRef<InputMeta> meta,
                                const SplitHalves& split, Needs&& needs_edge) {
  const OpDef& def = *op.def;
  variable_list grads(def.num_inputs);
  if (!dout.defined()) return grads;  // no gradient arrived: the inputs' are zero too (undefined), as in eager's nodes
  const auto needs = [&](int i) { return needs_edge(split.active() && i == split.high ? split.low : i); };
  const bool direct = direct_call_ok(dout, saved);
  std::vector<at::Tensor> given;  // per kernel output: where the kernel writes it (the halves of `whole`)
  const at::Tensor whole =
      direct && split.active() && needs(split.low) ? split_gradient(def, split, dout, meta, given) : at::Tensor();
#ifdef FUSEGEN_WITH_CUDA
  if (direct && !whole.defined() && accumulates_in_kernel(op, dout, saved, scalars, meta, needs, grads)) {
    if (split.active()) join_halves(split, meta, whole, given, def, grads);
    return grads;
  }
#endif
  gradients_of(def, dout, meta, needs, [&](const std::vector<bool>& mask) {
    BackwardArgs a;
    a.tensors.reserve(1 + saved.size());
    a.tensors.push_back(dout);
    for (at::Tensor& t : saved) a.tensors.push_back(std::move(t));
    a.scalars.assign(scalars.begin(), scalars.end());
    a.mask = mask;
    if (direct) {
      RECORD_FUNCTION(op.backward_event.c_str(), std::vector<c10::IValue>());
      const bool cuda = device_arg(a.named(def)).tensor.is_cuda();
      return run_backward(op, cuda ? Device::kCuda : Device::kCpu, a, given);
    }
    torch::jit::Stack stack;
    a.push(stack);
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    op.backward_op->callBoxed(stack);
    return std::move(stack.back()).toTensorVector();
  }, grads);
  if (split.active()) join_halves(split, meta, whole, given, def, grads);
  return grads;
}

// Compiled autograd's form of FusedBackward::apply (torch._dynamo.compiled_autograd): the
// node's state arrives packed (FusedBackward::apply_with_saved packs it).
variable_list apply_functional(const variable_list& inputs, const std::vector<c10::IValue>& args) {
  torch::dynamo::autograd::PackedArgs packed(args);
  const Op* op = find_op(packed.unpack<std::string>());
  TORCH_INTERNAL_ASSERT(op != nullptr);
  auto saved = packed.unpack<std::vector<at::Tensor>>();
  const auto scalars = packed.unpack<std::vector<double>>();
  const auto needs = packed.unpack<std::vector<bool>>();
  const std::vector<InputMeta> meta = unpack_metadata(packed.unpack<std::vector<c10::SymInt>>());
  const SplitHalves split = SplitHalves::unpacked(packed.unpack<std::vector<int64_t>>());
  return first_order_grads(*op, inputs[0], std::move(saved), scalars, meta, split, [&](int i) { return needs[i]; });
}

// The autograd node of one forward call, written as PyTorch's generated nodes are (a
// torch::autograd::Function would add its string-keyed saved_data, IValue packing and
// apply()'s bookkeeping: about 1 us a call on the CPU machine): the op, the tensors the
// backward reads as SavedVariables (the forward's output saved as an output, so that its
// version counter refuses a backward after an in-place change, as for eager's relu, and
// "backward through the graph a second time" after they are freed), the scalars the
// backward reads and each input's dtype and sizes, as plain members.
class FusedBackward final : public torch::autograd::Node {
 public:
  explicit FusedBackward(const Op* op) : op_(op) {}

  std::string name() const override { return op_->node_name; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable& s : saved_) s.reset_data();
  }

  variable_list apply(variable_list&& douts) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_order_grads(*op_, douts[0], unpack_saved(), scalars_, meta_, split_,
                             [&](int i) { return task_should_compute_output(i); });
  }

  // Compiled autograd: the node's state for the cache key (tensors and sizes become graph
  // inputs), then a call of apply_functional with that state packed, which the compiler
  // traces (its <name>_backward call lands in the graph as the op).
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(op_->node_name);
    for (size_t i = 0; i < saved_.size(); ++i) args.collect(saved_[i], is_output(i));
    for (double s : scalars_) args.collect(s);
    for (const InputMeta& m : meta_) {
      args.collect(m.dtype);
      for (const c10::SymInt& d : m.sizes) args.collect(d);
    }
    args.collect(split_.packed());
  }

  variable_list apply_with_saved(const variable_list& inputs, torch::dynamo::autograd::SwapSavedVariables& swap) override {
    namespace ca = torch::dynamo::autograd;
    for (torch::autograd::SavedVariable& s : saved_) swap.before(s);
    for (InputMeta& m : meta_) {
      for (c10::SymInt& d : m.sizes) swap.before(d);
    }
    ca::PackedArgs packed;
    packed.pack(op_->name);
    packed.pack(unpack_saved());
    packed.pack(std::vector<double>(scalars_.begin(), scalars_.end()));
    std::vector<bool> needs;
    for (size_t i = 0; i < num_outputs(); ++i) needs.push_back(task_should_compute_output(i));
    packed.pack(needs);
    packed.pack(pack_metadata(meta_));
    packed.pack(split_.packed());
    const std::vector<c10::IValue>& state = packed.vec();
    std::vector<at::TypePtr> schema;
    for (const c10::IValue& v : state) schema.push_back(v.isTensor() ? at::TensorType::get() : v.type());
    const auto& compiler = ca::getPyCompilerInterface();
    const std::string fn = compiler->bind_function(swap.get_py_compiler(), op_->node_name, apply_functional, schema,
                                                   /*is_custom_function=*/true, /*is_traceable=*/true);
    variable_list out = compiler->call_function(swap.get_py_compiler(), "apply_functional", fn, inputs, state,
                                                ca::IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
                                                    ca::get_input_metadata(next_edges())));
    for (torch::autograd::SavedVariable& s : saved_) swap.after(s);
    for (InputMeta& m : meta_) {
      for (c10::SymInt& d : m.sizes) swap.after(d);
    }
    return out;
  }

  const Op* op_;
  std::vector<torch::autograd::SavedVariable> saved_;  // def.backward_inputs, in order
  c10::SmallVector<double, 4> scalars_;                // def.backward_scalars, in order
  c10::SmallVector<InputMeta, 4> meta_;                // per input
  SplitHalves split_;                                  // inputs that are the halves of one split

 private:
  // Whether saved tensor i is the forward's output (saved as an output).
  bool is_output(size_t i) const { return op_->def->backward_inputs[i] == kResult; }

  // The saved tensors; an output is saved without its grad_fn (this node: no cycle) and
  // gets it back here.
  std::vector<at::Tensor> unpack_saved() {
    std::vector<at::Tensor> out;
    out.reserve(saved_.size());
    for (size_t i = 0; i < saved_.size(); ++i) out.push_back(saved_[i].unpack(is_output(i) ? getptr() : nullptr));
    return out;
  }
};

// The backward's own derivative (double backward), fused: <name>_backward computes
// grad_k = dout * f_k(x); the gradients gg_k arriving at its outputs make
// h(dout, x, gg) = sum_k gg_k * grad_k, whose gradients are the double backward. fusegen
// builds the op <name>_grad2 with forward h (on first use; a standalone build, into the
// op's library), so this calls <name>_grad2_backward once with incoming gradient 1. Above
// second order fusegen's Python side registers an autograd kernel for
// <name>_grad2_backward that computes it as eager torch ops (fusegen/pytorch/autograd.py);
// without it (a standalone build) this fails loudly, as
// <name>_grad2 has no <name>_grad2_grad2. A hand-written node, as FusedBackward is, and not
// a torch::autograd::Function: torch.func refuses those in every transform, while a node
// whose work goes through the dispatcher is what PyTorch's own ops record.
class FusedDoubleBackward final : public torch::autograd::Node {
 public:
  explicit FusedDoubleBackward(const Op* op) : op_(op) {}

  std::string name() const override { return op_->double_node_name; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable& s : saved_) s.reset_data();
  }

  variable_list apply(variable_list&& ggs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Op& op = *op_;
    const OpDef& def = *op.def;
    const Op* grad2 = find_auxiliary(op.name + "_grad2");
    TORCH_CHECK_NOT_IMPLEMENTED(grad2 != nullptr && grad2->has_backward(), "fusegen::", op.name,
                                ": the derivative of its backward needs fusegen::", op.name,
                                "_grad2, which is not loaded (a library built without fusegen fuses first and "
                                "second derivatives; load the op with fusegen (fusegen.fuse / @fused) for any order)");
    const OpDef& def2 = *grad2->def;
    std::vector<at::Tensor> saved;  // dout, the tensors the backward read
    saved.reserve(saved_.size());
    for (torch::autograd::SavedVariable& v : saved_) saved.push_back(v.unpack());
    const int own = 1 + def.num_backward_inputs;
    variable_list grads(own);
    // <name>_grad2's inputs: dout, the backward's tensors, then gg_k per kernel output.
    std::vector<at::Tensor> inputs(saved.begin(), saved.end());
    const at::ScalarType dtype = check_args(op.backward_name, BackwardArgs::of(def, saved));
    const at::TensorOptions options = saved[0].options().dtype(dtype);
    bool any_gg = false;
    size_t next = 0;
    for (int k = 0; k < def.num_kernel_grads; ++k) {
      at::Tensor gg = mask_[k] && next < ggs.size() ? ggs[next++] : at::Tensor();
      any_gg = any_gg || gg.defined();
      inputs.push_back(gg.defined() ? gg : at::zeros({}, options));
    }
    if (!any_gg) return grads;
    const at::Tensor one = at::ones({}, options);
    // d h / d input = 1 (a passthrough of grad2) is the incoming gradient: ones.
    const at::Tensor ones = one.expand_symint(saved[0].sym_sizes());
    gradients_of(def2, ones, meta_, [&](int i) { return i < own && task_should_compute_output(i); },
                 [&](const std::vector<bool>& mask2) {
      BackwardArgs a;
      a.tensors.push_back(one);
      for (int i = 0; i < def2.num_backward_inputs; ++i) a.tensors.push_back(inputs[def2.backward_inputs[i]]);
      for (int i = 0; i < def2.num_backward_scalars; ++i) a.scalars.push_back(scalars_[def2.backward_scalars[i]]);
      a.mask = mask2;
      torch::jit::Stack stack;
      a.push(stack);
      grad2->backward_op->callBoxed(stack);
      return std::move(stack.back()).toTensorVector();
    }, grads);
    return grads;
  }

  const Op* op_;
  std::vector<torch::autograd::SavedVariable> saved_;  // dout, then the tensors the backward reads
  std::vector<double> scalars_;                        // the backward's scalars
  std::vector<bool> mask_;                             // its output_mask
  std::vector<InputMeta> meta_;                        // per tensor argument
};

// ---------------------------------------------------------------------------------------
// Forward-mode AD (torch.autograd.forward_ad, torch.func.jvp / jacfwd / hessian), as
// PyTorch's generated autograd kernels do it: when a tensor argument has a tangent, the
// output's tangent is computed by ops that are differentiable again and set with
// _set_fw_grad. For fusegen::<name> that is one call of fusegen::<name>_jvp on the primals
// (_fw_primal, so that it sees no tangent of its own) and the tangents, zero where an input
// has none. The other ops of the family have no fused forward mode: fusegen's Python side
// registers fusegen::__composite, which computes an op of the family as eager torch ops of
// its expression (differentiable in every mode); without it (a standalone build) an error
// that names the op and the way out.

at::Tensor forward_tangent(const Op& op, const ForwardArgs& a, const at::Tensor& out) {
  const OpDef& def = *op.def;
  if (def.num_jvp_args == 0) return at::zeros_like(out);  // every gradient is zero
  const Op* jvp = find_auxiliary(op.name + "_jvp");
  TORCH_INTERNAL_ASSERT(jvp != nullptr, "fusegen::", op.name, "_jvp is neither in the op's library nor loadable");
  torch::jit::Stack stack;
  for (int k = 0; k < def.num_jvp_args; ++k) {
    const int j = def.jvp_args[k];
    if (j < def.num_inputs) {
      const at::Tensor& x = a.tensors[j];
      stack.emplace_back(has_tangent(x) ? x._fw_primal(/*level=*/0) : x);
    } else {
      const at::Tensor& t = a.tensors[j - def.num_inputs]._fw_grad(/*level=*/0);
      stack.emplace_back(t.defined() ? t : at::zeros({}, out.options()));
    }
  }
  for (int k = 0; k < def.num_jvp_scalars; ++k) stack.emplace_back(a.scalars[def.jvp_scalars[k]]);
  jvp->forward_op->callBoxed(stack);
  at::Tensor tangent = std::move(stack.back()).toTensor();
  // Fewer dimensions when the primals it reads broadcast to less than the output (a tangent
  // on a broadcast input only): _set_fw_grad lays it out as the output.
  if (tangent.sym_sizes() != out.sym_sizes()) tangent = tangent.expand_symint(out.sym_sizes());
  return tangent.scalar_type() == out.scalar_type() ? tangent : tangent.to(out.scalar_type());
}

// An op with no fused forward mode, called with a tangent: fusegen::__composite computes it
// (its output, tangent and graph) from the op's arguments, which it takes off the stack.
void composite_forward_mode(const Op& op, bool backward, torch::jit::Stack* stack) {
  const OpDef& def = *op.def;
  const std::string& name = backward ? op.backward_name : op.name;
  const auto hook = c10::Dispatcher::singleton().findOp({"fusegen::__composite", ""});
  TORCH_CHECK_NOT_IMPLEMENTED(
      hook.has_value(), "fusegen::", name, " has no fused forward-mode derivative, and an input has a tangent "
      "(forward-mode AD of a derivative: torch.func.hessian, jacfwd(jacrev), jacfwd(jacfwd), forward_ad through a "
      "backward). fusegen computes it as eager torch ops of the expression once fusegen has loaded the op "
      "(import fusegen; fusegen.load or fusegen.fuse); "
      "a library built without fusegen has forward mode at first order (jvp, jacfwd) and reverse mode for higher "
      "order (jacrev(jacrev) for a Hessian)");
  std::vector<at::Tensor> tensors;
  c10::List<double> scalars;
  c10::List<bool> mask;
  size_t count;
  if (backward) {
    const BackwardArgs a(def, *stack);
    check_defined(name, a.named(def));
    tensors = a.tensors;
    for (double v : a.scalars) scalars.push_back(v);
    for (bool b : a.mask) mask.push_back(b);
    count = 1 + def.num_backward_inputs + def.num_backward_scalars + 1;
  } else {
    const ForwardArgs a(def, *stack);
    check_defined(name, a.named(def));
    tensors = a.tensors;
    for (double v : a.scalars) scalars.push_back(v);
    count = def.num_inputs + def.num_scalars;
  }
  torch::jit::drop(*stack, count);
  torch::jit::Stack call;
  call.emplace_back(name);
  call.emplace_back(std::move(tensors));
  call.emplace_back(std::move(scalars));
  call.emplace_back(std::move(mask));
  hook->callBoxed(call);
  std::vector<at::Tensor> out = std::move(call.back()).toTensorVector();
  if (backward) {
    stack->emplace_back(std::move(out));
  } else {
    stack->emplace_back(std::move(out.at(0)));
  }
}

// ---------------------------------------------------------------------------------------
// Boxed kernels: one class, told which op, which of its two schemas and which dispatch key.

enum class Key { kCpu, kMeta, kCuda, kAutograd };

class Kernel final : public c10::OperatorKernel {
 public:
  Kernel(const Op* op, bool backward, Key key) : op_(op), backward_(backward), key_(key) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const OpDef& def = *op_->def;
    if (key_ == Key::kAutograd) {
      const bool graph = records_graph(def, *stack);
      const bool tangents = has_tangents(def, *stack);
      if (!graph && !tangents) {
        // Nothing to differentiate (no_grad, or no tensor requires grad, and no tangent): no
        // autograd node, no saved state; on to the next kernel (the device's), as eager's
        // autograd kernels do.
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
      } else if (tangents && (backward_ || def.num_jvp_args < 0)) {
        composite_forward_mode(*op_, backward_, stack);
      } else if (backward_) {
        record_backward(handle, keys, stack);
      } else {
        record_forward(handle, keys, stack, graph, tangents);
      }
      return;
    }
    if (!backward_) {
      ForwardArgs a(def, *stack);
      at::Tensor out = run_forward(*op_, device(), a);
      torch::jit::drop(*stack, def.num_inputs + def.num_scalars);
      stack->emplace_back(std::move(out));
    } else {
      BackwardArgs a(def, *stack);
      std::vector<at::Tensor> out = run_backward(*op_, device(), a);
      torch::jit::drop(*stack, 1 + def.num_backward_inputs + def.num_backward_scalars + 1);
      stack->emplace_back(std::move(out));
    }
  }

 private:
  // The forward with autograd, as PyTorch's generated autograd kernels do it: the node and
  // its edges (when `graph`), the output from the kernels below autograd, the output's
  // history, its tangent (when `tangents`), then the saved tensors (the output's after its
  // history and tangent, so it is saved as an output, with its tangent for forward over
  // reverse).
  void record_forward(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack,
                      bool graph, bool tangents) const {
    const OpDef& def = *op_->def;
    const ForwardArgs a(def, *stack);
    check_defined(op_->name, a.named(def));
    if (!graph) {
      {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
      }
      const at::Tensor& out = stack->back().toTensor();
      out._set_fw_grad(forward_tangent(*op_, a, out), /*level=*/0, /*is_inplace_op=*/false);
      return;
    }
    NodePtr node = NodeMaker<NodePtr>::make<FusedBackward>(op_);
    auto* fn = static_cast<FusedBackward*>(node.get());
    torch::autograd::edge_list edges;
    edges.reserve(a.tensors.size());
    for (const at::Tensor& t : a.tensors) edges.push_back(torch::autograd::impl::gradient_edge(t));
    fn->split_ = find_split_halves(a.tensors, edges);
    if (fn->split_.active()) {  // past the split: its edge to u in the low half's place
      edges[fn->split_.low] = edges[fn->split_.low].function->next_edge(0);
      edges[fn->split_.high] = torch::autograd::Edge();
    }
    fn->set_next_edges(std::move(edges));
    for (const at::Tensor& t : a.tensors) fn->meta_.emplace_back(t);
    for (int i = 0; i < def.num_backward_scalars; ++i) fn->scalars_.push_back(a.scalars[def.backward_scalars[i]]);
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }
    const at::Tensor& out = stack->back().toTensor();
    torch::autograd::set_history(out, node);
    if (tangents) out._set_fw_grad(forward_tangent(*op_, a, out), /*level=*/0, /*is_inplace_op=*/false);
    fn->saved_.reserve(def.num_backward_inputs);
    for (int i = 0; i < def.num_backward_inputs; ++i) {
      const int k = def.backward_inputs[i];
      fn->saved_.emplace_back(k == kResult ? out : a.tensors[k], /*is_output=*/k == kResult);
    }
  }

  // The backward with autograd (create_graph, or a torch.func transform): its node
  // (FusedDoubleBackward), the gradients from the kernels below autograd, their history.
  void record_backward(const c10::OperatorHandle& handle, c10::DispatchKeySet keys, torch::jit::Stack* stack) const {
    const OpDef& def = *op_->def;
    const BackwardArgs a(def, *stack);
    check_defined(op_->backward_name, a.named(def));
    NodePtr node = NodeMaker<NodePtr>::make<FusedDoubleBackward>(op_);
    auto* fn = static_cast<FusedDoubleBackward*>(node.get());
    torch::autograd::edge_list edges;
    edges.reserve(a.tensors.size());
    for (const at::Tensor& t : a.tensors) {
      edges.push_back(torch::autograd::impl::gradient_edge(t));
      fn->meta_.emplace_back(t);
      fn->saved_.emplace_back(t, /*is_output=*/false);
    }
    fn->set_next_edges(std::move(edges));
    fn->scalars_ = a.scalars;
    fn->mask_ = a.mask;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }
    torch::autograd::set_history(stack->back().toTensorVector(), node);
  }

  // Whether some tensor argument has a forward-mode tangent (read off the stack).
  bool has_tangents(const OpDef& def, const torch::jit::Stack& stack) const {
    const int tensors = backward_ ? 1 + def.num_backward_inputs : def.num_inputs;
    const int args = backward_ ? tensors + def.num_backward_scalars + 1 : tensors + def.num_scalars;
    const size_t first = stack.size() - args;
    for (int i = 0; i < tensors; ++i) {
      const c10::IValue& v = stack[first + i];
      if (v.isTensor() && has_tangent(v.toTensor())) return true;
    }
    return false;
  }

  // Whether this call must record an autograd node: grad mode on and some tensor argument
  // requires grad (read off the stack, before anything is unpacked).
  bool records_graph(const OpDef& def, const torch::jit::Stack& stack) const {
    if (!at::GradMode::is_enabled()) return false;
    const int tensors = backward_ ? 1 + def.num_backward_inputs : def.num_inputs;
    const int args = backward_ ? tensors + def.num_backward_scalars + 1 : tensors + def.num_scalars;
    const size_t first = stack.size() - args;
    for (int i = 0; i < tensors; ++i) {
      const c10::IValue& v = stack[first + i];
      if (v.isTensor() && v.toTensor().requires_grad()) return true;
    }
    return false;
  }

  Device device() const { return key_ == Key::kCpu ? Device::kCpu : key_ == Key::kMeta ? Device::kMeta : Device::kCuda; }

  const Op* op_;
  bool backward_;
  Key key_;
};

// The registrations, alive for the rest of the process (never destroyed: unregistering at
// exit, after torch's own teardown began, is not worth the risk). Function-local statics:
// an op compiled into the same library (a standalone build) may register from its static
// initializer before this file's namespace-scope objects would have been constructed.
std::mutex& registry_mutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}

std::vector<torch::Library*>& libraries() {
  static std::vector<torch::Library*>* all = new std::vector<torch::Library*>();
  return *all;
}

std::unordered_map<std::string, const Op*>& registry() {
  static auto* ops = new std::unordered_map<std::string, const Op*>();
  return *ops;
}

const Op* find_op(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

// ---------------------------------------------------------------------------------------
// fp16/bf16 runs to and from float (fusegen-runtime.h, convert): the CPU loop's every
// conversion. Each vectorized loop gives what the scalar conversion gives, bit for bit:
// F16C rounds to nearest even as c10::detail::fp16_ieee_from_fp32_value does, and a NaN is
// made the quiet NaN of its sign first, whose fp16 is c10's 0x7E00 (F16C would keep the top
// of a NaN's payload); bf16 is c10's round_to_nearest_even in integer lanes.

template <typename From, typename To>
void convert_portable(const From* x, To* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = Host<To>::store(Host<From>::load(x[i]));
}

#ifdef FUSEGEN_X86_CONVERT
__attribute__((target("avx2,f16c"))) void half_to_float_f16c(const Half* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) y[i] = to_float(x[i]);
}

__attribute__((target("avx2,f16c"))) void float_to_half_f16c(const float* x, Half* y, int64_t n) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    v = _mm256_blendv_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), quiet_nan), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) y[i] = to_half(x[i]);
}

__attribute__((target("avx2"))) void bfloat16_to_float_avx2(const BFloat16* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) y[i] = to_float(x[i]);
}

__attribute__((target("avx2"))) void float_to_bfloat16_avx2(const float* x, BFloat16* y, int64_t n) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i round = _mm256_set1_epi32(0x7FFF);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i half[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * h);
      const __m256i u = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), round), 16);
      half[h] = _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    // packus interleaves the two halves by 128-bit lane; the permute puts them in order.
    // Every value fits in 16 bits, so the unsigned saturation never applies.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), packed);
  }
  for (; i < n; ++i) y[i] = to_bfloat16(x[i]);
}

bool cpu_has_f16c() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"));
  return has;
}

bool cpu_has_avx2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return has;
}
#endif

}  // namespace

void convert(const Half* x, float* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_f16c()) return half_to_float_f16c(x, y, n);
#endif
  convert_portable(x, y, n);
}

void convert(const float* x, Half* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_f16c()) return float_to_half_f16c(x, y, n);
#endif
  convert_portable(x, y, n);
}

void convert(const BFloat16* x, float* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_avx2()) return bfloat16_to_float_avx2(x, y, n);
#endif
  convert_portable(x, y, n);
}

void convert(const float* x, BFloat16* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_avx2()) return float_to_bfloat16_avx2(x, y, n);
#endif
  convert_portable(x, y, n);
}

bool register_op(const OpDef& def) {
  TORCH_CHECK(def.abi == kAbi, "fusegen::", def.name, ": built against fusegen-runtime.h ABI ", def.abi,
              ", but the runtime has ABI ", kAbi, "; rebuild the op");
  std::lock_guard<std::mutex> lock(registry_mutex());
  Op* op = new Op{&def, def.name, std::string(def.name) + "_backward", "fusegen::" + std::string(def.name) + "_backward",
                  "FusedBackward(fusegen::" + std::string(def.name) + ")",
                  "FusedDoubleBackward(fusegen::" + std::string(def.name) + "_backward)", std::nullopt, std::nullopt};
  const char* file = "fusegen-runtime.cpp";
  auto* defs = new torch::Library(torch::Library::FRAGMENT, "fusegen", std::nullopt, file, __LINE__);
  defs->def(def.schema);
  if (op->has_backward()) defs->def(def.backward_schema);
  libraries().push_back(defs);
  registry()[op->name] = op;
  op->forward_op = c10::Dispatcher::singleton().findSchemaOrThrow(("fusegen::" + op->name).c_str(), "");
  if (op->has_backward()) {
    op->backward_op = c10::Dispatcher::singleton().findSchemaOrThrow(("fusegen::" + op->backward_name).c_str(), "");
  }
  const std::pair<c10::DispatchKey, Key> keys[] = {
      {c10::DispatchKey::CPU, Key::kCpu},
      {c10::DispatchKey::Meta, Key::kMeta},
      {c10::DispatchKey::CUDA, Key::kCuda},
      {c10::DispatchKey::Autograd, Key::kAutograd},
  };
  for (const auto& [dispatch_key, key] : keys) {
#ifndef FUSEGEN_WITH_CUDA
    if (key == Key::kCuda) continue;  // a runtime built without CUDA
#endif
    if (key == Key::kCuda && def.forward_cuda == nullptr) continue;  // an op built without CUDA
    auto* impls = new torch::Library(torch::Library::IMPL, "fusegen", dispatch_key, file, __LINE__);
    impls->impl(op->name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op, false, key)));
    if (op->has_backward()) {
      impls->impl(op->backward_name.c_str(),
                  torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(op, true, key)));
    }
    libraries().push_back(impls);
  }
  return true;
}

}  // namespace fusegen
