// fusegen op `softmax_grad2`: CUDA kernels and their launchers (no torch headers)
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
// No torch header: the shared runtime (fusegen-runtime.cpp) lays out the operands with
// TensorIterator and calls these entry points with data pointers and strides; the generic
// kernels of fusegen-cuda.cuh run Forward/Backward (softmax_grad2.h) over them.
//
// Compiled alone, this file defines every entry point. A fusegen build with cores to spare
// compiles it as up to six nvcc units in parallel and links them: forward or backward
// kernels (FUSEGEN_FORWARD_ONLY, FUSEGEN_BACKWARD_ONLY), fp32/fp64 or fp16/bf16
// (FUSEGEN_WIDE_ONLY, FUSEGEN_16BIT_ONLY), and the latter as fp16 or bf16
// (FUSEGEN_16BIT_ONLY with FUSEGEN_FP16_ONLY or FUSEGEN_BF16_ONLY), each unit generating
// its part of the kernels. On the NVRTC route (a build in the process) the host compiler
// compiles the launchers alone (FUSEGEN_RTC_HOST) and the runtime compiles each kernel from
// this file on its first launch (fusegen-rtc.cpp), which sees no host code.
#include "fusegen-cuda.cuh"
#include "fusegen-runtime.h"
#include "softmax_grad2.h"

#if FUSEGEN_HOST_CODE
namespace fusegen::op_softmax_grad2 {

#ifdef FUSEGEN_RTC_FILE
const RtcSource& rtc_source() {
  static const RtcSource source{FUSEGEN_RTC_FILE, &source};
  return source;
}
#endif

#ifndef FUSEGEN_BACKWARD_ONLY
// Forward<T> in the compute type T, with the call's scalars.
inline auto forward_cuda_functor([[maybe_unused]] const double* scalars) {
  return [=](auto zero) {
    using T = decltype(zero);
    return Forward<T>{};
  };
}

void forward_cuda_fp16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);
void forward_cuda_bf16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);

#if !defined(FUSEGEN_WIDE_ONLY) && !defined(FUSEGEN_BF16_ONLY)
void forward_cuda_fp16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  run_rows_cuda<DtypeGroup::kHalf>(dtype, loop, static_cast<cudaStream_t>(stream),
      forward_cuda_functor(scalars));
}
#endif

#if !defined(FUSEGEN_WIDE_ONLY) && !defined(FUSEGEN_FP16_ONLY)
void forward_cuda_bf16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  run_rows_cuda<DtypeGroup::kBFloat16>(dtype, loop, static_cast<cudaStream_t>(stream),
      forward_cuda_functor(scalars));
}
#endif

#ifndef FUSEGEN_16BIT_ONLY
void forward_cuda(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  if (dtype == Dtype::kFloat16) return forward_cuda_fp16(dtype, loop, scalars, stream);
  if (dtype == Dtype::kBFloat16) return forward_cuda_bf16(dtype, loop, scalars, stream);
  run_rows_cuda<DtypeGroup::kWide>(dtype, loop, static_cast<cudaStream_t>(stream),
      forward_cuda_functor(scalars));
}
#endif
#endif

#ifndef FUSEGEN_FORWARD_ONLY
// Backward<T> in the compute type T, with the call's scalars.
inline auto backward_cuda_functor([[maybe_unused]] const double* scalars) {
  return [=](auto zero) {
    using T = decltype(zero);
    return Backward<T>{};
  };
}

void backward_cuda_fp16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);
void backward_cuda_bf16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);

#if !defined(FUSEGEN_WIDE_ONLY) && !defined(FUSEGEN_BF16_ONLY)
void backward_cuda_fp16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  run_rows_cuda<DtypeGroup::kHalf>(dtype, loop, static_cast<cudaStream_t>(stream),
      backward_cuda_functor(scalars));
}
#endif

#if !defined(FUSEGEN_WIDE_ONLY) && !defined(FUSEGEN_FP16_ONLY)
void backward_cuda_bf16(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  run_rows_cuda<DtypeGroup::kBFloat16>(dtype, loop, static_cast<cudaStream_t>(stream),
      backward_cuda_functor(scalars));
}
#endif

#ifndef FUSEGEN_16BIT_ONLY
void backward_cuda(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream) {
  if (dtype == Dtype::kFloat16) return backward_cuda_fp16(dtype, loop, scalars, stream);
  if (dtype == Dtype::kBFloat16) return backward_cuda_bf16(dtype, loop, scalars, stream);
  run_rows_cuda<DtypeGroup::kWide>(dtype, loop, static_cast<cudaStream_t>(stream),
      backward_cuda_functor(scalars));
}
#endif
#endif

}  // namespace fusegen::op_softmax_grad2
#endif  // FUSEGEN_HOST_CODE
