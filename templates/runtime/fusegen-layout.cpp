// fusegen-layout.cpp: how every call of an op is checked and laid out before its kernels
// run: undefined, mixed-device and non-floating arguments refused with the argument's
// name, torch's type promotion, the layout by ATen's TensorIterator (broadcasting,
// strides, memory format, output allocation; on Meta tensors too, so that the Meta impl's
// strides are the real impl's), the parallel CPU loop over it and the CUDA launch.
#include "fusegen-runtime-impl.h"

#include "fusegen-half.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/TypeProperties.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>

#ifdef FUSEGEN_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

// The fp16/bf16 conversions of the CPU loop use F16C and AVX2 in functions of their own,
// chosen at run time, so that the library still loads on any x86-64 machine.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define FUSEGEN_X86_CONVERT 1
#include <immintrin.h>
#endif

// Internal to the runtime library: not exported beside register_op.
#pragma GCC visibility push(hidden)

namespace fusegen::rt {

// Elements per CPU task: large enough that at::parallel_for's overhead is noise.
constexpr int64_t kCpuGrain = 32768;

bool is_computed_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The type the kernels accumulate in for an op computed in `dtype` (fusegen-half.h's acc):
// double for float64, float for the others.
at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
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
    TORCH_CHECK(is_computed_dtype(type) || at::isIntegralType(type, /*includeBool=*/true),
                "fusegen::", op, ": argument '", arg.name,
                "' must be a floating, integer or bool tensor, got ", type);
    TORCH_CHECK(t.device() == first.tensor.device() || is_cpu_scalar(t), "fusegen::", op,
                ": argument '", arg.name, "' is on ", t.device(), ", expected ",
                first.tensor.device(), " (the device of '", first.name, "')");
    if (arg.row_value) continue;  // (the runtime's own: in the compute type already)
    if (arg.index) {  // as torch.gather's index: integers, which take no part in promotion
      TORCH_CHECK(at::isIntegralType(type, /*includeBool=*/false), "fusegen::", op,
                  ": argument '", arg.name, "' is the index of a gather; expected an integer "
                  "tensor (int64 or int32), got ", type);
      continue;
    }
    state = at::native::update_result_type_state(t, state);
  }
  const at::ScalarType dtype = at::native::result_type(state);
  if (!is_computed_dtype(dtype)) {
    std::string types;
    for (const Arg& arg : args)
      types += std::string(types.empty() ? "" : ", ") + arg.name + ": " +
               c10::toString(arg.tensor.scalar_type());
    TORCH_CHECK(
        false, "fusegen::", op, ": the arguments promote to ", dtype, " (", types,
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
      const c10::SymInt a =
          i < ndim - shape.size() ? c10::SymInt(1) : shape[i - (ndim - shape.size())];
      const c10::SymInt b =
          i < ndim - sizes.size() ? c10::SymInt(1) : sizes[i - (ndim - sizes.size())];
      TORCH_CHECK(a == 1 || b == 1 || a == b, "fusegen::", op, ": argument '", arg.name,
                  "' of shape ", sizes, " does not broadcast with shape ",
                  c10::SymIntArrayRef(shape), " of the arguments before it");
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
std::vector<at::Tensor> kernel_inputs(const Args& args, at::ScalarType dtype,
                                      const c10::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(args.size());
  for (const Arg& arg : args) {
    at::Tensor t = arg.tensor;
    if (t.device() != device) {  // a CPU scalar (check_args allowed nothing else)
      const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
      t = device.is_meta() ? at::empty({}, options) : at::full({}, t.item(), options);
    }
    // A gather's index in the accumulator type the row kernels compute in, which holds
    // every index of a row they take (run_rows checks the length).
    const at::ScalarType type = arg.index || arg.row_value ? acc_dtype(dtype) : dtype;
    out.push_back(t.scalar_type() == type ? t : t.to(type));
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
at::Tensor empty_as_iterator(const c10::SymDimVector& shape,
                             const std::vector<at::Tensor>& inputs) {
  const at::TensorOptions options = inputs.front().options();
  const c10::SymIntArrayRef full(shape);
  bool same_shape = true, contiguous = true, channels_last = true, dense = true;
  for (const at::Tensor& t : inputs) {
    same_shape = same_shape && t.sym_sizes() == full;
    contiguous = contiguous && t.is_contiguous();
    channels_last = channels_last && t.is_contiguous(at::MemoryFormat::ChannelsLast);
    dense = dense && t.is_non_overlapping_and_dense() &&
            t.sym_strides() == inputs.front().sym_strides();
  }
  if (same_shape && contiguous) return at::empty_symint(full, options);
  if (same_shape && channels_last)
    return at::empty_symint(full, options.memory_format(at::MemoryFormat::ChannelsLast));
  if (same_shape && dense)
    return at::empty_strided_symint(full, inputs.back().sym_strides(), options);
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
                                 const std::vector<at::Tensor>& sums,
                                 c10::ArrayRef<at::Tensor> given, bool linear) {
  at::TensorIteratorConfig config;
  // An op that draws random numbers numbers each element by its place in the broadcast
  // shape (C order), forward and backward alike: the loop keeps that order, as torch's own
  // random kernels do (and new outputs are contiguous).
  if (linear) config.enforce_linear_iteration();
  config.set_check_mem_overlap(
      false);  // the outputs are new or disjoint; inputs may overlap each other
  if (!sums.empty())
    config.check_all_same_dtype(false).declare_static_dtype(inputs.front().scalar_type());
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
// An op that draws random numbers (`random`) numbers each element by its place in the
// broadcast shape (Random::first: a run's first). Its first output is new and contiguous in
// that shape (make_iterator), so a run's place is where it starts in that output, and its
// runs go to threads as any op's do, each element drawing the same numbers on any number of
// threads. Only into given outputs of another layout (the halves of a joined op's gradient)
// does it run on one thread, in the loop's linear order.
void launch_cpu(at::TensorIterator& iter, const Operands& ops, CpuKernel kernel, Dtype dtype,
                const double* scalars, const Random* random) {
  const int count = ops.size();
  const auto runs = [&](const Random* drawn) {
    return [&, drawn](char** data, const int64_t* strides, int64_t n) {
      c10::SmallVector<char*, 16> d(count);
      c10::SmallVector<int64_t, 16> s(count);
      for (int k = 0; k < count; ++k) {
        const int i = ops.slot[k];
        d[k] = i < 0 ? nullptr : data[i];
        s[k] = i < 0 ? 0 : strides[i];
      }
      kernel(dtype, d.data(), s.data(), n, scalars, drawn);
    };
  };
  if (random == nullptr) {
    iter.for_each(runs(nullptr), kCpuGrain);
    return;
  }
  const at::Tensor& numbered = iter.output(0);
  if (numbered.numel() == iter.numel() && numbered.is_contiguous()) {
    const char* const base = static_cast<const char*>(iter.data_ptr(0));
    const int64_t size = iter.element_size(0);
    iter.for_each([&](char** data, const int64_t* strides, int64_t n) {
      TORCH_INTERNAL_ASSERT(n == 1 || strides[0] == size, "fusegen: a random run is not linear");
      Random run = *random;
      run.first += (data[0] - base) / size;
      runs(&run)(data, strides, n);
    }, kCpuGrain);
    return;
  }
  Random run = *random;
  const int ntensors = iter.ntensors();
  c10::SmallVector<char*, 16> row(ntensors);
  iter.serial_for_each([&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    for (int64_t outer = 0; outer < size1; ++outer, run.first += size0) {
      for (int i = 0; i < ntensors; ++i) row[i] = data[i] + outer * strides[ntensors + i];
      runs(&run)(row.data(), strides, size0);
    }
  }, {0, iter.numel()});
}

#ifdef FUSEGEN_WITH_CUDA
// The CUDA kernel over the whole iterator, on the current stream: pointers, and sizes and
// byte strides unless it is contiguous.
void launch_cuda(const at::TensorIterator& iter, const Operands& ops, CudaKernel kernel,
                 Dtype dtype, const double* scalars, const Random* random) {
  const int count = ops.size();
  std::vector<char*> data(count);
  for (int k = 0; k < count; ++k)
    data[k] = ops.slot[k] < 0 ? nullptr : static_cast<char*>(iter.data_ptr(ops.slot[k]));
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
  const CudaLoop loop{iter.numel(), ndim,        count, sizes.data(), strides.data(),
                      data.data(),  random};
  kernel(dtype, loop, scalars, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

// The gradients that were asked for (defined), in order: what <name>_backward returns.
std::vector<at::Tensor> requested(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& g : grads) {
    if (g.defined()) out.push_back(g);
  }
  return out;
}


// The common case of a training step: every tensor of the computed dtype, on the op's
// device, of one shape with the contiguous strides and no dimension of size 0 or 1 (where
// TensorIterator may order dimensions of equal strides differently). TensorIterator lays
// it out as one contiguous run with contiguous outputs; building it is about 0.3 us of a
// call (CPU machine, n = 4096), so this case skips it (run_contiguous) with the same result.
bool is_plain_contiguous(const Args& args, at::ScalarType dtype, c10::Device device) {
  const at::Tensor& first = args.front().tensor;
  if (first.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  const c10::IntArrayRef sizes = first.sizes();
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1, stride = 1; d >= 0;
       stride *= sizes[d--]) {
    if (sizes[d] < 2 || first.strides()[d] != stride) return false;
  }
  for (const Arg& arg : args) {
    const at::Tensor& t = arg.tensor;
    if (t.scalar_type() != dtype || t.device() != device || t.layout() != at::kStrided)
      return false;
    if (&t != &first && (t.sizes() != sizes || t.strides() != first.strides())) return false;
  }
  return true;
}

// The kernel over is_plain_contiguous arguments: contiguous outputs (present[k]) of their
// shape, one run of numel elements (on the CPU, on one thread: run_kernel sends a run that
// threads would split to TensorIterator); returns the outputs, as run_kernel does.
std::vector<at::Tensor> run_contiguous(const Args& args, const std::vector<bool>& present,
                                       Device device, CpuKernel cpu, CudaKernel cuda, Dtype dtype,
                                       const double* scalars, const Random* random) {
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
      outputs[k] = device == Device::kCpu
                       ? at::Tensor(at::detail::empty_cpu(first.sizes(), first.options()))
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
    cpu(dtype, data.data(), strides.data(), n, scalars, random);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    // What launch_cuda hands the kernel for a contiguous iterator (ndim 0: no strides).
    const CudaLoop loop{n,       0,           static_cast<int>(data.size()), first.sizes().data(),
                        nullptr, data.data(), random};
    cuda(dtype, loop, scalars, c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
    (void)cuda;
#endif
  }
  return outputs;
}

// The broadcast shape of a row op's arguments, which must have a last dimension to reduce.
c10::SymDimVector row_shape(const std::string& name, const Args& args) {
  c10::SymDimVector shape = broadcast_shape(name, args);
  TORCH_CHECK(!shape.empty(), "fusegen::", name,
              ": the op reduces over the last dimension, and every tensor argument is 0-d; "
              "expected at least one argument with a dimension");
  return shape;
}

// A row op's layout. Each operand is seen as rows along its last dimension: its stride along a
// row and one stride from row to row, which the leading dimensions must collapse into (true of
// contiguous tensors, of anything broadcast over them such as a weight of shape (H,), and of
// a row's slices); one that does not is copied to its contiguous layout first. Outputs are
// new contiguous tensors of the broadcast shape, or of that shape with a last dimension of 1
// for an output of one value per row (per_row); given[k], when defined, is written instead.
// summed (optional, per output, then for dout, args' first: a backward called directly by
// autograd, for the gradient of an input of one value per column, a weight's or a bias's)
// asks for it summed over the rows in the kernel (fusegen-runtime.h, RowSum): a summed
// output is then a tensor of one value per column (the rows' length), in the compute type
// (float for fp16, bf16 and fp32), which the caller casts; dout's sum, of the same kind,
// goes to *dout_sum. On CUDA at most kMaxRowSums, the first asked for, as many as the
// kernel keeps (row_sums_fit); the outputs not summed there, and all on Meta, have the
// broadcast shape, and dout's sum is left undefined.
struct RowStrides {
  int64_t along;  // bytes from one element of a row to the next
  int64_t next;   // bytes from one row to the next
};

// The strides of `t` expanded to `shape` as rows, or false when its leading dimensions do
// not collapse into one stride.
bool row_strides(const at::Tensor& t, c10::IntArrayRef shape, RowStrides& out) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  const int64_t offset = ndim - t.dim();
  const int64_t size = static_cast<int64_t>(t.element_size());
  const auto stride = [&](int64_t d) {  // t's stride along shape's dimension d, 0 if broadcast
    const int64_t own = d - offset;
    return own < 0 || t.size(own) == 1 ? int64_t(0) : t.stride(own);
  };
  out.along = stride(ndim - 1) * size;
  int64_t next = -1;   // the stride of one row, found at the innermost leading dimension > 1
  int64_t inner = 1;   // rows per step of the dimension being checked
  for (int64_t d = ndim - 2; d >= 0; --d) {
    if (shape[d] == 1) continue;
    const int64_t s = stride(d);
    if (next < 0) {
      next = s;
    } else if (s != next * inner) {
      return false;
    }
    inner *= shape[d];
  }
  out.next = std::max<int64_t>(next, 0) * size;
  return true;
}

// Ranges of rows the CPU loop runs at most: enough to spread over the threads, few enough
// that a sum's partial rows (one per range) stay small.
constexpr int64_t kCpuRowRanges = 64;

// The CPU row loop with its rows split over threads: fixed ranges of rows (they depend on
// the shape alone), handed out by TensorIterator::for_each over one byte per range
// (libtorch's parallel backend: this unit has no OpenMP), each run as a loop of its own.
// Rows are independent, so the split changes no bit; each sum over the rows (loop.sums, and
// in `sums` the row of the compute type it is added to) is made per range into a partial
// row, and the partial rows are added in range order, so neither does a sum.
void run_rows_cpu(RowCpuKernel cpu, Dtype dtype, const CudaLoop& loop, const double* scalars,
                  const std::vector<at::Tensor>& sums) {
  const int64_t length = loop.sizes[0];
  const int64_t rows = loop.sizes[1];
  const int64_t per_range = std::max((rows + kCpuRowRanges - 1) / kCpuRowRanges,
                                     (kCpuGrain + length - 1) / length);
  const int64_t ranges = (rows + per_range - 1) / per_range;
  if (ranges <= 1) {  // (one thread too takes the ranges: a summed output's bits stay)
    cpu(dtype, loop, scalars);
    return;
  }
  const int count = loop.num_operands;
  std::vector<at::Tensor> partials(sums.size());
  for (size_t s = 0; s < sums.size(); ++s)
    partials[s] = at::zeros({ranges, length}, sums[s].options());
  at::Tensor bytes = at::empty({ranges}, at::TensorOptions().dtype(at::kByte));
  const char* first = static_cast<const char*>(bytes.const_data_ptr());
  at::TensorIterator iter = at::TensorIterator::nullary_op(bytes);
  iter.for_each([&](char** data, const int64_t*, int64_t n) {
    for (int64_t range = data[0] - first, end = range + n; range < end; ++range) {
      const int64_t r = range * per_range;
      const int64_t sizes[2] = {length, std::min(per_range, rows - r)};
      c10::SmallVector<char*, 16> d(count);
      for (int k = 0; k < count; ++k)
        d[k] = loop.data[k] == nullptr ? nullptr : loop.data[k] + r * loop.strides[count + k];
      c10::SmallVector<RowSum, kMaxRowSums> into(loop.sums, loop.sums + loop.num_sums);
      for (size_t s = 0; s < partials.size(); ++s) {
        into[s].data = static_cast<char*>(partials[s].data_ptr()) +
                       range * length * static_cast<int64_t>(partials[s].element_size());
      }
      CudaLoop part = loop;
      part.numel = sizes[0] * sizes[1];
      part.sizes = sizes;
      part.data = d.data();
      part.sums = into.data();
      cpu(dtype, part, scalars);
    }
  }, /*grain_size=*/1);
  for (size_t s = 0; s < partials.size(); ++s) {
    for (int64_t range = 0; range < ranges; ++range) sums[s].add_(partials[s][range]);
  }
}

std::vector<at::Tensor> run_rows(const std::string& name, Device device, const Args& args,
                                 const std::vector<bool>& present, const bool* per_row,
                                 RowCpuKernel cpu, CudaKernel cuda, const double* scalars,
                                 const std::vector<at::Tensor>& given,
                                 const std::vector<bool>& summed = {},
                                 at::Tensor* dout_sum = nullptr) {
  const at::ScalarType dtype = check_args(name, args);
  const c10::Device on = device_arg(args).tensor.device();
#ifdef FUSEGEN_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> device_guard;
  if (device == Device::kCuda) device_guard.emplace(on);
#endif
  const c10::SymDimVector shape = row_shape(name, args);
  const at::TensorOptions options = device_arg(args).tensor.options().dtype(dtype);
  // The operands summed over the rows (outputs k, then present.size() for dout) and the
  // tensors they are summed into (CPU: zeros the loop adds to; CUDA: the partial rows' sum,
  // below).
  const at::TensorOptions sum_options = options.dtype(acc_dtype(dtype));
  const int storage_bytes = static_cast<int>(options.dtype().itemsize());
  const size_t num_outputs = present.size();
  std::vector<size_t> sum_of;
  std::vector<at::Tensor> sum_into;
  std::vector<bool> sums(num_outputs, false);  // per output: summed
  std::vector<at::Tensor> outputs(num_outputs);
  if (dout_sum != nullptr) *dout_sum = at::Tensor();
  if (device != Device::kMeta && !summed.empty()) {
    const bool cpu = device == Device::kCpu;
    for (size_t k = 0; k < summed.size(); ++k) {
      if (summed[k] && (k < num_outputs ? present[k] : k == num_outputs && dout_sum != nullptr))
        sum_of.push_back(k);
    }
    // CUDA: as many of the first as row_sums_fit (fusegen-runtime.h says which rows, and why).
    const int acc_bytes = static_cast<int>(sum_options.dtype().itemsize());
    const int64_t length = shape.back().expect_int();
    size_t take = cpu ? sum_of.size() : std::min<size_t>(sum_of.size(), kMaxRowSums);
    while (!cpu && take > 0 &&
           !row_sums_fit(length, storage_bytes, acc_bytes, static_cast<int>(take)))
      --take;
    sum_of.resize(take);
    for (size_t k : sum_of) {
      sum_into.push_back(cpu ? at::zeros({length}, sum_options) : at::empty({length}, sum_options));
      if (k < num_outputs) {
        sums[k] = true;
        outputs[k] = sum_into.back();
      } else {
        *dout_sum = sum_into.back();
      }
    }
  }
  const bool any_sum = !sum_of.empty();
  for (size_t k = 0; k < num_outputs; ++k) {
    if (!present[k] || sums[k]) continue;
    if (k < given.size() && given[k].defined()) {
      outputs[k] = given[k];
      continue;
    }
    c10::SymDimVector sizes = shape;
    if (per_row != nullptr && per_row[k]) sizes.back() = 1;
    outputs[k] = at::empty_symint(sizes, options);
  }
  if (device == Device::kMeta) return outputs;
  std::vector<int64_t> concrete;
  for (const c10::SymInt& d : shape) concrete.push_back(d.expect_int());
  const int64_t length = concrete.back();
  const int64_t rows = c10::multiply_integers(concrete.begin(), concrete.end() - 1);
  bool row_values = false;  // an output of one value per row is asked for
  for (size_t k = 0; k < present.size(); ++k)
    row_values = row_values || (present[k] && per_row != nullptr && per_row[k]);
  TORCH_CHECK(length > 0 || rows == 0 || !row_values, "fusegen::", name,
              ": the last dimension has size 0, so a row has no value to reduce; expected rows "
              "of at least one element");
  for (const Arg& arg : args) {
    if (!arg.index) continue;
    TORCH_CHECK(arg.tensor.dim() > 0 && arg.tensor.size(-1) == 1, "fusegen::", name,
                ": argument '", arg.name, "' is the index of a gather along the last dimension, "
                "one per row; expected a last dimension of size 1, got shape ",
                arg.tensor.sizes());
    // float holds every integer up to 2^24 exactly: the largest index of such a row
    TORCH_CHECK(dtype == at::kDouble || length <= (int64_t(1) << 24), "fusegen::", name,
                ": a gather along rows of ", length, " elements needs float64 (float32 holds "
                "indices below 2^24 exactly); expected rows of at most 16777216 elements");
  }
  const int64_t numel = rows * length;
  if (numel == 0) {
    for (at::Tensor& t : sum_into) t.zero_();  // (CUDA: no rows, no partial rows to sum)
    return outputs;
  }
  std::vector<at::Tensor> inputs = kernel_inputs(args, dtype, on);
  std::vector<RowStrides> strides;
  std::vector<char*> data;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (given, its contiguous stand-in)
  std::vector<at::Tensor> partials;  // CUDA: per sum, a partial row per block
  int64_t sum_blocks = 0;
#ifdef FUSEGEN_WITH_CUDA
  if (device == Device::kCuda && any_sum) {  // a few waves of blocks striding over the rows
    const int64_t per_block = row_groups(row_threads(length));
    sum_blocks = std::min<int64_t>((rows + per_block - 1) / per_block,
                                   int64_t(rtc_sm_count()) * row_sum_blocks_per_sm(storage_bytes));
  }
#endif
  std::vector<RowSum> loop_sums;
  for (size_t s = 0; s < sum_of.size(); ++s) {
    const size_t k = sum_of[s];
    RowSum sum{0u, false, static_cast<char*>(sum_into[s].data_ptr()), 0};
    if (k < num_outputs) {
      sum.outputs = 1u << k;
    } else {
      sum.dout = true;
    }
    if (device != Device::kCpu) {
      partials.push_back(at::empty({sum_blocks, length}, sum_options));
      sum.data = static_cast<char*>(partials.back().data_ptr());
      sum.next = length * static_cast<int64_t>(partials.back().element_size());
    }
    loop_sums.push_back(sum);
  }
  for (size_t k = 0; k < num_outputs; ++k) {
    RowStrides rs{0, 0};
    if (present[k] && !sums[k]) {  // (a summed one: no row of it is written, its RowSum adds it)
      c10::IntArrayRef out_shape = outputs[k].sizes();
      if (!row_strides(outputs[k], out_shape, rs) ||
          outputs[k].dim() != static_cast<int64_t>(concrete.size())) {
        at::Tensor stand_in = at::empty(outputs[k].sizes(), options);
        copy_back.emplace_back(outputs[k], stand_in);
        row_strides(stand_in, out_shape, rs);
        data.push_back(static_cast<char*>(stand_in.data_ptr()));
      } else {
        data.push_back(static_cast<char*>(outputs[k].data_ptr()));
      }
    } else {
      data.push_back(nullptr);
    }
    strides.push_back(rs);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor& t = inputs[i];
    RowStrides rs{0, 0};
    if (!row_strides(t, concrete, rs)) {
      std::vector<int64_t> own = concrete;  // a gather's index stays one value per row
      if (args[i].index || args[i].row_value) own.back() = 1;
      t = t.expand(own).contiguous();
      row_strides(t, concrete, rs);
    }
    data.push_back(static_cast<char*>(const_cast<void*>(t.const_data_ptr())));
    strides.push_back(rs);
  }
  const int count = static_cast<int>(data.size());
  std::vector<int64_t> loop_strides(2 * static_cast<size_t>(count));
  for (int k = 0; k < count; ++k) {
    loop_strides[k] = strides[k].along;
    loop_strides[count + k] = strides[k].next;
  }
  const int64_t sizes[2] = {length, rows};
  CudaLoop loop{numel, 2, count, sizes, loop_strides.data(), data.data()};
  if (any_sum) {
    loop.sums = loop_sums.data();
    loop.num_sums = static_cast<int>(loop_sums.size());
    loop.sum_blocks = sum_blocks;
  }
  // CUDA: the memory a split row's launches keep their partial accumulators in
  // (CudaLoop::scratch), held until the launches are queued.
  struct Scratch {
    at::TensorOptions options;
    at::Tensor held;
  } scratch{options.dtype(at::kByte), {}};
  loop.scratch = [](void* owner, size_t bytes) -> void* {
    Scratch& s = *static_cast<Scratch*>(owner);
    s.held = at::empty({static_cast<int64_t>(bytes)}, s.options);
    return s.held.data_ptr();
  };
  loop.scratch_owner = &scratch;
  if (device == Device::kCpu) {
    run_rows_cpu(cpu, kernel_dtype(dtype), loop, scalars, sum_into);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    cuda(kernel_dtype(dtype), loop, scalars, c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
    (void)cuda;
#endif
  }
  for (auto& [target, stand_in] : copy_back) target.copy_(stand_in);
  // The blocks' partial rows summed in a fixed order: ATen's reduction of one shape on one
  // device takes the same steps on every run (no atomics).
  const int64_t blocks_dim[] = {0};
  for (size_t s = 0; s < partials.size(); ++s) at::sum_out(sum_into[s], partials[s], blocks_dim);
  return outputs;
}

// What the forward and the backward share: check the arguments, then lay out `num_outputs`
// outputs over the kernel's inputs and run `cpu` or `cuda` on them. present[k]: whether the
// kernel's output k is wanted (allocated); returns the outputs, an undefined tensor for
// each absent one. given[k] (optional, per kernel output): a tensor of the broadcast shape
// and the computed dtype that output k is written into instead of a new one.
std::vector<at::Tensor> run_kernel(const std::string& name, Device device, const Args& args,
                                   const std::vector<bool>& present, CpuKernel cpu, CudaKernel cuda,
                                   const double* scalars,
                                   const std::vector<at::Tensor>& given = {},
                                   const Random* random = nullptr) {
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
  if (device != Device::kMeta && given.empty() && serial &&
      is_plain_contiguous(args, dtype, on)) {
    return run_contiguous(args, present, device, cpu, cuda, kernel_dtype(dtype), scalars, random);
  }
  const std::vector<at::Tensor> inputs = kernel_inputs(args, dtype, on);
  int num_outputs = 0;
  for (bool p : present) num_outputs += p;
  std::vector<at::Tensor> outputs(present.size());
  if (device == Device::kMeta && any_symbolic(inputs)) {
    const c10::SymDimVector shape = broadcast_shape(name, args);
    for (size_t k = 0; k < present.size(); ++k) {
      if (!present[k]) continue;
      // (random: the linear loop's outputs are contiguous, make_iterator)
      outputs[k] = random != nullptr ? at::empty_symint(shape, inputs.front().options())
                                     : empty_as_iterator(shape, inputs);
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
      return make_iterator(num_outputs, inputs, {}, into, random != nullptr);
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
    launch_cpu(iter, ops, cpu, kernel_dtype(dtype), scalars, random);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    launch_cuda(iter, ops, cuda, kernel_dtype(dtype), scalars, random);
#else
    (void)cuda;
#endif
  }
  return outputs;
}

// The random numbers of one call of an op that draws them: from the default generator of
// the call's device, as torch's own random ops take them. On the CPU a fresh 64-bit seed
// (CPUGeneratorImpl::random64: torch.manual_seed reproduces it, and the generator moves on);
// on CUDA the Philox seed and offset (CUDAGeneratorImpl::philox_cuda_state, which under
// graph capture hands out device pointers that each replay refills, and moves the offset on
// by the streams' count, rounded up to the multiple of 4 it asks for). `state`, when asked
// for: {seed, offset} as an int64 tensor of the call's device, which the CUDA kernel fills
// (Random::save) so that it holds the values a replayed graph drew.
struct Drawn {
  Random random;
  at::Tensor state;
};

Drawn draw_random(const OpDef& def, Device device, c10::Device on, bool sampled) {
  Drawn d;
  const at::TensorOptions state_options = at::TensorOptions().dtype(at::kLong).device(on);
  if (device == Device::kMeta) {
    if (sampled) d.state = at::empty({2}, state_options);
    return d;
  }
  if (device == Device::kCpu) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        std::nullopt, at::detail::getDefaultCPUGenerator());
    {
      std::lock_guard<std::mutex> lock(gen->mutex_);
      d.random.seed = gen->random64();
    }
    if (sampled) {
      d.state = at::empty({2}, state_options);
      d.state.data_ptr<int64_t>()[0] = static_cast<int64_t>(d.random.seed);
      d.state.data_ptr<int64_t>()[1] = 0;
    }
    return d;
  }
#ifdef FUSEGEN_WITH_CUDA
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(on.index()));
  const uint64_t increment = 4 * ((static_cast<uint64_t>(def.num_random) + 3) / 4);
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(increment);
  }
  if (philox.captured_) {
    d.random.seed_at = philox.seed_.ptr;
    d.random.offset_at = philox.offset_.ptr;
    d.random.offset_add = philox.offset_intragraph_;
  } else {
    d.random.seed = philox.seed_.val;
    d.random.offset = philox.offset_.val;
  }
  if (sampled) {
    d.state = at::empty({2}, state_options);
    d.random.save = d.state.data_ptr<int64_t>();
  }
#else
  (void)def;
#endif
  return d;
}

Random saved_random(const std::string& op, const at::Tensor& state, c10::Device on) {
  TORCH_CHECK(state.defined() && state.scalar_type() == at::kLong && state.numel() == 2 &&
                  state.is_contiguous() && state.device() == on,
              "fusegen::", op, ": argument 'rng_state' must be the int64 tensor of 2 elements "
              "on ", on, " that the forward (fusegen::<name>_sampled) returned, got ",
              state.defined() ? state.toString() + " of " + std::to_string(state.numel()) +
                                    " elements on " + state.device().str()
                              : std::string("an undefined tensor"));
  Random r;
  if (on.is_cpu()) {
    r.seed = static_cast<uint64_t>(state.data_ptr<int64_t>()[0]);
    r.offset = static_cast<uint64_t>(state.data_ptr<int64_t>()[1]);
  } else {
    r.seed_at = state.const_data_ptr<int64_t>();
    r.offset_at = r.seed_at + 1;
  }
  return r;
}

// A dropout's probability outside [0, 1] (or NaN) is refused, as F.dropout refuses it.
void check_probabilities(const std::string& op, const OpDef& def, const ForwardArgs& a) {
  for (int k = 0; k < def.num_probabilities; ++k) {
    const int s = def.probabilities[k];
    const double p = a.scalars[s];
    TORCH_CHECK(p >= 0.0 && p <= 1.0, "fusegen::", op, ": argument '", def.scalar_names[s],
                "' is a dropout probability: expected a value between 0 and 1, got ", p);
  }
}

// The row values a row op's forward saves for its backward (OpDef::num_saved_rows), side
// by side in the last dimension of one tensor of the compute type: its views, one per
// value, as the forward's extra outputs (given) or the backward's extra inputs.
// (Made with as_strided: one trip through the dispatcher a view, where narrow makes three,
// a twelfth of a small softmax's fwd+bwd on the CPU.)
std::vector<at::Tensor> saved_row_views(const at::Tensor& saved_rows) {
  c10::SymDimVector sizes(saved_rows.sym_sizes().begin(), saved_rows.sym_sizes().end());
  sizes.back() = 1;
  const c10::SymIntArrayRef strides = saved_rows.sym_strides();
  std::vector<at::Tensor> views;
  for (int64_t k = 0; k < saved_rows.size(-1); ++k) {
    views.push_back(saved_rows.as_strided_symint(
        sizes, strides, saved_rows.sym_storage_offset() + strides.back() * k));
  }
  return views;
}

// The forward on one device: its outputs, in order; a joined op's two outputs are written
// into the halves of one tensor (no concatenation), which is its one result. An op that
// draws random numbers draws them here, and `sampled` adds the state it drew with; a row op
// with saved rows writes them into `saved_rows` when given.
std::vector<at::Tensor> run_forward(const Op& op, Device device, const ForwardArgs& a,
                                    bool sampled, at::Tensor* saved_rows) {
  const OpDef& def = *op.def;
  const OpDef& cpu = device == Device::kCpu ? cpu_kernels_of(op) : def;  // its CPU kernels
  const Args args = a.named(def);
  // The kernel's outputs: the op's, then the row values it saves (written when asked, and
  // rows have an element: rows of none have no value to reduce, and the backward nothing to
  // read, as it computes without them).
  std::vector<at::Tensor> given(def.num_outputs);
  c10::SymDimVector shape;
  if (saved_rows != nullptr && def.num_saved_rows > 0) shape = row_shape(op.name, args);
  const bool saving = !shape.empty() && shape.back() != 0;
  if (saving) {
    const at::ScalarType dtype = check_args(op.name, args);
    shape.back() = def.num_saved_rows;
    const at::TensorOptions options = device_arg(args).tensor.options();
    *saved_rows = at::empty_symint(shape, options.dtype(acc_dtype(dtype)));
    for (at::Tensor& view : saved_row_views(*saved_rows)) given.push_back(std::move(view));
  }
  std::vector<bool> all(def.num_outputs, true);
  all.resize(def.num_outputs + (def.rows ? def.num_saved_rows : 0), saving);
  Drawn drawn;  // (an op that draws random numbers is never a row op: spec.py refuses it)
  if (def.num_random > 0) {
    check_probabilities(op.name, def, a);
    check_defined(op.name, args);
    drawn = draw_random(def, device, device_arg(args).tensor.device(), sampled);
  }
  const Random* random = def.num_random > 0 ? &drawn.random : nullptr;
  std::vector<at::Tensor> out;
  if (def.rows && !def.joined) {
    out = run_rows(op.name, device, args, all, def.per_row, cpu.forward_rows_cpu,
                   def.forward_cuda, a.scalars.data(), given);
    out.resize(def.num_outputs);  // (the saved rows' views)
  } else if (!def.joined) {
    out = run_kernel(op.name, device, args, all, cpu.forward_cpu, def.forward_cuda,
                     a.scalars.data(), {}, random);
  } else {
    const at::ScalarType dtype = check_args(op.name, args);
    c10::SymDimVector shape = broadcast_shape(op.name, args);
    TORCH_CHECK(!shape.empty(), "fusegen::", op.name,
                ": torch.cat joins the outputs along the last dimension, and every tensor "
                "argument is 0-d; expected at least one dimension");
    shape.back() = shape.back() * 2;
    const at::Tensor whole =
        at::empty_symint(shape, device_arg(args).tensor.options().dtype(dtype));
    if (def.rows) {
      const std::vector<at::Tensor> halves = halves_of(whole);
      std::copy(halves.begin(), halves.end(), given.begin());
      run_rows(op.name, device, args, all, def.per_row, cpu.forward_rows_cpu, def.forward_cuda,
               a.scalars.data(), given);
    } else {
      run_kernel(op.name, device, args, all, cpu.forward_cpu, def.forward_cuda, a.scalars.data(),
                 halves_of(whole), random);
    }
    out = {whole};
  }
  if (sampled) out.push_back(drawn.state);
  return out;
}

// The backward on one device: the gradients selected by output_mask, in order, at the
// broadcast shape (the autograd Function sums them to each input's shape); a row op's
// `summed` ones (run_rows) summed over the rows already, and dout's sum (for a bias) in
// *dout_sum. An op that draws random numbers regenerates its forward's from the state
// given last.
std::vector<at::Tensor> run_backward(const Op& op, Device device, const BackwardArgs& a,
                                     const std::vector<at::Tensor>& given,
                                     const std::vector<bool>& summed,
                                     const at::Tensor* saved_rows,
                                     at::Tensor* dout_sum) {
  const OpDef& def = *op.def;
  const OpDef& cpu = device == Device::kCpu ? cpu_kernels_of(op) : def;  // its CPU kernels
  Args args = a.named(def);
  if (def.rows && saved_rows != nullptr && saved_rows->defined()) {
    const std::vector<at::Tensor> views = saved_row_views(*saved_rows);
    for (const at::Tensor& view : views) args.push_back({"saved row values", view, false, true});
    return requested(run_rows(op.backward_name, device, args, a.mask, nullptr,
                              cpu.saved_backward_rows_cpu, def.saved_backward_cuda,
                              a.scalars.data(), given, summed, dout_sum));
  }
  if (def.rows) {  // gradients at the broadcast shape: none is one value per row
    return requested(run_rows(op.backward_name, device, args, a.mask, nullptr,
                              cpu.backward_rows_cpu, def.backward_cuda, a.scalars.data(), given,
                              summed, dout_sum));
  }
  Random random;  // (Meta: no kernel runs, only the linear layout matters)
  if (def.num_random > 0 && device != Device::kMeta) {
    check_defined(op.backward_name, args);
    random = saved_random(op.backward_name, a.tensors.back(), device_arg(args).tensor.device());
  }
  return requested(run_kernel(op.backward_name, device, args, a.mask, cpu.backward_cpu,
                              def.backward_cuda, a.scalars.data(), given,
                              def.num_random > 0 ? &random : nullptr));
}

}  // namespace fusegen::rt
#pragma GCC visibility pop

// ---------------------------------------------------------------------------------------
// fp16/bf16 runs to and from float (fusegen-half.h, convert): the CPU loop's every
// conversion, exported for the op libraries. Each vectorized loop gives what the scalar
// conversion gives, bit for bit: F16C rounds to nearest even as
// c10::detail::fp16_ieee_from_fp32_value does, and a NaN is made the quiet NaN of its sign
// first, whose fp16 is c10's 0x7E00 (F16C would keep the top of a NaN's payload); bf16 is
// c10's round_to_nearest_even in integer lanes.

namespace fusegen {
namespace {

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
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) y[i] = to_half(x[i]);
}

__attribute__((target("avx2"))) void bfloat16_to_float_avx2(const BFloat16* x, float* y,
                                                             int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) y[i] = to_float(x[i]);
}

__attribute__((target("avx2"))) void float_to_bfloat16_avx2(const float* x, BFloat16* y,
                                                             int64_t n) {
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
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), round), 16);
      const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      half[h] = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    }
    // packus interleaves the two halves by 128-bit lane; the permute puts them in order.
    // Every value fits in 16 bits, so the unsigned saturation never applies.
    const __m256i packed =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), packed);
  }
  for (; i < n; ++i) y[i] = to_bfloat16(x[i]);
}

bool cpu_has_f16c() {
  static const bool has =
      (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"));
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
  for (int64_t i = 0; i < n; ++i) y[i] = to_float(x[i]);
}

void convert(const float* x, Half* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_f16c()) return float_to_half_f16c(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = to_half(x[i]);
}

void convert(const BFloat16* x, float* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_avx2()) return bfloat16_to_float_avx2(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = to_float(x[i]);
}

void convert(const float* x, BFloat16* y, int64_t n) {
#ifdef FUSEGEN_X86_CONVERT
  if (cpu_has_avx2()) return float_to_bfloat16_avx2(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = to_bfloat16(x[i]);
}

}  // namespace fusegen
