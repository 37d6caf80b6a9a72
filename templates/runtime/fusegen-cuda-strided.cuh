// fusegen-cuda-strided.cuh: the kernel that takes any layout, element by element.
#ifndef FUSEGEN_CUDA_STRIDED_CUH_
#define FUSEGEN_CUDA_STRIDED_CUH_

#include "fusegen-cuda-common.cuh"

namespace fusegen {

// Anything else (a fast dimension that does not split into vectors, offsets past 2^31,
// a misaligned contiguous loop): grid-stride over elements, each operand's address from
// the offset calculator, with the inputs of the next kDepth - 1
// elements in flight while one is computed (their output offsets kept for the store). The
// loop starts kDepth - 1 steps early to fill the pipeline, so the offset calculator and
// the math each have one call site.
#if FUSEGEN_DEVICE_CODE
template <typename T, typename F, typename Index>
__global__ void __launch_bounds__(kThreads)
    strided_kernel(Pointers<F::kInputs + F::kOutputs> p,
                   OffsetCalculator<F::kInputs + F::kOutputs, Index> calc, int64_t n, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  using Offset = typename OffsetCalculator<kIn + kOut, Index>::Offset;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  T x[kDepth][kIn > 0 ? kIn : 1];  // storage type: converted at the math, as loaded
  Offset out_offset[kDepth][kOut];
  for (int64_t i = first - (kDepth - 1) * stride; i < n; i += stride) {
    const int64_t next = i + (kDepth - 1) * stride;
    if (next < n) {
      Offset offset[kIn + kOut];
      calc.offsets(static_cast<Index>(next), offset);
#pragma unroll
      for (int j = 0; j < kIn; ++j)
        x[kDepth - 1][j] = *reinterpret_cast<const T*>(p.p[kOut + j] + offset[kOut + j]);
#pragma unroll
      for (int k = 0; k < kOut; ++k) out_offset[kDepth - 1][k] = offset[k];
    }
    if (i >= first) {
      acc_t<T> in[kIn > 0 ? kIn : 1];
      acc_t<T> y[kOut];
#pragma unroll
      for (int j = 0; j < kIn; ++j) in[j] = to_acc(x[0][j]);
      call(f, in, y, static_cast<uint64_t>(i));
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (p.p[k] != nullptr) *reinterpret_cast<T*>(p.p[k] + out_offset[0][k]) = from_acc<T>(y[k]);
      }
    }
#pragma unroll
    for (int d = 0; d < kDepth - 1; ++d) {
#pragma unroll
      for (int j = 0; j < kIn; ++j) x[d][j] = x[d + 1][j];
#pragma unroll
      for (int k = 0; k < kOut; ++k) out_offset[d][k] = out_offset[d + 1][k];
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, typename F, typename Index>
const KernelRef& strided_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::strided_kernel", TypeName<T>::get(), functor_name<F>(def),
                         TypeName<Index>::get());
    }
  };
  return kernel_ref<Name>(f);
}
#endif

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_STRIDED_CUH_
