// fusegen-runtime-impl.h: what the runtime's translation units share (fusegen-layout.cpp,
// fusegen-autograd.cpp, fusegen-registration.cpp): the registered op, its arguments off
// the dispatcher's stack, and the entry points of each unit. Only the runtime includes it.
#ifndef FUSEGEN_RUNTIME_IMPL_H_
#define FUSEGEN_RUNTIME_IMPL_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fusegen-runtime.h"

#ifdef FUSEGEN_WITH_CUDA
#include <ATen/TensorIterator.h>
#endif

namespace torch {
class Library;
}  // namespace torch

// Internal to the runtime library: not exported beside register_op.
#pragma GCC visibility push(hidden)

namespace fusegen::rt {

// Set on this thread while a forward that records its backward runs its kernels
// (record_forward): a forward kernel that NVRTC compiles meanwhile starts the compile of
// its backward's on another thread (fusegen-rtc.cpp), so that a new op's first backward
// finds its kernel compiled, or nearly.
inline thread_local bool backward_expected = false;
struct BackwardExpected {
  explicit BackwardExpected(bool expected) : previous(backward_expected) {
    backward_expected = expected;
  }
  ~BackwardExpected() { backward_expected = previous; }
  BackwardExpected(const BackwardExpected&) = delete;
  BackwardExpected& operator=(const BackwardExpected&) = delete;
  const bool previous;
};

// One tensor argument with the name it has in the schema, for error messages.
struct Arg {
  const char* name;
  const at::Tensor& tensor;
  bool index = false;      // a gather's index (OpDef::index_inputs): integers, not promoted
  bool row_value = false;  // a row value the forward saved (OpDef::num_saved_rows): one per
                           // row, in the compute type, not promoted
};
using Args = std::vector<Arg>;

// Whether input i (an index into the inputs, or kResult) is a gather's index.
inline bool is_index(const OpDef& def, int i) {
  return def.index_inputs != nullptr && i >= 0 && def.index_inputs[i];
}

// ---------------------------------------------------------------------------------------
// One registered op: its descriptor, plus the names the runtime derives from it.

struct Op {
  const OpDef* def;
  std::string name;           // "<name>"
  std::string backward_name;  // "<name>_backward"
  std::string backward_event;  // "fusegen::<name>_backward": the profiler's name of a backward call
  std::string
      node_name;  // "FusedBackward(fusegen::<name>)": its autograd node's name (grad_fn.name(),
                  // the profiler's backward events; not "fusegen::...", which names ops)
  std::string
      double_node_name;  // "FusedDoubleBackward(fusegen::<name>_backward)": the backward's node
  std::string sampled_name;    // "<name>_sampled": an op that draws random numbers
  std::optional<c10::OperatorHandle> forward_op;   // fusegen::<name>, looked up once
  std::optional<c10::OperatorHandle> backward_op;  // fusegen::<name>_backward
  std::optional<c10::OperatorHandle> sampled_op;   // fusegen::<name>_sampled
  // The descriptor whose CPU kernels run: def, or for def->cpu_later the op built whole
  // (cpu_kernels_of), once its library is loaded.
  mutable std::atomic<const OpDef*> cpu{nullptr};
  bool has_backward() const { return def->num_kernel_grads > 0; }
};

// The descriptor of `op` whose CPU kernels to run: loads them first, through fusegen's
// Python side, when they come later (OpDef::cpu_later).
const OpDef& cpu_kernels_of(const Op& op);

// Calls fusegen::<hook>(name), an op fusegen's Python side registers (__auxiliary,
// __cpu_kernels); false when it is not registered (a standalone build).
bool call_hook(const char* hook, const std::string& name);

// A tensor argument off the dispatcher's stack; None (from Python) is an undefined tensor,
// which check_defined reports by name.
inline at::Tensor tensor_arg(const c10::IValue& v) {
  return v.isNone() ? at::Tensor() : v.toTensor();
}

// The forward's arguments off the stack (tensors, then scalars), which stay on it.
struct ForwardArgs {
  std::vector<at::Tensor> tensors;
  std::vector<double> scalars;

  ForwardArgs(const OpDef& def, const torch::jit::Stack& stack) {
    const size_t first = stack.size() - def.num_inputs - def.num_scalars;
    for (int i = 0; i < def.num_inputs; ++i) tensors.push_back(tensor_arg(stack[first + i]));
    for (int i = 0; i < def.num_scalars; ++i)
      scalars.push_back(stack[first + def.num_inputs + i].toDouble());
  }
  Args named(const OpDef& def) const {
    Args args;
    for (int i = 0; i < def.num_inputs; ++i)
      args.push_back({def.input_names[i], tensors[i], is_index(def, i)});
    return args;
  }
};

// The backward's tensor arguments: one dout per output, then the inputs it reads, then (an
// op that draws random numbers) the state its forward drew with.
inline int backward_tensors(const OpDef& def) {
  return def.num_outputs + def.num_backward_inputs + (def.num_random > 0 ? 1 : 0);
}

// The forward's results: its outputs, or one tensor that holds two (OpDef::joined).
inline int num_results(const OpDef& def) { return def.joined ? 1 : def.num_outputs; }

// The two halves of a joined op's result (or of its gradient) along the last dimension.
inline std::vector<at::Tensor> halves_of(const at::Tensor& whole) {
  const c10::SymInt half = whole.sym_size(-1) / 2;
  return {whole.narrow_symint(-1, 0, half), whole.narrow_symint(-1, half, half)};
}

// The backward's name for the incoming gradient of output k (its schema's).
inline const char* dout_name(const OpDef& def, int k) {
  static constexpr const char* kNames[kMaxOutputs] = {"dout0", "dout1", "dout2", "dout3",
                                                      "dout4", "dout5", "dout6", "dout7"};
  return def.num_outputs == 1 ? "dout" : kNames[k];
}

// The backward's arguments: the douts, the inputs it reads, its scalars, output_mask.
struct BackwardArgs {
  std::vector<at::Tensor> tensors;  // the douts first
  std::vector<double> scalars;
  std::vector<bool> mask;

  BackwardArgs() = default;
  BackwardArgs(const OpDef& def, const torch::jit::Stack& stack) {
    const int num_tensors = backward_tensors(def);
    const size_t count = num_tensors + def.num_backward_scalars + 1;
    const size_t first = stack.size() - count;
    for (int i = 0; i < num_tensors; ++i) tensors.push_back(tensor_arg(stack[first + i]));
    for (int i = 0; i < def.num_backward_scalars; ++i) {
      scalars.push_back(stack[first + num_tensors + i].toDouble());
    }
    const c10::List<bool> list = stack[first + count - 1].toBoolList();
    // The schema's bool[K] is not checked by the dispatcher: a longer or shorter mask would
    // index past the kernel's outputs.
    TORCH_CHECK(static_cast<int>(list.size()) == def.num_kernel_grads, "fusegen::", def.name,
                "_backward: argument 'output_mask' must have ", def.num_kernel_grads,
                " entries (one per gradient the backward kernel computes), got ", list.size());
    for (bool b : list) mask.push_back(b);
  }
  // Named arguments (the douts, then the tensors the backward reads, by the user's names).
  static Args of(const OpDef& def, const std::vector<at::Tensor>& tensors) {
    Args args;
    for (int k = 0; k < def.num_outputs; ++k) args.push_back({dout_name(def, k), tensors[k]});
    for (int i = 0; i < def.num_backward_inputs; ++i)
      args.push_back({def.backward_input_names[i], tensors[def.num_outputs + i],
                      is_index(def, def.backward_inputs[i])});
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


enum class Device { kCpu, kMeta, kCuda };

// ---------------------------------------------------------------------------------------
// fusegen-layout.cpp: argument checks, type promotion and the kernels over TensorIterator.

void check_defined(const std::string& op, const Args& args);
const Arg& device_arg(const Args& args);
at::ScalarType check_args(const std::string& op, const Args& args);
std::vector<at::Tensor> kernel_inputs(const Args& args, at::ScalarType dtype,
                                      const c10::Device device);
Dtype kernel_dtype(at::ScalarType t);
// A backward's random numbers: those its forward drew, from the state (rng_state) it saved.
Random saved_random(const std::string& op, const at::Tensor& state, c10::Device on);
// sampled: also return the random state drawn with (fusegen::<name>_sampled's last result).
// saved_rows (a row op with OpDef::num_saved_rows): also write the row values its backward
// reads, into it (one tensor, the values side by side in its last dimension).
std::vector<at::Tensor> run_forward(const Op& op, Device device, const ForwardArgs& a,
                                    bool sampled = false, at::Tensor* saved_rows = nullptr);
// summed (a row op's, per kernel output, then for dout): sum it over the rows in the
// kernel (run_rows), dout into *dout_sum.
// saved_rows (a row op with OpDef::num_saved_rows, called by its autograd node): the row
// values its forward saved (run_forward), which saved_backward_* read.
std::vector<at::Tensor> run_backward(const Op& op, Device device, const BackwardArgs& a,
                                     const std::vector<at::Tensor>& given = {},
                                     const std::vector<bool>& summed = {},
                                     const at::Tensor* saved_rows = nullptr,
                                     at::Tensor* dout_sum = nullptr);

// The kernel's operands for one step of TensorIterator's loop: `present[k]` says whether
// output k of the kernel is one of the iterator's outputs (a requested gradient); absent
// ones get a null pointer and stride 0. Inputs follow, as the iterator has them, then (a
// backward that sums in the kernel: fusegen-cuda.cuh, Accumulating) one operand per
// entry of `sums`, the iterator's inputs after the kernel's where defined.
struct Operands {
  std::vector<int> slot;  // per kernel operand: its index in the iterator, or -1

  Operands(const std::vector<bool>& present, int num_inputs,
           const std::vector<at::Tensor>& sums = {}) {
    int next = 0;
    for (bool p : present) slot.push_back(p ? next++ : -1);
    for (int j = 0; j < num_inputs; ++j) slot.push_back(next++);
    for (const at::Tensor& t : sums) slot.push_back(t.defined() ? next++ : -1);
  }
  int size() const { return static_cast<int>(slot.size()); }
};
#ifdef FUSEGEN_WITH_CUDA
at::TensorIterator make_iterator(int num_outputs, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& sums = {},
                                 c10::ArrayRef<at::Tensor> given = {}, bool linear = false);
void launch_cuda(const at::TensorIterator& iter, const Operands& ops, CudaKernel kernel,
                 Dtype dtype, const double* scalars, const Random* random = nullptr);
#endif

// ---------------------------------------------------------------------------------------
// fusegen-autograd.cpp: the Autograd kernel of an op (forward, or backward: `backward`).

void run_autograd(const Op& op, bool backward, const c10::OperatorHandle& handle,
                  c10::DispatchKeySet keys, torch::jit::Stack* stack);

// ---------------------------------------------------------------------------------------
// fusegen-registration.cpp: the registered ops, by name (nullptr: not registered).

const Op* find_op(const std::string& name);

// The dispatch keys every op (register_op) and step op (register_step) has a kernel for.
enum class Key { kCpu, kMeta, kCuda, kAutograd };
struct KeyOf {
  c10::DispatchKey dispatch;
  Key key;
};
inline constexpr KeyOf kKeys[] = {
    {c10::DispatchKey::CPU, Key::kCpu},
    {c10::DispatchKey::Meta, Key::kMeta},
    {c10::DispatchKey::CUDA, Key::kCuda},
    {c10::DispatchKey::Autograd, Key::kAutograd},
};

// The registrations' lock and their torch::Library objects, alive for the rest of the
// process (never destroyed: unregistering at exit, after torch's own teardown began, is not
// worth the risk). Function-local statics: an op compiled into the same library (a
// standalone build) may register from its static initializer before namespace-scope
// objects of the runtime would have been constructed.
std::mutex& registry_mutex();

// Runs a registration from a static initializer: true, or false with its error kept for
// fusegen_load_errors (an exception there would end the process).
bool registered_or_kept(const char* name, const std::function<bool()>& registration);
std::vector<torch::Library*>& libraries();

}  // namespace fusegen::rt
#pragma GCC visibility pop

#endif  // FUSEGEN_RUNTIME_IMPL_H_
