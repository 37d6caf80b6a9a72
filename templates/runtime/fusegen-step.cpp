// fusegen-step.cpp: register_step, which turns a step op's StepDef into fusegen::<name>
// (one tensor per argument, float scalars) and fusegen::<name>_foreach (a list per
// argument, scalars as numbers or 0-d tensors), with CPU, Meta, CUDA and Autograd kernels.
//
// Both schemas take the same path: check the arguments (defined, devices, dtypes, shapes,
// overlaps), then run each index of the lists. CPU: each tensor's elements split over
// threads. CUDA: the indices grouped by (device, dtypes), each group's tensors packed into
// as few launches as the kernel's parameter block allows, a block per chunk.
// Tensors whose layouts differ (a transposed gradient beside a contiguous parameter) are
// updated through contiguous copies, copied back.
#include "fusegen-runtime-impl.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#ifdef FUSEGEN_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

// Internal to the runtime library: not exported beside register_step.
#pragma GCC visibility push(hidden)

namespace fusegen::rt {
namespace {

struct StepOp {
  const StepDef* def;
  std::string name;          // "fusegen::<name>", for messages
  std::string foreach_name;  // "fusegen::<name>_foreach"
};

// The call's arguments: lists[i] holds input i's tensors (one for the plain schema).
struct StepArgs {
  std::vector<std::vector<at::Tensor>> lists;
  std::vector<double> scalars;
  std::vector<at::Tensor> scalar_tensors;  // per scalar: undefined, or a 0-d tensor
  bool foreach = false;
};

const char* kind(const StepArgs& a) { return a.foreach ? "_foreach" : ""; }

StepArgs read_args(const StepDef& def, bool foreach, const torch::jit::Stack& stack) {
  StepArgs a;
  a.foreach = foreach;
  const size_t count = def.num_inputs + (foreach ? 2 : def.num_scalars);
  const size_t first = stack.size() - count;
  for (int i = 0; i < def.num_inputs; ++i) {
    const c10::IValue& v = stack[first + i];
    if (foreach) {
      std::vector<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(t);
      a.lists.push_back(std::move(list));
    } else {
      a.lists.push_back({tensor_arg(v)});
    }
  }
  if (foreach) {
    for (double s : stack[first + def.num_inputs].toDoubleList()) a.scalars.push_back(s);
    for (const c10::IValue& v : stack[first + def.num_inputs + 1].toListRef())
      a.scalar_tensors.push_back(v.isNone() ? at::Tensor() : v.toTensor());
  } else {
    for (int i = 0; i < def.num_scalars; ++i)
      a.scalars.push_back(stack[first + def.num_inputs + i].toDouble());
    a.scalar_tensors.resize(def.num_scalars);
  }
  return a;
}

size_t stack_count(const StepDef& def, bool foreach) {
  return def.num_inputs + (foreach ? 2 : def.num_scalars);
}

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Every check that does not depend on the device kernel: the Meta kernel runs them too, so
// torch.compile and torch.export report a bad call where eager does.
// " [k]" after an argument's name in a message, for a list's tensor k: written only when
// a check fails (TORCH_CHECK formats its message then), not for every tensor of a call.
struct Position {
  bool foreach;
  size_t k;
};

std::ostream& operator<<(std::ostream& out, const Position& p) {
  if (p.foreach) out << "[" << p.k << "]";
  return out;
}

void check_args(const StepOp& op, StepArgs& a, bool overlaps) {
  const StepDef& def = *op.def;
  const std::string who = op.name + kind(a);
  const size_t n = a.lists.empty() ? 0 : a.lists[0].size();
  for (int i = 1; i < def.num_inputs; ++i) {
    TORCH_CHECK(a.lists[i].size() == n, who, ": argument '", def.input_names[i], "' has ",
                a.lists[i].size(), " tensors, expected ", n, " (as '", def.input_names[0], "')");
  }
  if (a.foreach) {
    TORCH_CHECK(static_cast<int>(a.scalars.size()) == def.num_scalars ||
                    (a.scalars.empty() && def.num_scalars == 0),
                who, ": argument 'scalars' must have ", def.num_scalars, " values (",
                def.num_scalars ? def.scalar_names[0] : "none", def.num_scalars > 1 ? ", ..." : "",
                "), got ", a.scalars.size());
    TORCH_CHECK(static_cast<int>(a.scalar_tensors.size()) == def.num_scalars, who,
                ": argument 'scalar_tensors' must have ", def.num_scalars,
                " entries (None or a 0-d tensor per scalar), got ", a.scalar_tensors.size());
  }
  for (int s = 0; s < def.num_scalars; ++s) {
    const at::Tensor& t = a.scalar_tensors[s];
    if (!t.defined()) continue;
    const bool wide = t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
    TORCH_CHECK(t.dim() == 0 && wide, who, ": scalar '", def.scalar_names[s],
                "' must be a number or a 0-d float32/float64 tensor, got a ", t.dim(), "-d ",
                t.scalar_type(), " tensor");
  }
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor& lead = a.lists[0][k];
    for (int i = 0; i < def.num_inputs; ++i) {
      const at::Tensor& t = a.lists[i][k];
      const Position where{a.foreach, k};
      TORCH_CHECK(t.defined(), who, ": argument '", def.input_names[i], "'", where,
                  " is None; expected a tensor");
      TORCH_CHECK(is_float(t.scalar_type()), who, ": argument '", def.input_names[i], "'", where,
                  " has dtype ", t.scalar_type(),
                  "; expected float32, float64, float16 or bfloat16");
      TORCH_CHECK(t.device() == lead.device(), who, ": argument '", def.input_names[i], "'", where,
                  " is on ", t.device(), ", but '", def.input_names[0], "'", where, " is on ",
                  lead.device(), "; expected one device");
      TORCH_CHECK(t.sizes().equals(lead.sizes()), who, ": argument '", def.input_names[i], "'",
                  where, " has shape ", t.sizes(), ", but '", def.input_names[0], "'", where,
                  " has shape ", lead.sizes(),
                  "; a step op updates tensors of one shape (no broadcasting)");
    }
    // An updated tensor must not overlap itself (an expanded tensor) nor another argument,
    // unless it is the very same tensor where that gives eager's result (StepDef::alias_ok).
    // Not for Meta tensors, which have no memory to compare (torch.compile's fake tensors).
    for (int u = 0; u < def.num_updated && overlaps; ++u) {
      const int i = def.updated[u];
      const at::Tensor& t = a.lists[i][k];
      const Position where{a.foreach, k};
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, who, ": argument '",
                  def.input_names[i], "'", where,
                  " is updated in place but some of its elements share memory (an expanded "
                  "tensor); pass a tensor of its own (.clone())");
      for (int j = 0; j < def.num_inputs; ++j) {
        if (j == i) continue;
        // TooHard (a layout ATen does not analyse) passes, as it does for eager's in-place ops.
        const at::MemOverlapStatus status = at::get_overlap_status(t, a.lists[j][k]);
        if (status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard) continue;
        const bool same = status == at::MemOverlapStatus::Full;
        TORCH_CHECK(same && ((def.alias_ok[u] >> j) & 1u), who, ": argument '",
                    def.input_names[i], "'", where, " is updated in place and ",
                    same ? "is the same tensor as" : "overlaps", " argument '", def.input_names[j],
                    "'", where,
                    same ? ", which the statements read after updating it (eagerly they would see "
                           "the new value); pass separate tensors"
                         : "; pass tensors that do not share memory");
      }
    }
  }
}

// The scalars as host values: a 0-d tensor off the CUDA device is read here.
struct Scalars {
  std::vector<double> values;
  std::vector<const void*> data;  // per scalar: a device 0-d tensor's data, or null
  std::vector<char> is_double;    // std::vector<bool> has no data()
};

Scalars scalars_for(const StepDef& def, const StepArgs& a, const c10::Device& device) {
  Scalars s;
  for (int k = 0; k < def.num_scalars; ++k) {
    const at::Tensor& t = a.scalar_tensors[k];
    const double value = k < static_cast<int>(a.scalars.size()) ? a.scalars[k] : 0.0;
    if (!t.defined()) {
      s.values.push_back(value);
      s.data.push_back(nullptr);
      s.is_double.push_back(0);
    } else if (device.is_cuda() && t.device() == device) {
      s.values.push_back(0.0);
      s.data.push_back(t.const_data_ptr());
      s.is_double.push_back(t.scalar_type() == at::kDouble ? 1 : 0);
    } else {
      s.values.push_back(t.item<double>());  // a CPU tensor (or another device's: it syncs)
      s.data.push_back(nullptr);
      s.is_double.push_back(0);
    }
  }
  return s;
}

// Whether index k's tensors can be updated where they lie, in memory order: one layout
// (sizes and strides) for all, dense and non-overlapping.
bool same_dense_layout(const StepDef& def, const StepArgs& a, size_t k) {
  const at::Tensor& lead = a.lists[0][k];
  if (!lead.is_non_overlapping_and_dense()) return false;
  for (int i = 1; i < def.num_inputs; ++i) {
    const at::Tensor& t = a.lists[i][k];
    if (!t.strides().equals(lead.strides()) || !t.is_non_overlapping_and_dense()) return false;
  }
  return true;
}

// The kernel operands of index k: updated tensors, then tensors read.
std::vector<at::Tensor> operands(const StepDef& def, const std::vector<at::Tensor>& by_input) {
  std::vector<at::Tensor> ops;
  for (int u = 0; u < def.num_updated; ++u) ops.push_back(by_input[def.updated[u]]);
  for (int r = 0; r < def.num_reads; ++r) ops.push_back(by_input[def.reads[r]]);
  return ops;
}

// Grain of the CPU loop: elements per task of at::parallel_for.
constexpr int64_t kCpuGrain = 32768;

void run_cpu(const StepDef& def, const std::vector<at::Tensor>& ops, const Scalars& s) {
  const int64_t n = ops[0].numel();
  if (n == 0) return;
  std::vector<Dtype> dtypes;
  std::vector<char*> base;
  std::vector<int64_t> size;
  for (const at::Tensor& t : ops) {
    dtypes.push_back(kernel_dtype(t.scalar_type()));
    base.push_back(static_cast<char*>(const_cast<void*>(t.const_data_ptr())));
    size.push_back(static_cast<int64_t>(t.element_size()));
  }
  at::parallel_for(0, n, kCpuGrain, [&](int64_t begin, int64_t end) {
    std::vector<char*> data(base.size());
    for (size_t k = 0; k < base.size(); ++k) data[k] = base[k] + begin * size[k];
    def.cpu(data.data(), dtypes.data(), end - begin, s.values.data());
  });
}

#ifdef FUSEGEN_WITH_CUDA
// Packs one group's tensors (same device and dtypes, each `ops[t]` an index's operands)
// into launches of step_max_tensors() tensors, a block per chunk of kStepChunk elements.
void run_cuda_group(const StepDef& def, const std::vector<std::vector<at::Tensor>>& group,
                    const Scalars& s) {
  const int num_operands = def.num_updated + def.num_reads;
  const int max_tensors = step_max_tensors(num_operands);
  // A launch's blocks: below 2^31, the grid's limit.
  constexpr int64_t kMaxChunks = (int64_t(1) << 31) - 1;
  std::vector<Dtype> dtypes;
  for (const at::Tensor& t : group[0]) dtypes.push_back(kernel_dtype(t.scalar_type()));
  std::vector<char*> data;
  std::vector<int64_t> numel;
  std::vector<int> first_chunk{0};
  bool aligned = true;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto flush = [&] {
    if (numel.empty()) return;
    const StepLaunch launch{num_operands,
                            static_cast<int>(numel.size()),
                            data.data(),
                            numel.data(),
                            first_chunk.data(),
                            dtypes.data(),
                            def.num_scalars,
                            s.values.data(),
                            s.data.data(),
                            reinterpret_cast<const bool*>(s.is_double.data()),
                            aligned};
    def.cuda(launch, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    data.clear();
    numel.clear();
    first_chunk.assign(1, 0);
    aligned = true;
  };
  for (const std::vector<at::Tensor>& ops : group) {
    const int64_t n = ops[0].numel();
    if (n == 0) continue;
    const int64_t chunks = (n + kStepChunk - 1) / kStepChunk;
    if (static_cast<int>(numel.size()) == max_tensors || first_chunk.back() + chunks > kMaxChunks)
      flush();
    for (const at::Tensor& t : ops) {
      char* p = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
      data.push_back(p);
      aligned = aligned && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
    }
    numel.push_back(n);
    first_chunk.push_back(first_chunk.back() + static_cast<int>(chunks));
  }
  flush();
}
#endif

void run_step(const StepOp& op, Device device, StepArgs& a) {
  const StepDef& def = *op.def;
  check_args(op, a, device != Device::kMeta);
  const size_t n = a.lists.empty() ? 0 : a.lists[0].size();
  if (device == Device::kMeta || n == 0) return;
  // Each index's operands, where they lie or as contiguous copies (copied back after).
  std::vector<std::vector<at::Tensor>> ops(n);
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (argument, its copy)
  for (size_t k = 0; k < n; ++k) {
    std::vector<at::Tensor> by_input;
    const bool direct = same_dense_layout(def, a, k);
    for (int i = 0; i < def.num_inputs; ++i) {
      const at::Tensor& t = a.lists[i][k];
      by_input.push_back(direct ? t : t.contiguous());
    }
    if (!direct) {
      for (int u = 0; u < def.num_updated; ++u) {
        const int i = def.updated[u];
        if (!by_input[i].is_same(a.lists[i][k])) copy_back.emplace_back(a.lists[i][k], by_input[i]);
      }
    }
    ops[k] = operands(def, by_input);
  }
  if (device == Device::kCpu) {
    const Scalars s = scalars_for(def, a, c10::Device(c10::kCPU));
    for (const std::vector<at::Tensor>& o : ops) run_cpu(def, o, s);
  } else {
#ifdef FUSEGEN_WITH_CUDA
    // Groups by (device, dtypes), in order of first appearance, as torch's foreach ops do.
    std::map<std::vector<int>, std::vector<size_t>> groups;
    std::vector<std::vector<int>> order;
    for (size_t k = 0; k < n; ++k) {
      std::vector<int> key{static_cast<int>(ops[k][0].device().index())};
      for (const at::Tensor& t : ops[k]) key.push_back(static_cast<int>(t.scalar_type()));
      auto [it, added] = groups.try_emplace(key);
      if (added) order.push_back(key);
      it->second.push_back(k);
    }
    for (const std::vector<int>& key : order) {
      const std::vector<size_t>& members = groups[key];
      const c10::Device dev = ops[members[0]][0].device();
      TORCH_CHECK(dev.is_cuda(), op.name, kind(a), ": tensors on ", dev,
                  " reached the CUDA kernel");
      const c10::cuda::CUDAGuard guard(dev);
      const Scalars s = scalars_for(def, a, dev);
      std::vector<std::vector<at::Tensor>> group;
      for (size_t k : members) group.push_back(ops[k]);
      run_cuda_group(def, group, s);
    }
#else
    TORCH_CHECK(false, op.name, kind(a), ": this runtime was built without CUDA");
#endif
  }
  for (auto& [argument, copy] : copy_back) argument.copy_(copy);
}

// The Autograd kernel: a tensor that requires grad may not be updated while grad mode is
// on (eager refuses an in-place op on a leaf that requires grad; an optimizer steps under
// no_grad). Below it, the device's kernel; after it, every updated tensor's version
// counter moves on, as an eager in-place op's does, so autograd notices a tensor saved for
// backward that was changed since.
void run_autograd(const StepOp& op, bool foreach, const c10::OperatorHandle& handle,
                  c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const StepDef& def = *op.def;
  const size_t first = stack->size() - stack_count(def, foreach);
  std::vector<at::Tensor> updated;
  for (int u = 0; u < def.num_updated; ++u) {
    const c10::IValue& v = (*stack)[first + def.updated[u]];
    std::vector<at::Tensor> list;
    if (foreach) {
      for (const at::Tensor& t : v.toTensorList()) list.push_back(t);
    } else if (v.isTensor()) {
      list.push_back(v.toTensor());
    }
    for (size_t k = 0; k < list.size(); ++k) {
      const at::Tensor& t = list[k];
      if (!t.defined()) continue;
      TORCH_CHECK(!(c10::GradMode::is_enabled() && t.requires_grad()), op.name,
                  foreach ? "_foreach" : "", ": argument '", def.input_names[def.updated[u]], "'",
                  Position{foreach, k},
                  " requires grad and is updated in place while grad mode is on; run the op "
                  "under torch.no_grad() (as optimizers step), or pass a tensor that does not "
                  "require grad");
      updated.push_back(t);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  for (const at::Tensor& t : updated) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

class StepKernel final : public c10::OperatorKernel {
 public:
  StepKernel(const StepOp* op, bool foreach, Key key) : op_(op), foreach_(foreach), key_(key) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    if (key_ == Key::kAutograd) {
      run_autograd(*op_, foreach_, handle, keys, stack);
      return;
    }
    StepArgs a = read_args(*op_->def, foreach_, *stack);
    const Device device = key_ == Key::kCpu    ? Device::kCpu
                          : key_ == Key::kMeta ? Device::kMeta
                                               : Device::kCuda;
    run_step(*op_, device, a);
    torch::jit::drop(*stack, stack_count(*op_->def, foreach_));
  }

 private:
  const StepOp* op_;
  bool foreach_;
  Key key_;
};

}  // namespace
}  // namespace fusegen::rt
#pragma GCC visibility pop

namespace fusegen {

using namespace rt;  // NOLINT: the runtime's own internals

namespace {

bool register_step_or_throw(const StepDef& def) {
  TORCH_CHECK(def.abi == kStepAbi, "fusegen::", def.name,
              ": built against fusegen-runtime.h step ABI ", def.abi, ", but the runtime has ",
              kStepAbi, "; rebuild the op");
  TORCH_CHECK(def.num_updated + def.num_reads <= kStepMaxOperands &&
                  def.num_scalars <= kStepMaxScalars,
              "fusegen::", def.name, ": too many operands or scalars for the step kernel");
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* op = new StepOp{&def, "fusegen::" + std::string(def.name),
                        "fusegen::" + std::string(def.name) + "_foreach"};
  const char* file = "fusegen-step.cpp";
  auto* defs =
      new torch::Library(torch::Library::FRAGMENT, "fusegen", std::nullopt, file, __LINE__);
  defs->def(def.schema);
  defs->def(def.foreach_schema);
  libraries().push_back(defs);
  const std::string plain = def.name;
  const std::string foreach = plain + "_foreach";
  for (const auto& [dispatch_key, key] : kKeys) {
#ifndef FUSEGEN_WITH_CUDA
    if (key == Key::kCuda) continue;  // a runtime built without CUDA
#endif
    if (key == Key::kCuda && def.cuda == nullptr) continue;  // an op built without CUDA
    auto* impls = new torch::Library(torch::Library::IMPL, "fusegen", dispatch_key, file, __LINE__);
    for (const bool lists : {false, true}) {
      impls->impl((lists ? foreach : plain).c_str(),
                  torch::CppFunction::makeFromBoxedFunctor(
                      std::make_unique<StepKernel>(op, lists, key)));
    }
    libraries().push_back(impls);
  }
  return true;
}

}  // namespace

bool register_step(const StepDef& def) {
  return registered_or_kept(def.name, [&] { return register_step_or_throw(def); });
}

}  // namespace fusegen
