// fusegen-cuda-contiguous.cuh: the kernel of contiguous, 16-byte aligned loops.
#ifndef FUSEGEN_CUDA_CONTIGUOUS_CUH_
#define FUSEGEN_CUDA_CONTIGUOUS_CUH_

#include "fusegen-cuda-common.cuh"

namespace fusegen {

// Contiguous and 16-byte aligned: each block takes chunks of kThreads * kUnroll vectors
// (thread t the vectors t and t + kThreads: every load coalesced), grid-stride; a vector
// past the end is skipped (a predicate, so the body is compiled once, not again for a
// tail loop); then the last n % kVec elements, one per thread.
#if FUSEGEN_DEVICE_CODE
template <typename T, int kVec, typename F>
__global__ void __launch_bounds__(kThreads)
    contiguous_kernel(Pointers<F::kInputs + F::kOutputs> p, int64_t n, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int64_t kChunk = int64_t(kThreads) * kUnroll;
  const int64_t n_vec = n / kVec;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base < n_vec;
       base += int64_t(gridDim.x) * kChunk) {
    Vec<T, kVec> x_v[kUnroll][kIn > 0 ? kIn : 1];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads >= n_vec) continue;
#pragma unroll
      for (int j = 0; j < kIn; ++j)
        x_v[u][j] = load<kVec>(reinterpret_cast<const T*>(p.p[kOut + j]), base + u * kThreads);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads >= n_vec) continue;
      Vec<T, kVec> y_v[kOut];
      compute_vector(x_v[u], y_v, f, NoVisit{}, static_cast<uint64_t>(base + u * kThreads) * kVec);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (p.p[k] != nullptr)
          store<kVec>(reinterpret_cast<T*>(p.p[k]), base + u * kThreads, y_v[k]);
      }
    }
  }
  const int64_t i = n_vec * kVec + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {  // fewer than kVec elements: one each for the first threads
    acc_t<T> x[kIn > 0 ? kIn : 1];
    acc_t<T> y[kOut];
#pragma unroll
    for (int j = 0; j < kIn; ++j) x[j] = to_acc(reinterpret_cast<const T*>(p.p[kOut + j])[i]);
    call(f, x, y, static_cast<uint64_t>(i));
#pragma unroll
    for (int k = 0; k < kOut; ++k) {
      if (p.p[k] != nullptr) reinterpret_cast<T*>(p.p[k])[i] = from_acc<T>(y[k]);
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, int kVec, typename F>
const KernelRef& contiguous_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::contiguous_kernel", TypeName<T>::get(), kVec,
                         functor_name<F>(def));
    }
  };
  return kernel_ref<Name>(f);
}
#endif

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_CONTIGUOUS_CUH_
