// fusegen-cuda.cuh: the CUDA side every generated op shares (vector loads, dtype dispatch,
// launch configuration). Hand-written, not templated. No torch headers, on purpose: a .cu
// that includes none compiles in about 2 s instead of 30.
// Include guard, not #pragma once: a bundle of ops includes several identical copies.
#ifndef FUSEGEN_CUDA_CUH_
#define FUSEGEN_CUDA_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "fusegen-math.h"
#include "fusegen-runtime.h"

namespace fusegen {

// fp16 and bf16 are stored narrow and computed in float, as PyTorch's opmath does. The
// storage types are fusegen-runtime.h's 16-bit Half and BFloat16, converted with the very
// instructions cuda_fp16.h and cuda_bf16.h use (cvt.f32.f16, cvt.rn.f16.f32, a 16-bit shift,
// cvt.rn.bf16.f32), so results are bit-identical to __half2float, __float2half_rn,
// __bfloat162float and __float2bfloat16_rn. Not including those two headers saves about
// 1.9 s of every op's nvcc run (measured: 4.8 s -> 2.9 s of nvcc phases for a bare kernel).
template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <typename T> using acc_t = typename AccType<T>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(Half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.x));
  return f;
}
__device__ __forceinline__ float to_acc(BFloat16 x) { return __uint_as_float(static_cast<unsigned>(x.x) << 16); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x) { return x; }
template <> __device__ __forceinline__ Half from_acc<Half>(float x) {
  Half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(x));
  return h;
}
template <> __device__ __forceinline__ BFloat16 from_acc<BFloat16>(float x) {
  BFloat16 b;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.x) : "f"(x));
#else
  // cuda_bf16.hpp's path before sm_80: round to nearest even, NaN to the canonical 0x7fff.
  const unsigned u = __float_as_uint(x);
  b.x = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fff : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return b;
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

template <typename T> struct TypeTag { using type = T; };

// Calls f(TypeTag<storage type>{}) for the runtime dtype: the one switch over dtypes.
template <typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32: f(TypeTag<float>{}); break;
    case Dtype::kFloat64: f(TypeTag<double>{}); break;
    case Dtype::kFloat16: f(TypeTag<Half>{}); break;
    case Dtype::kBFloat16: f(TypeTag<BFloat16>{}); break;
  }
}

constexpr int kThreads = 256;
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

// Blocks of `kernel` resident on one SM at once (registers decide: a backward with many
// operands keeps fewer), asked once per kernel; the kernels are compiled for the one
// architecture of the machine that builds them, so one answer holds for its devices.
template <auto kKernel>
int blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0);
    return b > 0 ? b : 1;
  }();
  return blocks;
}

// Enough blocks for `items` work items of one block each, capped at one full wave of
// resident blocks on this device: the grid-stride loop does the rest, with no second,
// partly empty wave.
template <auto kKernel>
unsigned grid_size(int64_t items) {
  const int64_t cap = int64_t(sm_count()) * blocks_per_sm<kKernel>();
  return static_cast<unsigned>(items < cap ? (items > 0 ? items : 1) : cap);
}

// The data pointers of a kernel's operands, by value: outputs first (null: not wanted),
// then inputs, as the runtime's CudaLoop orders them.
template <int kN>
struct Pointers {
  char* p[kN];
};

// Division by a fixed divisor as a multiply and a shift (Granlund and Montgomery, as
// PyTorch's IntDivider): q = (umulhi(n, magic) + n) >> shift. Two widths: 32-bit, exact for
// n < 2^31 and divisor in [1, 2^31] (one mul.hi: the strided kernel's index math is most of
// its work, and a 64-bit umulhi is several instructions), and 64-bit, exact for n < 2^63
// and divisor in [1, 2^63).
template <typename U>
struct IntDivider {
  U divisor;
  U magic;
  unsigned shift;

  IntDivider() = default;
  explicit IntDivider(U d) : divisor(d), shift(0) {
    constexpr unsigned kBits = sizeof(U) * 8;
    while (shift < kBits - 1 && (U(1) << shift) < d) ++shift;
    const unsigned __int128 one = 1;
    magic = static_cast<U>(((one << kBits) * ((one << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ U div(U n) const {
    if constexpr (sizeof(U) == 4) {
      return (__umulhi(n, magic) + n) >> shift;
    } else {
      return (__umul64hi(n, magic) + n) >> shift;
    }
  }
};

// A linear element index -> the byte offset of each operand, for any layout TensorIterator
// produces (broadcast: stride 0; transposed; sliced; channels_last): sizes with dimension
// 0 the fastest, as the runtime passes them. Index is uint32_t when the element count and
// every operand's byte span fit in 31 bits (fits_32bit), else uint64_t, so more than 2^31
// elements work.
template <int kN, typename Index>
struct OffsetCalculator {
  using Offset = std::make_signed_t<Index>;
  int ndim;
  IntDivider<Index> sizes[kMaxDims];
  Offset strides[kMaxDims][kN];

  __device__ __forceinline__ void offsets(Index linear, Offset (&out)[kN]) const {
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = 0;
    Index rest = linear;
#pragma unroll
    for (int d = 0; d < kMaxDims; ++d) {
      if (d == ndim) break;
      const Index q = sizes[d].div(rest);
      const Offset index = static_cast<Offset>(rest - q * sizes[d].divisor);
      rest = q;
#pragma unroll
      for (int k = 0; k < kN; ++k) out[k] += index * strides[d][k];
    }
  }
};

// The one elementwise kernel shape, for any F (Forward, Backward, or any later function of
// F::kInputs inputs and F::kOutputs outputs, fusegen-runtime.h): F runs in the compute type
// on values loaded as T.
//
// Bytes in flight: a grid-stride loop that loads one 16-byte vector per input, computes,
// stores and only then loads the next keeps one access per tensor in flight per thread.
// The contiguous kernel loads kUnroll vectors per input before any math (each one more
// copy of F's math in the kernel: compile time, a new op's nvcc run, grows with it, hence
// 2); the strided kernel keeps the next element's inputs in flight while it computes one
// (a software pipeline, so its offset calculator, the larger part of its code, has one
// call site).
constexpr int kUnroll = 2;
constexpr int kDepth = 2;

template <typename T, int kVec, typename F>
__device__ __forceinline__ void compute_vector(const Vec<T, kVec> (&x_v)[F::kInputs > 0 ? F::kInputs : 1],
                                               Vec<T, kVec> (&y_v)[F::kOutputs], const F& f) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    acc_t<T> x[F::kInputs > 0 ? F::kInputs : 1];
    acc_t<T> y[F::kOutputs];
#pragma unroll
    for (int j = 0; j < F::kInputs; ++j) x[j] = to_acc(x_v[j].v[e]);
    f(x, y);
#pragma unroll
    for (int k = 0; k < F::kOutputs; ++k) y_v[k].v[e] = from_acc<T>(y[k]);
  }
}

// Contiguous and 16-byte aligned: each block takes chunks of kThreads * kUnroll vectors
// (thread t the vectors t and t + kThreads: every load coalesced), grid-stride; a vector
// past the end is skipped (a predicate, so the body is compiled once, not again for a
// tail loop); then the last n % kVec elements, one per thread.
template <typename T, int kVec, typename F>
__global__ void __launch_bounds__(kThreads) contiguous_kernel(Pointers<F::kInputs + F::kOutputs> p, int64_t n, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int64_t kChunk = int64_t(kThreads) * kUnroll;
  const int64_t n_vec = n / kVec;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base < n_vec; base += int64_t(gridDim.x) * kChunk) {
    Vec<T, kVec> x_v[kUnroll][kIn > 0 ? kIn : 1];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads >= n_vec) continue;
#pragma unroll
      for (int j = 0; j < kIn; ++j) x_v[u][j] = load<kVec>(reinterpret_cast<const T*>(p.p[kOut + j]), base + u * kThreads);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads >= n_vec) continue;
      Vec<T, kVec> y_v[kOut];
      compute_vector(x_v[u], y_v, f);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (p.p[k] != nullptr) store<kVec>(reinterpret_cast<T*>(p.p[k]), base + u * kThreads, y_v[k]);
      }
    }
  }
  const int64_t i = n_vec * kVec + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {  // fewer than kVec elements: one each for the first threads
    acc_t<T> x[kIn > 0 ? kIn : 1];
    acc_t<T> y[kOut];
#pragma unroll
    for (int j = 0; j < kIn; ++j) x[j] = to_acc(reinterpret_cast<const T*>(p.p[kOut + j])[i]);
    f(x, y);
#pragma unroll
    for (int k = 0; k < kOut; ++k) {
      if (p.p[k] != nullptr) reinterpret_cast<T*>(p.p[k])[i] = from_acc<T>(y[k]);
    }
  }
}

// Anything else (broadcast, strided, misaligned): grid-stride over elements, each
// operand's address from the offset calculator, with the inputs of the next kDepth - 1
// elements in flight while one is computed (their output offsets kept for the store). The
// loop starts kDepth - 1 steps early to fill the pipeline, so the offset calculator and
// the math each have one call site.
template <typename T, typename F, typename Index>
__global__ void __launch_bounds__(kThreads) strided_kernel(Pointers<F::kInputs + F::kOutputs> p,
                                                           OffsetCalculator<F::kInputs + F::kOutputs, Index> calc,
                                                           int64_t n, F f) {
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
      for (int j = 0; j < kIn; ++j) x[kDepth - 1][j] = *reinterpret_cast<const T*>(p.p[kOut + j] + offset[kOut + j]);
#pragma unroll
      for (int k = 0; k < kOut; ++k) out_offset[kDepth - 1][k] = offset[k];
    }
    if (i >= first) {
      acc_t<T> in[kIn > 0 ? kIn : 1];
      acc_t<T> y[kOut];
#pragma unroll
      for (int j = 0; j < kIn; ++j) in[j] = to_acc(x[0][j]);
      f(in, y);
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

// Whether the strided kernel may use 32-bit index math: fewer than 2^31 elements, and every
// operand's largest byte offset below 2^31 (PyTorch's can_use_32bit_indexing, in bytes).
inline bool fits_32bit(const CudaLoop& loop, int64_t n, int num_operands, size_t element_size) {
  constexpr int64_t kLimit = int64_t(1) << 31;
  if (n >= kLimit) return false;
  if (loop.ndim == 0) return n * int64_t(element_size) < kLimit;
  for (int k = 0; k < num_operands; ++k) {
    int64_t span = 0;
    for (int d = 0; d < loop.ndim; ++d) {
      const int64_t step = loop.strides[d * loop.num_operands + k];
      span += (loop.sizes[d] - 1) * (step < 0 ? -step : step);
    }
    if (span >= kLimit) return false;
  }
  return true;
}

// The offset-calculator kernel over the loop, with Index-wide index math.
template <typename T, typename F, typename Index>
void launch_strided(const CudaLoop& loop, const Pointers<F::kInputs + F::kOutputs>& p, const F& f,
                    cudaStream_t stream) {
  constexpr int kN = F::kInputs + F::kOutputs;
  using Calc = OffsetCalculator<kN, Index>;
  using Offset = typename Calc::Offset;
  const int64_t n = loop.numel;
  Calc calc;
  if (loop.ndim == 0) {  // contiguous but misaligned: one dimension of unit steps
    calc.ndim = 1;
    calc.sizes[0] = IntDivider<Index>(static_cast<Index>(n));
    for (int k = 0; k < kN; ++k) calc.strides[0][k] = p.p[k] != nullptr ? Offset(sizeof(T)) : 0;
  } else {
    calc.ndim = loop.ndim;
    for (int d = 0; d < loop.ndim; ++d) {
      calc.sizes[d] = IntDivider<Index>(static_cast<Index>(loop.sizes[d]));
      for (int k = 0; k < kN; ++k) calc.strides[d][k] = static_cast<Offset>(loop.strides[d * loop.num_operands + k]);
    }
  }
  strided_kernel<T, F, Index><<<grid_size<strided_kernel<T, F, Index>>((n + kThreads - 1) / kThreads), kThreads, 0,
                                stream>>>(p, calc, n, f);
}

// Launches F over the runtime's CudaLoop on `stream`: the 16-byte kernel when the loop is
// contiguous and every pointer 16-byte aligned (x[1:] of a float tensor is not), the
// offset-calculator kernel otherwise.
template <typename T, typename F>
void launch_elementwise(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  constexpr int kN = F::kInputs + F::kOutputs;
  Pointers<kN> p;
  bool aligned = true;
  for (int k = 0; k < kN; ++k) {
    p.p[k] = loop.data[k];
    aligned = aligned && reinterpret_cast<std::uintptr_t>(p.p[k]) % 16 == 0;  // null counts as aligned
  }
  const int64_t n = loop.numel;
  if (loop.ndim == 0 && aligned) {
    constexpr int kVec = kVecWidth<T>;
    constexpr int64_t kChunk = int64_t(kThreads) * kUnroll;
    const int64_t blocks = (n / kVec + kChunk - 1) / kChunk;
    contiguous_kernel<T, kVec, F><<<grid_size<contiguous_kernel<T, kVec, F>>(blocks), kThreads, 0, stream>>>(p, n, f);
    return;
  }
  if (fits_32bit(loop, n, kN, sizeof(T))) {
    launch_strided<T, F, uint32_t>(loop, p, f, stream);
  } else {
    launch_strided<T, F, uint64_t>(loop, p, f, stream);
  }
}

// The entry point of an op's kernel (forward_cuda, backward_cuda): F built by make(zero of
// the compute type), run in the storage type of `dtype`.
template <typename Make>
void run_cuda(Dtype dtype, const CudaLoop& loop, cudaStream_t stream, Make&& make) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_elementwise<T>(loop, make(acc_t<T>{}), stream);
  });
}

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_CUH_
