// fusegen-cuda.cuh: the CUDA side every generated op shares (vector loads, dtype dispatch,
// launch configuration). Hand-written, not templated. No torch headers, on purpose: a .cu
// that includes none compiles in about 2 s instead of 30.
// Include guard, not #pragma once: a bundle of ops includes several identical copies.
#ifndef FUSEGEN_CUDA_CUH_
#define FUSEGEN_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "fusegen-math.h"

namespace fusegen {

// fp16 and bf16 are stored narrow and computed in float, as PyTorch's opmath does.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<__half> { using type = float; };
template <> struct AccType<__nv_bfloat16> { using type = float; };
template <typename T> using acc_t = typename AccType<T>::type;

// Explicit conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__, so no implicit ones.
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// kVec elements moved as one 16-byte access (float4 for fp32, 8 x fp16/bf16, 2 x fp64).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};
template <typename T> constexpr int kVecWidth = 16 / sizeof(T);

template <int kVec, typename T>
__device__ __forceinline__ Vec<T, kVec> load(const T* __restrict__ base, int64_t index) {
  return reinterpret_cast<const Vec<T, kVec>*>(base)[index];
}

template <int kVec, typename T>
__device__ __forceinline__ void store(T* __restrict__ base, int64_t index, const Vec<T, kVec>& value) {
  reinterpret_cast<Vec<T, kVec>*>(base)[index] = value;
}

// The vector path needs every pointer 16-byte aligned (x[1:] of a float tensor is not).
// Null pointers (gradients nobody asked for) do not count.
inline bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

template <typename T> struct TypeTag { using type = T; };

// Calls f(TypeTag<storage type>{}) for the runtime dtype: the one switch over dtypes.
template <typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32: f(TypeTag<float>{}); break;
    case Dtype::kFloat64: f(TypeTag<double>{}); break;
    case Dtype::kFloat16: f(TypeTag<__half>{}); break;
    case Dtype::kBFloat16: f(TypeTag<__nv_bfloat16>{}); break;
  }
}

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // 8 x 256 threads fill an SM; the grid-stride loop does the rest.
constexpr int kMaxDevices = 64;

// Multiprocessor count of the current device, asked once per device.
inline int sm_count() {
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) device = 0;
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    count = count > 0 ? count : 1;
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Enough blocks for one item per thread, capped at a full wave of resident blocks.
inline unsigned grid_size(int64_t items) {
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(sm_count()) * kBlocksPerSm;
  return static_cast<unsigned>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

// Launches the kVec-wide kernel when every pointer is aligned, the scalar one otherwise.
// Both are the same template; kVec == 1 is the scalar path.
template <int kVec, typename... KernelArgs, typename... Args>
void launch(bool aligned, int64_t n, cudaStream_t stream, void (*vector_kernel)(KernelArgs...),
            void (*scalar_kernel)(KernelArgs...), Args... args) {
  if (aligned) {
    vector_kernel<<<grid_size((n + kVec - 1) / kVec), kThreads, 0, stream>>>(args...);
  } else {
    scalar_kernel<<<grid_size(n), kThreads, 0, stream>>>(args...);
  }
}

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_CUH_
