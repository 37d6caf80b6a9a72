// fusegen-op.h: the host-side steps every generated op shares: check the arguments,
// promote and broadcast them, allocate the output, and reduce gradients to input shapes.
// Hand-written, not templated; copied next to the generated sources so they build alone.
// Include guard, not #pragma once: a bundle of ops includes several identical copies.
#ifndef FUSEGEN_OP_H_
#define FUSEGEN_OP_H_

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/TypeProperties.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <initializer_list>
#include <string>
#include <vector>

#include "fusegen-math.h"

namespace fusegen {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One tensor argument with the name it has in the schema, for error messages.
struct Arg {
  const char* name;
  const at::Tensor& tensor;
};

// Elements per CPU task: large enough that at::parallel_for's overhead is noise.
constexpr int64_t kCpuGrain = 32768;

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Undefined tensors (None from Python) fail here with the op's and the argument's name,
// before anything asks them for a size, dtype or device.
inline void check_defined(const char* op, std::initializer_list<Arg> args) {
  for (const Arg& arg : args) {
    TORCH_CHECK(arg.tensor.defined(), "fusegen::", op, ": argument '", arg.name,
                "' is None (an undefined tensor); expected a tensor");
  }
}

// Checks every argument (defined, floating, one device) and returns the dtype the op
// computes and returns in: torch's type promotion over the arguments, as eager does.
inline at::ScalarType check_args(const char* op, std::initializer_list<Arg> args) {
  const Arg& first = *args.begin();
  at::native::ResultTypeState state = {};
  check_defined(op, args);
  for (const Arg& arg : args) {
    const at::Tensor& t = arg.tensor;
    TORCH_CHECK(is_supported_dtype(t.scalar_type()), "fusegen::", op, ": argument '", arg.name,
                "' must be a float32, float64, float16 or bfloat16 tensor, got ", t.scalar_type());
    TORCH_CHECK(t.device() == first.tensor.device(), "fusegen::", op, ": argument '", arg.name,
                "' is on ", t.device(), ", expected ", first.tensor.device(), " (the device of '",
                first.name, "')");
    state = at::native::update_result_type_state(t, state);
  }
  return at::native::result_type(state);
}

// The broadcast shape of all arguments, with an error that names the one that does not fit.
inline c10::SymDimVector broadcast_shape(const char* op, std::initializer_list<Arg> args) {
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

// Shape and options of the op's outputs: the broadcast shape, the promoted dtype.
struct Layout {
  c10::SymDimVector sizes;
  at::TensorOptions options;

  at::Tensor empty() const { return at::empty_symint(sizes, options); }
  at::ScalarType dtype() const { return options.dtype().toScalarType(); }
  // Only for real tensors (CPU/CUDA impls); Meta impls never ask.
  int64_t numel() const {
    int64_t n = 1;
    for (const c10::SymInt& s : sizes) n *= s.expect_int();
    return n;
  }
};

// Checking and shape inference in one step. On its own this is the Meta implementation;
// the CPU and CUDA ones start with it.
inline Layout output_layout(const char* op, std::initializer_list<Arg> args) {
  const at::ScalarType dtype = check_args(op, args);
  return Layout{broadcast_shape(op, args), args.begin()->tensor.options().dtype(dtype)};
}

// Inputs as the kernels want them: promoted, broadcast to the output shape and contiguous,
// so a kernel is one flat loop. This copies broadcast or strided inputs and is free for
// contiguous ones of the output's shape and dtype.
inline std::vector<at::Tensor> flat_inputs(const Layout& layout, std::initializer_list<Arg> args) {
  std::vector<at::Tensor> out;
  out.reserve(args.size());
  for (const Arg& arg : args) {
    out.push_back(arg.tensor.to(layout.dtype()).expand_symint(layout.sizes).contiguous());
  }
  return out;
}

// The gradients that were asked for (defined), in order: what <name>_backward returns.
inline std::vector<at::Tensor> requested(std::initializer_list<at::Tensor> grads) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& g : grads) {
    if (g.defined()) out.push_back(g);
  }
  return out;
}

inline Dtype kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return Dtype::kFloat64;
    case at::kHalf: return Dtype::kFloat16;
    case at::kBFloat16: return Dtype::kBFloat16;
    default: return Dtype::kFloat32;
  }
}

// Remembers an input's shape and dtype, so its gradient can be reduced to them.
inline void save_input_meta(AutogradContext* ctx, const std::string& name, const at::Tensor& t) {
  ctx->saved_data[name + ".sizes"] = t.sym_sizes();
  ctx->saved_data[name + ".dtype"] = t.scalar_type();
}

// A gradient computed at the broadcast shape, summed back to the input's shape and cast
// to its dtype. A gradient that already fits is returned as is (no kernel).
inline at::Tensor reduce_to_input(AutogradContext* ctx, const std::string& name, const at::Tensor& grad) {
  const std::vector<c10::SymInt> sizes = ctx->saved_data[name + ".sizes"].toSymIntVector();
  const at::ScalarType dtype = ctx->saved_data[name + ".dtype"].toScalarType();
  return at::sum_to(grad, c10::SymIntArrayRef(sizes)).to(dtype);
}

}  // namespace fusegen

#endif  // FUSEGEN_OP_H_
