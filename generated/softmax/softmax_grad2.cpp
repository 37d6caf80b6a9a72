// fusegen op `softmax_grad2`: CPU kernels and the descriptor the shared runtime registers
//
//   out = gg_x*((dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True) +
//       torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)) +
//       torch.sum(-((dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True) +
//       torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True))), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)*where(x == torch.amax(x, -1, keepdim=True), 1, 0))
//   d/ddout = -(torch.sum((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))) + (grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x
//       - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)
//   d/dx = ((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True), 1,
//       0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1,
//       keepdim=True))*(dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)
//       + torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True)) + torch.sum((grad*gg_x +
//       -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0)/torch.sum(where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1, keepdim=True))*exp(x -
//       torch.amax(x, -1, keepdim=True)), -1, keepdim=True)*-dout/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True) + torch.sum(-(torch.sum((grad*gg_x + -torch.sum(grad*gg_x*where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True)*-dout)*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -(torch.sum((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True),
//       1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1,
//       keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)*-dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)) + -((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1,
//       keepdim=True)))*(dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)), -1,
//       keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)) + torch.sum(-(((grad*gg_x +
//       -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0)/torch.sum(where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1,
//       keepdim=True))*(dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)
//       + torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True)) + torch.sum((grad*gg_x +
//       -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True), 1, 0)/torch.sum(where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1, keepdim=True))*exp(x -
//       torch.amax(x, -1, keepdim=True)), -1, keepdim=True)*-dout/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True) + torch.sum(-(torch.sum((grad*gg_x + -torch.sum(grad*gg_x*where(x ==
//       torch.amax(x, -1, keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0), -1, keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1,
//       keepdim=True)), -1, keepdim=True)*-dout)*(exp(x - torch.amax(x, -1,
//       keepdim=True))/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)) +
//       -(torch.sum((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1, keepdim=True),
//       1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1, keepdim=True), -1,
//       keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)*-dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True))*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)) + -((grad*gg_x + -torch.sum(grad*gg_x*where(x == torch.amax(x, -1,
//       keepdim=True), 1, 0)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True), -1, keepdim=True))*exp(x - torch.amax(x, -1,
//       keepdim=True)))*(dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1,
//       keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True)), -1,
//       keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True))), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)*where(x == torch.amax(x, -1, keepdim=True), 1, 0)
//   d/dgg_x = grad*((dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True) +
//       torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True)) +
//       torch.sum(-((dout/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)), -1, keepdim=True) +
//       torch.sum(-dout*(exp(x - torch.amax(x, -1, keepdim=True))/torch.sum(exp(x - torch.amax(x,
//       -1, keepdim=True)), -1, keepdim=True)/torch.sum(exp(x - torch.amax(x, -1, keepdim=True)),
//       -1, keepdim=True)), -1, keepdim=True))*exp(x - torch.amax(x, -1, keepdim=True))), -1,
//       keepdim=True)/torch.sum(where(x == torch.amax(x, -1, keepdim=True), 1, 0), -1,
//       keepdim=True)*where(x == torch.amax(x, -1, keepdim=True), 1, 0))
//   backward reads: grad, dout, x, gg_x; forward+backward move 44 bytes per element in float32
//     (the inputs (an auxiliary op: the double backward runs it without its forward))
//
// Generated by fusegen 0.1.0; do not edit. Regenerate with:
//   fusegen "torch.exp(x - torch.amax(x, -1, keepdim=True)) / torch.exp(x - torch.amax(x, -1,
//       keepdim=True)).sum(-1, keepdim=True)" --name softmax --inputs x
//
// Registers, when its library is loaded (register_op, in the shared runtime):
//   fusegen::softmax_grad2(Tensor dout, Tensor x, Tensor gg_x) -> Tensor
//   fusegen::softmax_grad2_backward(Tensor dout, Tensor in_dout, Tensor in_x, Tensor in_gg_x,
//       bool[3] output_mask) -> Tensor[]
// with CPU and Meta kernels, CUDA kernels in a CUDA build, and an Autograd kernel:
//   reverse mode     fusegen::softmax_grad2_backward
//   higher orders    fusegen's Python side (this op is an auxiliary op)
//
// No torch header: the shared runtime checks the arguments, lays them out with
// TensorIterator (promotion, broadcasting, strides, memory format, output allocation),
// runs these kernels over it in parallel and registers the op. This file is the op's CPU
// entry points and its descriptor.
#include "fusegen-cpu.h"
#include "fusegen-rows.h"
#include "fusegen-runtime.h"
#include "softmax_grad2.h"

namespace fusegen::op_softmax_grad2 {

#ifdef FUSEGEN_WITH_CUDA
// Defined in softmax_grad2.cu, which holds the kernels and includes no torch header.
void forward_cuda(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);
void backward_cuda(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);
#endif

namespace {

// CPU kernels: the generic loop of fusegen-cpu.h over one run of TensorIterator's loop,
// with Forward/Backward (softmax_grad2.h) in the compute type (fp16/bf16 compute in float).

// softmax_grad2(Tensor dout, Tensor x, Tensor gg_x) -> Tensor
void forward_cpu(Dtype dtype, const CudaLoop& loop, const double* /*scalars*/) {
  run_rows_cpu(dtype, loop, [&](auto zero) {
    using T = decltype(zero);  // the compute type
    return Forward<T>{};
  });
}

// softmax_grad2_backward(Tensor dout, Tensor in_dout, Tensor in_x, Tensor in_gg_x, bool[3]
//     output_mask) -> Tensor[]
// data: the gradients (null when not requested), dout, the inputs the backward reads.
void backward_cpu(Dtype dtype, const CudaLoop& loop, const double* /*scalars*/) {
  run_rows_cpu(dtype, loop, [&](auto zero) {
    using T = decltype(zero);  // the compute type
    return Backward<T>{};
  });
}

// ---------------------------------------------------------------------------------------
// The descriptor the runtime registers.

const char* const kInputNames[] = { "dout", "x", "gg_x" };
const int kBackwardInputs[] = { 0, 1, 2 };
const char* const kBackwardInputNames[] = { "dout", "x", "gg_x" };
// Per output: one value per row (the shape's last dimension is 1).
const bool kPerRow[] = { false };

// Per input: {output of the backward kernel (identical gradients share one) or -1,
// number of eager steps on dout (0: dout itself; -1: not a function of dout alone), steps}.
const GradDef kGrads[] = { {0, -1, nullptr}, {1, -1, nullptr}, {2, -1, nullptr} };

OpDef describe() {
  OpDef def;
  def.name = "softmax_grad2";
  def.schema = "softmax_grad2(Tensor dout, Tensor x, Tensor gg_x) -> Tensor";
  def.num_inputs = 3;
  def.input_names = kInputNames;
  def.grads = kGrads;
  def.rows = true;  // it reduces over the last dimension: laid out by rows
  def.per_row = kPerRow;
  def.forward_rows_cpu = forward_cpu;
#ifdef FUSEGEN_WITH_CUDA
  def.forward_cuda = forward_cuda;
#endif
  def.backward_schema = "softmax_grad2_backward(Tensor dout, Tensor in_dout, Tensor in_x, Tensor "
      "in_gg_x, bool[3] output_mask) -> Tensor[]";
  def.num_kernel_grads = 3;
  def.num_backward_inputs = 3;
  def.backward_inputs = kBackwardInputs;
  def.backward_input_names = kBackwardInputNames;
  def.backward_rows_cpu = backward_cpu;
#ifdef FUSEGEN_WITH_CUDA
  def.backward_cuda = backward_cuda;
#endif
  return def;
}

const OpDef kDef = describe();
[[maybe_unused]] const bool registered = register_op(kDef);

}  // namespace
}  // namespace fusegen::op_softmax_grad2
