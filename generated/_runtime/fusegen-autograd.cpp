// fusegen-autograd.cpp: autograd for every op. The forward records a hand-written node
// (FusedBackward) that calls <name>_backward, whose own autograd kernel records another
// (FusedDoubleBackward) that calls <name>_grad2_backward; forward-mode AD sets the
// output's tangent from <name>_jvp, as PyTorch's generated autograd kernels do. The nodes
// work under compiled autograd too (FusedBackward::compiled_args, apply_with_saved).
#include "fusegen-runtime-impl.h"

#include <ATen/ExpandUtils.h>
#include <ATen/record_function.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>  // (with compiled autograd's PackedArgs)
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#ifdef FUSEGEN_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <utility>

// Internal to the runtime library: not exported beside register_op.
#pragma GCC visibility push(hidden)

namespace fusegen::rt {

using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------
// Autograd: the forward redispatches below autograd to fusegen::<name>; the backward calls
// fusegen::<name>_backward. Both go through the dispatcher, so torch.compile and opcheck
// see ordinary ops.

// What a gradient needs of its input: the dtype and the sizes it is summed back to.
struct InputMeta {
  at::ScalarType dtype;
  c10::SymDimVector sizes;

  explicit InputMeta(const at::Tensor& t)
      : dtype(t.scalar_type()), sizes(t.sym_sizes().begin(), t.sym_sizes().end()) {}
  InputMeta(at::ScalarType type, c10::SymIntArrayRef shape)
      : dtype(type), sizes(shape.begin(), shape.end()) {}
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
// sums even then when the shape is 0-d); one of fewer dimensions than the input, a row
// op's summed over the rows in its kernel (one value per column), is only reshaped.
at::Tensor reduce_to_input(const InputMeta& meta, const at::Tensor& grad) {
  const c10::SymIntArrayRef sizes(meta.sizes);
  const bool summed = grad.dim() < static_cast<int64_t>(sizes.size());
  at::Tensor g = grad.sym_sizes() == sizes ? grad
                 : summed                  ? grad.view_symint(sizes)
                                           : at::sum_to(grad, sizes);
  return g.scalar_type() == meta.dtype ? g : g.to(meta.dtype);
}

// A gradient of dout alone (GradDef::steps): the eager ops, in order.
at::Tensor apply_steps(const GradDef& grad, const at::Tensor& dout) {
  at::Tensor g = dout;
  for (int s = 0; s < grad.num_steps; ++s) {
    const DoutStep& step = grad.steps[s];
    g = step.op == '-'   ? at::neg(g)
        : step.op == '*' ? at::mul(g, step.value)
                         : at::div(g, step.value);
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
// outputs kernel_request asks for or from eager ops on dout_of(i) (dout, or its sum over
// the rows where the kernel made it: first_order_grads). `call(mask)` runs the backward
// kernel (through the dispatcher, or directly: first_order_grads) and returns the
// requested outputs; dout_of is asked after it.
template <typename Needs, typename Call, typename DoutOf>
void gradients_of(const OpDef& def, c10::ArrayRef<InputMeta> meta, Needs&& needs, Call&& call,
                  DoutOf&& dout_of, variable_list& grads) {
  const KernelRequest request = kernel_request(def, needs);
  std::vector<at::Tensor> computed(def.num_kernel_grads);
  if (request.run) {
    const std::vector<at::Tensor> out = call(request.mask);
    for (int k = 0, next = 0; k < def.num_kernel_grads; ++k) {
      if (request.mask[k]) computed[k] = out[next++];
    }
  }
  // by the first input with the same steps of the same dout
  std::vector<at::Tensor> from_dout(def.num_inputs);
  std::vector<at::Tensor> source(def.num_inputs);
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    at::Tensor full = g.output >= 0 ? computed[g.output] : at::Tensor();
    if (!full.defined() && g.num_steps >= 0) {
      source[i] = dout_of(i);
      for (int j = 0; j < i && !full.defined(); ++j) {
        if (from_dout[j].defined() && source[j].is_same(source[i]) &&
            def.grads[j].steps == g.steps && def.grads[j].num_steps == g.num_steps)
          full = from_dout[j];
      }
      if (!full.defined()) full = from_dout[i] = apply_steps(g, source[i]);
    }
    if (full.defined()) grads[i] = reduce_to_input(meta[i], full);
  }
}

template <typename Needs, typename Call>
void gradients_of(const OpDef& def, const at::Tensor& dout, c10::ArrayRef<InputMeta> meta,
                  Needs&& needs, Call&& call, variable_list& grads) {
  gradients_of(def, meta, needs, call, [&](int) { return dout; }, grads);
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

// A plain dense CPU or CUDA tensor: no subclass (DTensor, FakeTensor, functorch's
// wrappers), no lazy conjugate or negative view, no symbolic sizes.
bool is_plain(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
       c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Conjugate,
       c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  return t.defined() && (t.is_cpu() || t.is_cuda()) && t.layout() == at::kStrided &&
         !t.key_set().has_any(wrapped) && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// Whether t has a forward-mode tangent. Level 0 is the one level eager forward AD has, and
// torch.func's jvp gives each of its levels wrapper tensors of their own, whose tangent is
// at level 0 too: PyTorch's generated autograd kernels read the same (isFwGradDefined). A
// tensor without autograd metadata (no requires_grad, no tangent) answers with a pointer test.
bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// Whether this runtime's CPU or CUDA kernel may be called directly on `tensors`, instead of
// through the dispatcher: no dispatch key forced on for the thread (a TorchDispatchMode,
// FakeTensorMode under torch.compile, functorch's transforms, the Python dispatcher), and
// every tensor a plain dense CPU or CUDA tensor without a forward-mode tangent (no subclass
// such as DTensor or FakeTensor, no lazy conjugate or negative view). The dispatcher would
// then reach this file's own kernel, after boxing the call.
bool plain_call_ok(c10::ArrayRef<at::Tensor> tensors) {
  // Included beyond the defaults (BackendSelect, ADInplaceOrView), that is.
  const c10::DispatchKeySet forced =
      c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set;
  if (!forced.empty()) return false;
  for (const at::Tensor& t : tensors) {
    if (!is_plain(t) || has_tangent(t)) return false;  // a tangent: the autograd kernel's own
  }
  return true;
}

// Whether a backward may run its kernel directly (plain_call_ok), with grad mode off as well
// (nothing to record for a double backward). The direct call keeps the profiler's event of
// that op.
bool direct_call_ok(const variable_list& douts, const std::vector<at::Tensor>& saved) {
  return !at::GradMode::is_enabled() && plain_call_ok(douts) && plain_call_ok(saved);
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
  static SplitHalves unpacked(const std::vector<int64_t>& v) {
    return {int(v[0]), int(v[1]), v[2]};
  }
};

// The SplitHalves among a forward call's inputs (edges: theirs), if any: plain tensors at
// the two outputs of one split node (chunk or split into two) of a tensor u, any u (a view
// too: q.view(batch, seq, heads, dim).chunk(2, -1)), and no hook or retain_grad on the
// split's node (those would see the halves' gradients). u's shape is the one the node its
// gradient goes to expects (its input metadata), and the split's dimension the one along
// which the halves' sizes add up to it (they equal u's along every other).
SplitHalves find_split_halves(const std::vector<at::Tensor>& tensors,
                              const torch::autograd::edge_list& edges) {
  static const std::array<std::string, 2> kSplits = {"SplitBackward0", "SplitWithSizesBackward0"};
  SplitHalves h;
  torch::autograd::Node* split = nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::autograd::Edge& e = edges[i];
    if (!e.is_valid() || !tensors[i].is_view() || e.function->num_inputs() != 2)
      continue;  // is_view first: cheap
    if (std::find(kSplits.begin(), kSplits.end(), e.function->name()) == kSplits.end()) continue;
    int& half = e.input_nr == 0 ? h.low : h.high;
    if (half >= 0 || (split != nullptr && split != e.function.get()))
      return {};  // a half twice, or two splits
    half = static_cast<int>(i);
    split = e.function.get();
  }
  if (h.low < 0 || h.high < 0) return {};
  if (!split->pre_hooks().empty() || !split->tensor_pre_hooks().empty() ||
      !split->retains_grad_hooks().empty() || !split->post_hooks().empty() ||
      split->num_outputs() != 1) {
    return {};
  }
  const at::Tensor& a = tensors[h.low];
  const at::Tensor& b = tensors[h.high];
  const torch::autograd::Edge& to_u = split->next_edge(0);
  if (!is_plain(a) || !is_plain(b) || !to_u.is_valid()) return {};
  const torch::autograd::InputMetadata& u = to_u.function->input_metadata(to_u.input_nr);
  if (u.is_tensor_subclass() || u.is_nested_tensor()) return {};
  const c10::SymIntArrayRef shape = u.shape_as_dim_vector();
  const int64_t dims = static_cast<int64_t>(shape.size());
  if (a.dim() != dims || b.dim() != dims) return {};
  int64_t dim = -1;
  for (int64_t d = 0; d < dims; ++d) {
    const std::optional<int64_t> size = shape[d].maybe_as_int();  // (none: symbolic)
    if (!size) return {};
    if (a.size(d) == *size && b.size(d) == *size) continue;
    if (dim >= 0 || a.size(d) + b.size(d) != *size || a.size(d) == 0 || b.size(d) == 0) return {};
    dim = d;
  }
  if (dim < 0) return {};
  h.dim = dim;
  return h;
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
    return c10::SymIntArrayRef(meta[i].sizes) == dout.sym_sizes() &&
           meta[i].dtype == dout.scalar_type();
  };
  if (low.output < 0 || high.output < 0 || low.output == high.output || !fits(split.low) ||
      !fits(split.high)) {
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
    const auto zeros = [&](int i) {
      return at::zeros_symint(meta[i].sizes, like.options().dtype(meta[i].dtype));
    };
    low =
        at::cat({low.defined() ? low : zeros(split.low), high.defined() ? high : zeros(split.high)},
                split.dim);
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
bool accumulates_in_kernel(const Op& op, const variable_list& douts,
                           const std::vector<at::Tensor>& saved, c10::ArrayRef<double> scalars,
                           c10::ArrayRef<InputMeta> meta, Needs&& needs, variable_list& grads) {
  const OpDef& def = *op.def;
  const int count = def.num_kernel_grads;
  const at::Tensor& dout = douts[0];  // (several: one shape, one dtype)
  if (def.rows || def.backward_cuda == nullptr || !def.backward_accumulates || !dout.is_cuda() ||
      at::globalContext().deterministicAlgorithms() ||
      backward_tensors(def) + 2 * count + 1 > kMaxVectorOperands) {  // Accumulating<F>::kOperands
    return false;
  }
  // A gradient with as many elements as dout has nothing to sum (at most size-1 dimensions to
  // drop).
  const auto nothing_to_sum = [&](int i) {
    int64_t numel = 1;
    for (const c10::SymInt& d : meta[i].sizes) numel *= d.expect_int();
    return numel == dout.numel();
  };
  // Per kernel output (and dout, at index count): the input whose shape it is summed to
  // (kFull: none, inputs of two shapes take it), and whether it is also written at the
  // broadcast shape (wide: an input of that shape takes it, as x's gradient and a bias's
  // are one output of bias-dropout-add's backward; the kernel writes and sums it at once).
  constexpr int kNone = -1, kFull = -2;
  const KernelRequest request = kernel_request(def, needs);
  std::vector<int> target(count + 1, kNone);
  std::vector<bool> wide(count + 1, false);
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    const int k = g.output >= 0 ? g.output : g.num_steps >= 0 ? count : kNone;
    if (k == kNone) continue;
    if (nothing_to_sum(i)) {
      wide[k] = true;
    } else if (target[k] == kNone) {
      target[k] = i;
    } else if (k < count && target[k] >= 0 && meta[target[k]].sizes != meta[i].sizes) {
      target[k] = kFull;
    }
  }
  bool any = false;
  for (int t : target) any = any || t >= 0;
  if (!request.run || !any) return false;

  std::vector<at::Tensor> tensors(douts.begin(), douts.end());
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
    present[k] = request.mask[k] && (target[k] < 0 || wide[k]);
    num_outputs += present[k];
  }
  for (int k = 0; k <= count; ++k) {
    if (target[k] < 0)
      continue;  // (a kernel output's target is one of the inputs that requested it)
    std::vector<int64_t> sizes;
    for (const c10::SymInt& d : meta[target[k]].sizes) sizes.push_back(d.expect_int());
    sums[k] = at::zeros(sizes, inputs.front().options().dtype(at::kFloat));
  }
  // An op that draws random numbers: its forward's, in its loop's linear order.
  const bool random = def.num_random > 0;
  at::TensorIterator iter = make_iterator(num_outputs, inputs, sums, {}, random);
  if (iter.numel() == 0 || iter.is_contiguous() || iter.shape()[0] % kAccumulatingWidth != 0 ||
      !iter.can_use_32bit_indexing()) {
    return false;
  }
  {
    RECORD_FUNCTION(op.backward_event.c_str(), std::vector<c10::IValue>());
    const Random drawn = random ? saved_random(op.backward_name, saved.back(), on) : Random();
    launch_cuda(iter, Operands(present, static_cast<int>(inputs.size()), sums), def.backward_cuda,
                kernel_dtype(dtype), scalars.data(), random ? &drawn : nullptr);
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
      const bool from_sum = sums[g.output].defined() && !nothing_to_sum(i);
      grad = from_sum ? sums[g.output] : full[g.output];
    } else if (g.num_steps >= 0) {
      const bool from_sum = sums[count].defined() && meta[target[count]].sizes == meta[i].sizes;
      grad = apply_steps(g, from_sum ? sums[count] : dout);
    }
    if (grad.defined()) grads[i] = reduce_to_input(meta[i], grad);
  }
  return true;
}
#endif

// The incoming gradients of an op's outputs, as its backward kernel reads them: false when
// none arrived; otherwise an undefined one (an output not used in the loss) counts as zero,
// a 0-d zero expanded to the others' shape (stride 0: the kernel reads no memory for it).
bool complete_douts(variable_list& douts) {
  if (douts.size() == 1) return douts[0].defined();
  const auto given = std::find_if(douts.begin(), douts.end(),
                                  [](const at::Tensor& t) { return t.defined(); });
  if (given == douts.end()) return false;
  for (at::Tensor& t : douts) {
    if (!t.defined()) t = at::zeros({}, given->options()).expand_symint(given->sym_sizes());
  }
  return true;
}

// A row op's rows' length: the broadcast shape's last dimension, the inputs' largest.
c10::SymInt row_length(c10::ArrayRef<InputMeta> meta) {
  c10::SymInt length = 1;
  for (const InputMeta& m : meta) {
    if (!m.sizes.empty() && m.sizes.back() > length) length = m.sizes.back();
  }
  return length;
}

// Whether an input of a row op is one value per column: its sizes 1 but the last, the
// rows' length, as a weight of shape (H,) or (1, H) is.
bool per_column(const InputMeta& m, const c10::SymInt& length) {
  if (m.sizes.empty() || m.sizes.back() != length) return false;
  return std::all_of(m.sizes.begin(), m.sizes.end() - 1,
                     [](const c10::SymInt& d) { return d == 1; });
}

// Per kernel output of a row op's backward (mask: those requested), then for dout (the
// backward's input 0), whether its kernel sums it over the rows (run_rows, summed): an
// output when every input that takes it, and needs it, is one value per column
// (per_column), as a weight's gradient is; dout when such an input's gradient is steps of
// dout alone, as a bias's is (the steps, linear, then apply to the sum). The kernel adds
// it up as it computes it, where a gradient at the broadcast shape would be written and
// read again by ATen's sum (dout, read again). On CUDA only where the op's kernels sum
// (not an auxiliary op's: backward_accumulates).
template <typename Needs>
std::vector<bool> row_sums(const OpDef& def, c10::ArrayRef<InputMeta> meta, Needs&& needs,
                           const std::vector<bool>& mask, bool cuda) {
  std::vector<bool> summed;
  if (!def.rows || (cuda && !def.backward_accumulates)) return summed;
  const c10::SymInt length = row_length(meta);
  summed.assign(mask.begin(), mask.end());
  bool dout = false;
  for (int i = 0; i < def.num_inputs; ++i) {
    if (!needs(i)) continue;
    const GradDef& g = def.grads[i];
    const bool column = per_column(meta[i], length);
    if (g.output >= 0 && !column) summed[g.output] = false;
    dout = dout || (g.output < 0 && g.num_steps >= 0 && column);
  }
  summed.push_back(dout);
  return summed;
}

// The first-order gradients of `op`'s inputs for which needs(i) holds: the eager ops of dout
// alone, or <name>_backward over dout and `saved` (the tensors the backward reads). Without
// create_graph nothing differentiates the backward, so its autograd kernel is skipped, and
// for plain tensors its kernel is called directly (direct_call_ok), on CUDA summing the
// gradients of broadcast inputs in the kernel where it can (accumulates_in_kernel; a row
// op's kernel sums a weight's on the CPU and CUDA: row_sums); with
// create_graph, the autograd kernel records FusedDoubleBackward (double backward).
// With SplitHalves, both halves' gradients are computed when u's is needed (its edge is in
// the low half's place) and joined into it (split_gradient, join_halves).
// saved_rows: the row values the forward saved (a row op's, where it called its kernels
// itself), which the direct call reads instead of computing them again.
template <typename Needs>
variable_list first_order_grads(const Op& op, variable_list douts, std::vector<at::Tensor> saved,
                                c10::ArrayRef<double> scalars, c10::ArrayRef<InputMeta> meta,
                                const SplitHalves& split, Needs&& needs_edge,
                                const at::Tensor& saved_rows = at::Tensor()) {
  const OpDef& def = *op.def;
  variable_list grads(def.num_inputs);
  if (def.joined && douts.size() == 1)  // the result's gradient: the halves are the outputs'
    douts = douts[0].defined() ? halves_of(douts[0]) : variable_list(2);
  if (!complete_douts(douts))
    return grads;  // no gradient arrived: the inputs' are zero too (undefined), as in eager's nodes
  const at::Tensor& dout = douts[0];
  const auto needs = [&](int i) {
    return needs_edge(split.active() && i == split.high ? split.low : i);
  };
  const bool direct = direct_call_ok(douts, saved);
  std::vector<at::Tensor>
      given;  // per kernel output: where the kernel writes it (the halves of `whole`)
  const at::Tensor whole = direct && split.active() && needs(split.low)
                               ? split_gradient(def, split, dout, meta, given)
                               : at::Tensor();
#ifdef FUSEGEN_WITH_CUDA
  if (direct && !whole.defined() &&
      accumulates_in_kernel(op, douts, saved, scalars, meta, needs, grads)) {
    if (split.active()) join_halves(split, meta, whole, given, def, grads);
    return grads;
  }
#endif
  at::Tensor dout_sum;  // (the direct call of a row op: dout summed over the rows, row_sums)
  const auto call = [&](const std::vector<bool>& mask) {
    BackwardArgs a;
    a.tensors.reserve(douts.size() + saved.size());
    a.tensors.insert(a.tensors.end(), douts.begin(), douts.end());  // (dout: read after this)
    for (at::Tensor& t : saved) a.tensors.push_back(std::move(t));
    a.scalars.assign(scalars.begin(), scalars.end());
    a.mask = mask;
    if (direct) {
      RECORD_FUNCTION(op.backward_event.c_str(), std::vector<c10::IValue>());
      const bool cuda = device_arg(a.named(def)).tensor.is_cuda();
      const std::vector<bool> summed =
          given.empty() ? row_sums(def, meta, needs, mask, cuda) : std::vector<bool>();
      return run_backward(op, cuda ? Device::kCuda : Device::kCpu, a, given, summed, &saved_rows,
                          &dout_sum);
    }
    torch::jit::Stack stack;
    a.push(stack);
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    op.backward_op->callBoxed(stack);
    return std::move(stack.back()).toTensorVector();
  };
  const auto dout_of = [&](int i) {  // (asked for gradients of dout alone: row_sums' rule)
    return dout_sum.defined() && per_column(meta[i], row_length(meta)) ? dout_sum : dout;
  };
  gradients_of(def, meta, needs, call, dout_of, grads);
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
  return first_order_grads(*op, inputs, std::move(saved), scalars, meta, split,
                           [&](int i) { return needs[i]; });
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
    saved_rows_.reset_data();
  }

  variable_list apply(variable_list&& douts) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_order_grads(*op_, std::move(douts), unpack_saved(), scalars_, meta_, split_,
                             [&](int i) { return task_should_compute_output(i); },
                             saved_rows_.unpack());
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

  variable_list apply_with_saved(const variable_list& inputs,
                                 torch::dynamo::autograd::SwapSavedVariables& swap) override {
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
    for (const c10::IValue& v : state)
      schema.push_back(v.isTensor() ? at::TensorType::get() : v.type());
    const auto& compiler = ca::getPyCompilerInterface();
    const std::string fn =
        compiler->bind_function(swap.get_py_compiler(), op_->node_name, apply_functional, schema,
                                /*is_custom_function=*/true, /*is_traceable=*/true);
    variable_list out = compiler->call_function(
        swap.get_py_compiler(), "apply_functional", fn, inputs, state,
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
  // A row op's row values the forward saved (OpDef::num_saved_rows), where it ran its kernels
  // directly (record_forward); compiled autograd and a create_graph backward compute them
  // again, through <name>_backward.
  torch::autograd::SavedVariable saved_rows_;

 private:
  // Whether saved tensor i is the forward's output (saved as an output); the random state
  // of an op that draws comes after the backward's inputs.
  bool is_output(size_t i) const {
    return i < static_cast<size_t>(op_->def->num_backward_inputs) &&
           result_output(op_->def->backward_inputs[i]) >= 0;
  }

  // The saved tensors; an output is saved without its grad_fn (this node: no cycle) and
  // gets it back here.
  std::vector<at::Tensor> unpack_saved() {
    std::vector<at::Tensor> out;
    out.reserve(saved_.size());
    for (size_t i = 0; i < saved_.size(); ++i)
      out.push_back(saved_[i].unpack(is_output(i) ? getptr() : nullptr));
    return out;
  }
};

// An auxiliary op of the family (<name>_grad2, <name>_jvp): fusegen's Python side builds
// them on first use, not with the op, and registers fusegen::__auxiliary, which builds and
// loads the one named (its library registers it here) and returns once it is. A standalone
// build has them in its own library, and no hook. nullptr: not loaded, and no way to load it.
const Op* find_auxiliary(const std::string& name) {
  if (const Op* op = find_op(name)) return op;
  if (!call_hook("__auxiliary", name)) return nullptr;
  return find_op(name);
}

// The backward's own derivative (double backward), fused: <name>_backward computes
// grad_k = dout * f_k(x); the gradients gg_k arriving at its outputs make
// h(dout, x, gg) = sum_k gg_k * grad_k, whose gradients are the double backward. fusegen
// builds the op <name>_grad2 with forward h (on first use; a standalone build, into the
// op's library), so this calls <name>_grad2_backward once with incoming gradient 1. Above
// second order fusegen's Python side registers an autograd kernel for
// <name>_grad2_backward that computes it as eager torch ops (fusegen/pytorch/autograd.py);
// without it (a standalone build) this fails loudly, as <name>_grad2 has no
// <name>_grad2_grad2. A hand-written node, as FusedBackward is, and not a
// torch::autograd::Function: torch.func refuses those in every transform, while a node
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
    TORCH_CHECK_NOT_IMPLEMENTED(
        grad2 != nullptr && grad2->has_backward(), "fusegen::", op.name,
        ": the derivative of its backward needs fusegen::", op.name,
        "_grad2, which is not loaded (a library built without fusegen fuses first and "
        "second derivatives; load the op with fusegen (fusegen.fuse / @fused) for any order)");
    const OpDef& def2 = *grad2->def;
    std::vector<at::Tensor> saved;  // the douts, the tensors the backward read
    saved.reserve(saved_.size());
    for (torch::autograd::SavedVariable& v : saved_) saved.push_back(v.unpack());
    const int own = backward_tensors(def);
    // The douts and the tensors the backward reads, which <name>_grad2 takes first; an op
    // that draws random numbers has its state after them, which <name>_grad2_backward takes
    // last (it draws the forward's numbers again, as the backward did).
    const int differentiable = def.num_outputs + def.num_backward_inputs;
    variable_list grads(own);
    // <name>_grad2's inputs: the douts, the backward's tensors, then gg_k per kernel output.
    std::vector<at::Tensor> inputs(saved.begin(), saved.begin() + differentiable);
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
    gradients_of(def2, ones, meta_,
                 [&](int i) { return i < differentiable && task_should_compute_output(i); },
                 [&](const std::vector<bool>& mask2) {
      BackwardArgs a;
      a.tensors.push_back(one);
      for (int i = 0; i < def2.num_backward_inputs; ++i)
        a.tensors.push_back(inputs[def2.backward_inputs[i]]);
      if (def2.num_random > 0) a.tensors.push_back(saved.back());
      for (int i = 0; i < def2.num_backward_scalars; ++i)
        a.scalars.push_back(scalars_[def2.backward_scalars[i]]);
      a.mask = mask2;
      torch::jit::Stack stack;
      a.push(stack);
      grad2->backward_op->callBoxed(stack);
      return std::move(stack.back()).toTensorVector();
    }, grads);
    return grads;
  }

  const Op* op_;
  std::vector<torch::autograd::SavedVariable> saved_;  // the douts, then the tensors it reads
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

// The outputs' tangents, in order.
std::vector<at::Tensor> forward_tangents(const Op& op, const ForwardArgs& a,
                                         const std::vector<at::Tensor>& outs) {
  const OpDef& def = *op.def;
  std::vector<at::Tensor> tangents;
  if (def.num_jvp_args == 0) {  // every gradient is zero
    for (const at::Tensor& out : outs) tangents.push_back(at::zeros_like(out));
    return tangents;
  }
  const Op* jvp = find_auxiliary(op.name + "_jvp");
  TORCH_INTERNAL_ASSERT(jvp != nullptr, "fusegen::", op.name,
                        "_jvp is neither in the op's library nor loadable");
  torch::jit::Stack stack;
  for (int k = 0; k < def.num_jvp_args; ++k) {
    const int j = def.jvp_args[k];
    if (j < def.num_inputs) {
      const at::Tensor& x = a.tensors[j];
      stack.emplace_back(has_tangent(x) ? x._fw_primal(/*level=*/0) : x);
    } else {
      const at::Tensor& t = a.tensors[j - def.num_inputs]._fw_grad(/*level=*/0);
      stack.emplace_back(t.defined() ? t : at::zeros({}, outs[0].options()));
    }
  }
  for (int k = 0; k < def.num_jvp_scalars; ++k) stack.emplace_back(a.scalars[def.jvp_scalars[k]]);
  jvp->forward_op->callBoxed(stack);  // leaves its outputs, one per output of the op
  for (size_t k = 0; k < outs.size(); ++k) {
    const at::Tensor& out = outs[k];
    at::Tensor tangent = stack[k].toTensor();
    // Fewer dimensions when the primals it reads broadcast to less than the output (a
    // tangent on a broadcast input only): _set_fw_grad lays it out as the output.
    if (tangent.sym_sizes() != out.sym_sizes()) tangent = tangent.expand_symint(out.sym_sizes());
    tangents.push_back(tangent.scalar_type() == out.scalar_type() ? tangent
                                                                   : tangent.to(out.scalar_type()));
  }
  return tangents;
}

// The forward's outputs, the last `count` values on the stack.
std::vector<at::Tensor> outputs_on(const torch::jit::Stack& stack, int count) {
  std::vector<at::Tensor> outs;
  for (size_t k = stack.size() - count; k < stack.size(); ++k) outs.push_back(stack[k].toTensor());
  return outs;
}

void set_tangents(const Op& op, const ForwardArgs& a, const std::vector<at::Tensor>& outs) {
  if (op.def->joined) {  // one result: the outputs' tangents joined as the outputs are
    const at::Tensor joined = at::cat(forward_tangents(op, a, halves_of(outs[0])), -1);
    outs[0]._set_fw_grad(joined, /*level=*/0, /*is_inplace_op=*/false);
    return;
  }
  const std::vector<at::Tensor> tangents = forward_tangents(op, a, outs);
  for (size_t k = 0; k < outs.size(); ++k)
    outs[k]._set_fw_grad(tangents[k], /*level=*/0, /*is_inplace_op=*/false);
}

// An op with no fused forward mode, called with a tangent: fusegen::__composite computes it
// (its output, tangent and graph) from the op's arguments, which it takes off the stack.
void composite_forward_mode(const Op& op, bool backward, torch::jit::Stack* stack) {
  const OpDef& def = *op.def;
  const std::string& name = backward ? op.backward_name : op.name;
  const auto hook = c10::Dispatcher::singleton().findOp({"fusegen::__composite", ""});
  TORCH_CHECK_NOT_IMPLEMENTED(hook.has_value(), "fusegen::", name,
                              " has no fused forward-mode derivative, and an input has a tangent "
                              "(forward-mode AD of a derivative: torch.func.hessian, "
                              "jacfwd(jacrev), jacfwd(jacfwd), forward_ad through a "
                              "backward). fusegen computes it as eager torch ops of the expression "
                              "once fusegen has loaded the op "
                              "(import fusegen; fusegen.load or fusegen.fuse); "
                              "a library built without fusegen has forward mode at first order "
                              "(jvp, jacfwd) and reverse mode for higher "
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
    count = backward_tensors(def) + def.num_backward_scalars + 1;
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
    TORCH_INTERNAL_ASSERT(static_cast<int>(out.size()) == num_results(def));
    for (at::Tensor& t : out) stack->emplace_back(std::move(t));
  }
}

// ---------------------------------------------------------------------------------------
// The Autograd kernel: the node's bookkeeping around a redispatch below autograd.

// The device whose kernel the forward's redispatch below autograd would reach, when it is
// this runtime's own CPU or CUDA kernel and the forward saves row values for its backward
// (OpDef::num_saved_rows): no other dispatch key on the way (a mode, functionalization, a
// subclass such as FakeTensor or DTensor) and plain tensors (plain_call_ok). Otherwise the
// forward goes through the dispatcher and saves nothing.
std::optional<Device> direct_forward(const OpDef& def, c10::DispatchKeySet keys,
                                     const ForwardArgs& a) {
  if (!def.rows || def.num_saved_rows == 0) return std::nullopt;
  const c10::DispatchKeySet below =
      (keys & c10::after_autograd_keyset) - c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
  const c10::DispatchKey key = below.highestPriorityTypeId();
  if (key != c10::DispatchKey::CPU && key != c10::DispatchKey::CUDA) return std::nullopt;
  if (!plain_call_ok(a.tensors)) return std::nullopt;
  return key == c10::DispatchKey::CUDA ? Device::kCuda : Device::kCpu;
}

// The forward with autograd, as PyTorch's generated autograd kernels do it: the node and
// its edges (when `graph`), the output from the kernels below autograd, the output's
// history, its tangent (when `tangents`), then the saved tensors (the output's after its
// history and tangent, so it is saved as an output, with its tangent for forward over
// reverse).
void record_forward(const Op& op, const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack, bool graph, bool tangents) {
  const OpDef& def = *op.def;
  const ForwardArgs a(def, *stack);
  check_defined(op.name, a.named(def));
  if (!graph) {
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }
    set_tangents(op, a, outputs_on(*stack, num_results(def)));
    return;
  }
  NodePtr node = NodeMaker<NodePtr>::make<FusedBackward>(&op);
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
  for (int i = 0; i < def.num_backward_scalars; ++i)
    fn->scalars_.push_back(a.scalars[def.backward_scalars[i]]);
  at::Tensor state;       // an op that draws random numbers: the state it drew with
  at::Tensor saved_rows;  // a row op's row values for its backward (OpDef::num_saved_rows)
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const BackwardExpected expected(def.num_kernel_grads > 0);
    const std::optional<Device> direct = direct_forward(def, keys, a);
    if (def.num_random > 0) {
      op.sampled_op->redispatchBoxed(keys & c10::after_autograd_keyset, stack);
      state = stack->back().toTensor();
      stack->pop_back();
    } else if (direct) {
      // What the redispatch would reach (this runtime's CPU or CUDA kernel), called here so
      // that the forward can hand its row values to the backward.
      std::vector<at::Tensor> out = run_forward(op, *direct, a, false, &saved_rows);
      torch::jit::drop(*stack, def.num_inputs + def.num_scalars);
      for (at::Tensor& t : out) stack->emplace_back(std::move(t));
    } else {
      handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }
  }
  std::vector<at::Tensor> outs;  // (several results)
  if (num_results(def) == 1) {  // one result: no vector on the common path
    const at::Tensor& out = stack->back().toTensor();
    torch::autograd::set_history(out, node);
    if (tangents) set_tangents(op, a, {out});
  } else {
    outs = outputs_on(*stack, num_results(def));
    torch::autograd::set_history(outs, node);
    if (tangents) set_tangents(op, a, outs);
  }
  fn->saved_.reserve(def.num_backward_inputs + 1);
  for (int i = 0; i < def.num_backward_inputs; ++i) {
    const int k = def.backward_inputs[i];
    const int output = result_output(k);  // (-1: an input)
    fn->saved_.emplace_back(output < 0       ? a.tensors[k]
                            : outs.empty()   ? stack->back().toTensor()
                                             : outs[output],
                            /*is_output=*/output >= 0);
  }
  if (state.defined()) fn->saved_.emplace_back(state, /*is_output=*/false);
  if (saved_rows.defined()) fn->saved_rows_ = torch::autograd::SavedVariable(saved_rows, false);
}

// The backward with autograd (create_graph, or a torch.func transform): its node
// (FusedDoubleBackward), the gradients from the kernels below autograd, their history.
void record_backward(const Op& op, const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const OpDef& def = *op.def;
  const BackwardArgs a(def, *stack);
  check_defined(op.backward_name, a.named(def));
  NodePtr node = NodeMaker<NodePtr>::make<FusedDoubleBackward>(&op);
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
bool has_tangents(const OpDef& def, bool backward, const torch::jit::Stack& stack) {
  const int tensors = backward ? backward_tensors(def) : def.num_inputs;
  const int args = backward ? tensors + def.num_backward_scalars + 1 : tensors + def.num_scalars;
  const size_t first = stack.size() - args;
  for (int i = 0; i < tensors; ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor() && has_tangent(v.toTensor())) return true;
  }
  return false;
}

// Whether this call must record an autograd node: grad mode on and some tensor argument
// requires grad (read off the stack, before anything is unpacked).
bool records_graph(const OpDef& def, bool backward, const torch::jit::Stack& stack) {
  if (!at::GradMode::is_enabled()) return false;
  const int tensors = backward ? backward_tensors(def) : def.num_inputs;
  const int args = backward ? tensors + def.num_backward_scalars + 1 : tensors + def.num_scalars;
  const size_t first = stack.size() - args;
  for (int i = 0; i < tensors; ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor() && v.toTensor().requires_grad()) return true;
  }
  return false;
}

void run_autograd(const Op& op, bool backward, const c10::OperatorHandle& handle,
                  c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const OpDef& def = *op.def;
  const bool graph = records_graph(def, backward, *stack);
  const bool tangents = has_tangents(def, backward, *stack);
  // An op that draws random numbers has reverse mode to second order: its backward and
  // <name>_grad2_backward draw the forward's numbers again from its saved state. Forward
  // mode would need them in an op of its own (<name>_jvp), and a third order in the
  // composite's eager ops.
  TORCH_CHECK(def.num_random == 0 || !tangents, "fusegen::", backward ? op.backward_name : op.name,
              ": forward-mode AD (torch.func.jvp, jacfwd, forward_ad) of an op that draws random "
              "numbers is not supported; differentiate it in reverse mode");
  if (!graph && !tangents) {
    // Nothing to differentiate (no_grad, or no tensor requires grad, and no tangent): no
    // autograd node, no saved state; on to the next kernel (the device's), as eager's
    // autograd kernels do.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    handle.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  } else if (tangents && (backward || def.num_jvp_args < 0)) {
    composite_forward_mode(op, backward, stack);
  } else if (backward) {
    record_backward(op, handle, keys, stack);
  } else {
    record_forward(op, handle, keys, stack, graph, tangents);
  }
}

}  // namespace fusegen::rt
#pragma GCC visibility pop
