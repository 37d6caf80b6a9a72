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

// The dtypes in groups, each compiled in nvcc units of its own when a build has cores to
// spare (op_kernels.cu.j2): fp32 with fp64 (whose kernels are few: contiguous and
// strided), fp16, and bf16. The kernels of four dtypes are most of a new op's nvcc time.
enum class DtypeGroup { kWide, kHalf, kBFloat16 };

// Calls f(TypeTag<storage type>{}) for the runtime dtype, one of kGroup's: the one choice
// among dtypes.
template <DtypeGroup kGroup, typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  if constexpr (kGroup == DtypeGroup::kHalf) {
    f(TypeTag<Half>{});
  } else if constexpr (kGroup == DtypeGroup::kBFloat16) {
    f(TypeTag<BFloat16>{});
  } else if (dtype == Dtype::kFloat64) {
    f(TypeTag<double>{});
  } else {
    f(TypeTag<float>{});
  }
}

constexpr int kThreads = 256;

// One block per kThreads * kUnroll vectors (or elements), as many blocks as that takes:
// no cap at one wave of resident blocks. Measured on the H200 at n = 2^27
// (tests/gpu/kernel_probe.py): capping the contiguous kernel's grid at one wave and
// striding over the rest costs 5 % (a*b+c fp32) to 16 % (silu bf16) against the uncapped
// grid, which reaches the copy rate of the same bytes; the block scheduler refills an SM
// the moment a block ends, while a grid-stride loop waits for its slowest thread. The
// grid-stride loops stay, for more blocks than a grid may have.
inline unsigned grid_size(int64_t items) {
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  return static_cast<unsigned>(items < 1 ? 1 : items < kMaxBlocks ? items : kMaxBlocks);
}

// CUDA's limits for gridDim.y and .z (x goes to 2^31 - 1), and the dynamic shared memory a
// launch may ask for without opting in.
constexpr int64_t kMaxGridY = 65535;
constexpr size_t kMaxSharedBytes = 48 * 1024;

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

// The strided kernel is the exception: its software pipeline (below) needs several
// elements per thread, and on the H200 an uncapped grid made it 10-40 % slower (a sliced
// input, fp32 and bf16), so its grid is capped at one full wave of resident blocks.
template <auto kKernel>
unsigned wave_grid_size(int64_t items) {
  const int64_t cap = int64_t(sm_count()) * blocks_per_sm<kKernel>();
  return grid_size(items < cap ? items : cap);
}

// The data pointers of a kernel's operands, by value: outputs first (null: not wanted),
// then inputs, as the runtime's CudaLoop orders them.
template <int kN>
struct Pointers {
  char* p[kN];
};

template <int kN>
Pointers<kN> pointers_of(const CudaLoop& loop) {
  Pointers<kN> p;
  for (int k = 0; k < kN; ++k) p.p[k] = loop.data[k];
  return p;
}

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

  // Unrolled over kMaxDims (every size and stride an operand of the instructions, no
  // loads): the strided kernel's per-element path. Rolled (`rolled`: sizes and strides
  // read from the kernel's parameters at run time): a third of the code, for the kernels
  // that call it once per vector or per block, where a new op's nvcc time matters more
  // (the vector and tiled kernels cost +1 s per nvcc unit unrolled, +0.1 s rolled).
  template <bool kRolled = false>
  __device__ __forceinline__ void offsets(Index linear, Offset (&out)[kN]) const {
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = 0;
    Index rest = linear;
    if constexpr (kRolled) {
#pragma unroll 1
      for (int d = 0; d < ndim; ++d) step(d, rest, out);
    } else {
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        step(d, rest, out);
      }
    }
  }

  __device__ __forceinline__ void step(int d, Index& rest, Offset (&out)[kN]) const {
    const Index q = sizes[d].div(rest);
    const Offset index = static_cast<Offset>(rest - q * sizes[d].divisor);
    rest = q;
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] += index * strides[d][k];
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

// F over the kVec elements of a vector of each input; `visit(e, x, y)` sees element e's
// inputs and outputs in the compute type, before the outputs are rounded to T (the
// accumulating kernel sums them unrounded).
struct NoVisit {
  template <typename A>
  __device__ __forceinline__ void operator()(int, const A*, const A*) const {}
};

// Element e of a vector in the compute type. A bf16 pair is read from its 32-bit word (a
// shift or a mask: bf16 is a float's upper half), so that the vector stays in words: read
// element by element, nvcc split each word into two 16-bit registers (a byte permute
// each) and merged the loaded and repeated forms of an operand per element (48 byte
// permutes per bf16 vector of three inputs in the vector kernel, 24 in the contiguous one;
// now none).
template <typename T, int kVec>
__device__ __forceinline__ acc_t<T> element(const Vec<T, kVec>& v, int e) {
  if constexpr (std::is_same_v<T, BFloat16> && kVec % 2 == 0) {
    uint32_t word;
    memcpy(&word, &v.v[e & ~1], sizeof word);
    return __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
  } else {
    return to_acc(v.v[e]);
  }
}

template <typename T, int kVec, typename F, typename Visit = NoVisit>
__device__ __forceinline__ void compute_vector(const Vec<T, kVec> (&x_v)[F::kInputs > 0 ? F::kInputs : 1],
                                               Vec<T, kVec> (&y_v)[F::kOutputs], const F& f, Visit visit = {}) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    acc_t<T> x[F::kInputs > 0 ? F::kInputs : 1];
    acc_t<T> y[F::kOutputs];
#pragma unroll
    for (int j = 0; j < F::kInputs; ++j) x[j] = element(x_v[j], e);
    f(x, y);
    visit(e, x, y);
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

// Anything else (a fast dimension that does not split into vectors, offsets past 2^31,
// a misaligned contiguous loop): grid-stride over elements, each operand's address from
// the offset calculator, with the inputs of the next kDepth - 1
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

// Any loop whose dimension 0 splits into vectors of kVec elements (a per-channel scale of
// NCHW or channels_last activations, a bias row, a sliced input beside contiguous ones):
// the kVec elements of a vector share every operand's offset computation, and each
// operand is, along dimension 0, one kVec-wide access (contiguous and aligned), one
// element repeated (a step of 0: bit k of `repeated`), or kVec elements gathered at its
// step (`gathered`, steps in `step`; only in the kernel of kGathers). A thread has one
// vector in flight (kVectorUnroll), or kUnroll with kGathers. Measured on the H200
// (tests/gpu/h200_run.sh vector, 2026-12-01): the lean 16-byte bf16 kernel takes 32
// registers (8 blocks of 256 threads per SM) with one vector and 51-56 with two, and the
// NCHW per-channel bf16 forward of n = 2^26 ran 70 us either way (torch.compile: 61-82 us
// from run to run); the gathering kernel lost 8 % on a sliced bf16 input with one.
// `calc` counts elements: vector i is elements i * kVec to i * kVec + kVec - 1 of the
// loop, which lie in one row of dimension 0 unless the loop is `flat` (flat_modes: dense
// and repeated operands only, dimension 0 not split into vectors), where a vector's
// repeated operands may change at a row's end.
template <typename T> constexpr int kVectorWidth = kVecWidth<T> < 4 ? kVecWidth<T> : 4;

template <int kN>
struct Modes {
  static_assert(kN <= kMaxVectorOperands, "one bit per operand");
  uint32_t repeated = 0;
  uint32_t gathered = 0;
  int32_t step[kN] = {};  // bytes between a gathered operand's elements along dimension 0
};

// One element as a vector of kVec. A 2-byte element goes out as 32-bit words of two
// copies, the layout a vector load leaves in registers, so that an operand's repeated and
// loaded forms merge word by word (a move per word) where the math reads words (element,
// above); alone, this left the 48 byte permutes per bf16 vector of three inputs as they were.
template <int kVec, typename T>
__device__ __forceinline__ Vec<T, kVec> repeat(T value) {
  Vec<T, kVec> out;
  if constexpr (sizeof(T) == 2 && kVec % 2 == 0) {
    uint16_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t words[kVec / 2];
#pragma unroll
    for (int w = 0; w < kVec / 2; ++w) words[w] = bits * 0x10001u;
    memcpy(&out, words, sizeof out);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = value;
  }
  return out;
}

// Operand k of a vector loop, at byte address `at`: read as one kVec-wide access, one
// element repeated, or kVec elements gathered at its step (Modes); written (an output) as
// one access or scattered at its step.
// kGathers false: the caller has no gathered operand (Modes::gathered is 0), and the code
// for one is left out.
template <bool kGathers, typename T, int kVec, int kN>
__device__ __forceinline__ void load_operand(const Modes<kN>& modes, int k, const char* at, Vec<T, kVec>& out) {
  if (modes.repeated >> k & 1) {
    out = repeat<kVec>(*reinterpret_cast<const T*>(at));
  } else if (kGathers && modes.gathered >> k & 1) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = *reinterpret_cast<const T*>(at + e * modes.step[k]);
  } else {
    out = *reinterpret_cast<const Vec<T, kVec>*>(at);
  }
}

template <bool kGathers, typename T, int kVec, int kN>
__device__ __forceinline__ void store_operand(const Modes<kN>& modes, int k, char* at, const Vec<T, kVec>& value) {
  if (kGathers && modes.gathered >> k & 1) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) *reinterpret_cast<T*>(at + e * modes.step[k]) = value.v[e];
  } else {
    *reinterpret_cast<Vec<T, kVec>*>(at) = value;
  }
}

// FUSEGEN_VECTOR_UNROLL (vectors in flight per thread in the kernel without gathers) and
// FUSEGEN_VECTOR_BLOCKS (blocks per SM that the register count must allow; 1: nvcc's
// choice) only to compare launch shapes on a GPU (tests/gpu/h200_run.sh vector).
#ifndef FUSEGEN_VECTOR_UNROLL
#define FUSEGEN_VECTOR_UNROLL 1
#endif
#ifndef FUSEGEN_VECTOR_BLOCKS
#define FUSEGEN_VECTOR_BLOCKS 1
#endif
constexpr int kVectorUnroll = FUSEGEN_VECTOR_UNROLL;

// A vector of a flat loop that crosses the end of a row of dimension 0 after `left` of
// its elements: element by element (one in 128 vectors at most, kFlatRow), each repeated
// operand's element taken from the next row past them; dense operands step by one element.
template <typename T, int kVec, typename F>
__device__ __forceinline__ void compute_crossing(const Pointers<F::kInputs + F::kOutputs>& p,
                                              const OffsetCalculator<F::kInputs + F::kOutputs, uint32_t>& calc,
                                              const Modes<F::kInputs + F::kOutputs>& modes, uint32_t i, int left,
                                              const int32_t (&offset)[F::kInputs + F::kOutputs], const F& f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  int32_t next[kIn + kOut];
  calc.template offsets<true>(i + left, next);
#pragma unroll 1
  for (int e = 0; e < kVec; ++e) {
    acc_t<T> x[kIn > 0 ? kIn : 1];
    acc_t<T> y[kOut];
#pragma unroll
    for (int j = 0; j < kIn; ++j) {
      const int k = kOut + j;
      const int32_t at = !(modes.repeated >> k & 1) ? offset[k] + e * int32_t(sizeof(T)) : e < left ? offset[k] : next[k];
      x[j] = to_acc(*reinterpret_cast<const T*>(p.p[k] + at));
    }
    f(x, y);
#pragma unroll
    for (int k = 0; k < kOut; ++k) {
      if (p.p[k] != nullptr) *reinterpret_cast<T*>(p.p[k] + offset[k] + e * int32_t(sizeof(T))) = from_acc<T>(y[k]);
    }
  }
}

template <typename T, int kVec, bool kGathers, typename F>
__global__ void __launch_bounds__(kThreads, FUSEGEN_VECTOR_BLOCKS) vector_kernel(Pointers<F::kInputs + F::kOutputs> p,
                                                          OffsetCalculator<F::kInputs + F::kOutputs, uint32_t> calc,
                                                          uint32_t n_vec, Modes<F::kInputs + F::kOutputs> modes,
                                                          bool flat, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kU = kGathers ? kUnroll : kVectorUnroll;
  using Offset = int32_t;
  constexpr int64_t kChunk = int64_t(kThreads) * kU;
  const IntDivider<uint32_t>& row = calc.sizes[0];
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base < n_vec; base += int64_t(gridDim.x) * kChunk) {
    Vec<T, kVec> x_v[kU][kIn > 0 ? kIn : 1];
    Offset offset[kU][kIn + kOut];
    bool whole[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      whole[u] = base + u * kThreads < n_vec;
      if (!whole[u]) continue;
      const uint32_t i = static_cast<uint32_t>(base + u * kThreads) * kVec;
      calc.template offsets<true>(i, offset[u]);
      if (flat) {
        // The elements of this vector left in its row (rows are at least kVec long, so
        // a vector crosses one row end at most).
        const uint32_t left = row.divisor - (i - row.div(i) * row.divisor);
        if (left < kVec) {
          compute_crossing<T, kVec>(p, calc, modes, i, static_cast<int>(left), offset[u], f);
          whole[u] = false;
          continue;
        }
      }
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        load_operand<kGathers>(modes, kOut + j, p.p[kOut + j] + offset[u][kOut + j], x_v[u][j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (!whole[u]) continue;
      Vec<T, kVec> y_v[kOut];
      compute_vector(x_v[u], y_v, f);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (p.p[k] != nullptr) store_operand<kGathers>(modes, k, p.p[k] + offset[u][k], y_v[k]);
      }
    }
  }
}

// A backward that sums gradients of broadcast inputs (a bias, a per-channel scale) in the
// kernel itself, as torch.compile's fused reductions do, instead of writing them at the
// broadcast shape for ATen to sum (a write and a read of the whole tensor each): after
// F's outputs and inputs come kOut + 1 accumulators (Accumulating), float sums at
// the input's shape, which TensorIterator lays out as inputs (step 0 along the summed
// dimensions); accumulator k < kOut sums F's output k (then a null output), accumulator
// kOut sums input 0 (dout: a bias's gradient, which needs no kernel of its own).
template <typename F>
struct Accumulating {
  static constexpr int kAccumulators = F::kOutputs + 1;
  static constexpr int kOperands = F::kInputs + F::kOutputs + kAccumulators;
  static constexpr int kFirst = F::kInputs + F::kOutputs;  // accumulator a is operand kFirst + a
};

// The sums of one accumulator in one thread's slot: the byte offset they belong at (-1:
// none yet) and kVec partial sums (element e at offset + e * step; a step of 0 puts all
// of them in sum[0]). A thread adds to them while the offset stays, and flushes them when
// it changes: lanes of a warp that flush together and share an offset with their
// neighbours (every lane, for a per-channel sum of an NCHW tensor) sum their values by a
// segmented scan over shuffles, and the first lane of each run of equal offsets adds the
// run's sum to global memory with one atomicAdd.
template <int kVec>
struct Partial {
  int32_t offset = -1;
  float sum[kVec] = {};
};

// Collective over the warp (every lane calls it with the same trip counts); `flush` says
// whether this lane's sums go out now.
template <int kVec>
__device__ __forceinline__ void flush_partial(bool flush, Partial<kVec>& part, char* base, int32_t step) {
  constexpr unsigned kAll = 0xffffffffu;
  if (__ballot_sync(kAll, flush) == 0) return;
  const int lane = threadIdx.x % 32;
  const int32_t key = flush ? part.offset : -1 - lane;  // lanes not flushing: runs of their own
  const int32_t next = __shfl_down_sync(kAll, key, 1);
  const int32_t prev = __shfl_up_sync(kAll, key, 1);
  const unsigned ends = __ballot_sync(kAll, lane == 31 || next != key);
  const int end = lane + __ffs(ends >> lane) - 1;  // the last lane of this lane's run
  const bool head = flush && (lane == 0 || prev != key);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (step == 0 && e > 0) break;
    float v = part.sum[e];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float other = __shfl_down_sync(kAll, v, d);
      if (lane + d <= end) v += other;
    }
    if (head) atomicAdd(reinterpret_cast<float*>(base + part.offset + e * step), v);
  }
  if (flush) {
    part.offset = -1;
#pragma unroll
    for (int e = 0; e < kVec; ++e) part.sum[e] = 0.f;
  }
}

// The loop as rows of `row` vectors (the loop's dimension 0 when an accumulator varies
// along it: a lane then keeps one column, so a channels_last per-channel sum keeps its
// offset for the whole kernel; else chunks of kThreads * kAccumulatingUnroll vectors: a lane's
// offset changes only where the summed tensor's does, every H*W elements of NCHW). A
// block step covers `width` vectors of `rows_per_step` rows (whole rows when they are
// short); blockIdx.x picks the columns, blockIdx.y a range of `rows_per_block` rows.
// Accumulator a in `by_column` (bit a) has one offset per column (a channels_last
// per-channel sum): a block adds its threads' sums in shared memory first, one float per
// element of its columns, and then adds those to global memory, so that each element takes
// one atomicAdd per block. With every lane flushing its own 4 elements, the ~1000 atomics
// per element from the whole grid (a wave of blocks) serialized on the same addresses:
// a channels_last backward took 2.5x the NCHW one on the H200.
struct RowLoop {
  uint32_t n_vec, row, width, rows_per_step, rows, rows_per_block;
  uint32_t by_column;
};

// One vector per thread and step, and registers for 4 blocks of 256 threads per SM (62-64,
// no spills). On the H200 (tests/gpu/h200_run.sh vector, n = 2^26, the backward kernel
// alone) against two vectors and 3 blocks (80 registers, 72-104 bytes spilled): 265 -> 227
// us fp32 and 306 -> 234 us bf16 (NCHW per-channel), 376 -> 305 and 423 -> 325 us
// (channels_last); 5 blocks (48 registers, spills) lost in fp32 (285, 388 us). Two
// vectors and 4 blocks spill 192-356 bytes. FUSEGEN_ACCUMULATING_BLOCKS=1 gives nvcc's
// choice of registers (tests/gpu/h200_run.sh accumulating).
#ifndef FUSEGEN_ACCUMULATING_BLOCKS
#define FUSEGEN_ACCUMULATING_BLOCKS 4
#endif
// FUSEGEN_ACCUMULATING_UNROLL: vectors per thread and step (tests/gpu/h200_run.sh vector).
#ifndef FUSEGEN_ACCUMULATING_UNROLL
#define FUSEGEN_ACCUMULATING_UNROLL 1
#endif
constexpr int kAccumulatingUnroll = FUSEGEN_ACCUMULATING_UNROLL;
template <typename T, int kVec, typename F>
__global__ void __launch_bounds__(kThreads, FUSEGEN_ACCUMULATING_BLOCKS) accumulating_kernel(Pointers<Accumulating<F>::kOperands> p,
                                                                OffsetCalculator<Accumulating<F>::kOperands, uint32_t> calc,
                                                                RowLoop rows, Modes<Accumulating<F>::kOperands> modes,
                                                                F f) {
  using A = Accumulating<F>;
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kAcc = A::kAccumulators;
  constexpr int kWarpSlots = 32 * kAccumulatingUnroll;
  // Slot u of a thread: a warp's 32 * kAccumulatingUnroll slots are consecutive (lanes
  // along the row, every access coalesced), so a warp's lanes share a per-channel offset
  // far more often.
  const uint32_t warp_first = threadIdx.x / 32 * kWarpSlots + threadIdx.x % 32;
  uint32_t row_of[kAccumulatingUnroll], col_of[kAccumulatingUnroll];
#pragma unroll
  for (int u = 0; u < kAccumulatingUnroll; ++u) {
    const uint32_t slot = warp_first + u * 32;
    row_of[u] = slot / rows.width;
    col_of[u] = blockIdx.x * rows.width + slot % rows.width;
  }
  Partial<kVec> part_of[kAcc][kAccumulatingUnroll];
  extern __shared__ float column_sums[];  // per by_column accumulator, width * kVec floats
  const uint32_t span = rows.width * kVec;
  const auto sums_of = [&](int a) { return column_sums + __popc(rows.by_column & ((1u << a) - 1)) * span; };
  if (rows.by_column != 0) {
    const uint32_t floats = __popc(rows.by_column) * span;
    for (uint32_t i = threadIdx.x; i < floats; i += kThreads) column_sums[i] = 0.f;
    __syncthreads();  // the same branch in every thread of the block
  }
  const uint32_t first_row = blockIdx.y * rows.rows_per_block;
  const uint32_t end_row = min(first_row + rows.rows_per_block, rows.rows);
  for (uint32_t r = first_row; r < end_row; r += rows.rows_per_step) {  // the same trip count in every lane
    Vec<T, kVec> x_v[kAccumulatingUnroll][kIn];
    int32_t offset[kAccumulatingUnroll][A::kOperands];
    bool valid[kAccumulatingUnroll];
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      const uint32_t row = r + row_of[u];
      const uint32_t v = row * rows.row + col_of[u];
      valid[u] = row_of[u] < rows.rows_per_step && row < end_row && col_of[u] < rows.row && v < rows.n_vec;
      if (!valid[u]) continue;
      calc.template offsets<true>(v, offset[u]);
#pragma unroll
      for (int j = 0; j < kIn; ++j) load_operand<true>(modes, kOut + j, p.p[kOut + j] + offset[u][kOut + j], x_v[u][j]);
    }
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      float add[kAcc][kVec];  // what each accumulator sums: F's outputs unrounded, and dout
      if (valid[u]) {
        Vec<T, kVec> y_v[kOut];
        compute_vector(x_v[u], y_v, f, [&](int e, const acc_t<T>* x, const acc_t<T>* y) {
#pragma unroll
          for (int k = 0; k < kOut; ++k) add[k][e] = y[k];
          add[kOut][e] = x[0];
        });
#pragma unroll
        for (int k = 0; k < kOut; ++k) {
          if (p.p[k] != nullptr) store_operand<true>(modes, k, p.p[k] + offset[u][k], y_v[k]);
        }
      }
#pragma unroll
      for (int a = 0; a < kAcc; ++a) {
        const int k = A::kFirst + a;
        if (p.p[k] == nullptr) continue;  // the same in every lane
        Partial<kVec>& part = part_of[a][u];
        const int32_t at = valid[u] ? offset[u][k] : -1;
        flush_partial(valid[u] && part.offset >= 0 && part.offset != at, part, p.p[k], modes.step[k]);
        if (!valid[u]) continue;
        part.offset = at;
        if (modes.step[k] == 0) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) part.sum[0] += add[a][e];
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) part.sum[e] += add[a][e];
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    const int k = A::kFirst + a;
    if (p.p[k] == nullptr || rows.by_column >> a & 1) continue;
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) flush_partial(part_of[a][u].offset >= 0, part_of[a][u], p.p[k], modes.step[k]);
  }
  if (rows.by_column == 0) return;
  // by_column: the block's sums in shared memory (zeroed before), then to global memory.
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    if (!(rows.by_column >> a & 1)) continue;
    float* sums = sums_of(a);
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      const Partial<kVec>& part = part_of[a][u];
      if (part.offset < 0) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) atomicAdd(sums + (col_of[u] - blockIdx.x * rows.width) * kVec + e, part.sum[e]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    if (!(rows.by_column >> a & 1)) continue;
    const int k = A::kFirst + a;
    const float* sums = sums_of(a);
    for (uint32_t i = threadIdx.x; i < span; i += kThreads) {
      const uint32_t element = blockIdx.x * span + i;  // along dimension 0
      if (element < rows.row * kVec && sums[i] != 0.f) {
        atomicAdd(reinterpret_cast<float*>(p.p[k] + int64_t(element) * modes.step[k]), sums[i]);
      }
    }
  }
}

// An input contiguous along the loop's dimension 1 while the outputs are contiguous along
// dimension 0 (a transposed input: TensorIterator orders the loop by the first input's
// strides, so the others are read across): element by element, a warp would touch 32 rows
// for one load. Tiles instead: such inputs come in through shared memory, a warp reading
// along their rows, and leave it transposed; the other operands are read and written
// directly, a warp along dimension 0. One block per tile: blockIdx.x and .y its place
// along dimensions 0 and 1 (no division: 64-bit ones cost more than the tile's own work),
// blockIdx.z the index over the outer dimensions (2 and up), turned into offsets once per
// block.
//
// A lane moves P elements per access, P * sizeof(T) bytes: P = 1, or for 2-byte types 4
// (8 bytes) or 2 (4 bytes), the widest that launch_tiled finds every access of whole and
// aligned. On the H200 (bf16 forward of a*b+c, b and c tiled, n = 2^26): one element an
// access (64 bytes a warp) took 0.373 ms against 0.271 ms for fp32's twice as many bytes;
// pairs 0.202 ms, issue-bound (ncu: 70 % of issue slots busy at 2.6 TB/s, 1.54x fp32's
// instructions per byte), most of its instructions 64-bit address and bounds arithmetic,
// recomputed per access. So now an access's address is one 64-bit add to the one before
// it (each operand's accesses are an affine function of the access's number, with byte
// steps the host works out for the operand's layout: TileLoop::step_*), and a tile inside
// the loop (all but those at its ends) loads with no bounds checks: a branch per block to
// the checked copy of the loads. SASS instructions per thread on that path, per element
// (sm_90, same forward; the old kernel's counts match ncu's to the instruction): fp32
// 89 -> 45 (5.6 -> 2.8 per byte), pairs 68.6 -> 31.1 (8.6 -> 3.9), fours 19.5 (2.4 per
// byte; 80 registers for a*b+c, 3 blocks of 256 threads per SM: capped at 64 for 4, it spills).
// A tile is 32 * P elements along dimension 0 (a warp of accesses) by kTileWidth along 1,
// 8 accesses per thread and operand: fp32 32 x 64, pairs 64 x 64, fours 128 x 64 (8.1, 8.1
// and 16.3 KiB of shared memory per tiled input: three tiled inputs of fours take pairs).
// FUSEGEN_TILE_COLS (32 or 64) only to compare the two for P = 1 on a GPU
// (tests/gpu/h200_run.sh); a tile of 2-byte types in pairs or fours is 64 wide, one
// 128-byte line of a tiled input's row (the bank analysis below is for that width).
#ifndef FUSEGEN_TILE_COLS
#define FUSEGEN_TILE_COLS 64
#endif
constexpr int kTile = 32;                     // along dimension 0: a warp, in accesses
constexpr int kTileCols = FUSEGEN_TILE_COLS;  // along dimension 1, for P = 1
constexpr int kTileRows = kThreads / kTile;   // the warps of a block
template <typename T> constexpr int kPack = sizeof(T) == 2 ? 4 : 1;  // the widest P of T (fp64 never comes here)
template <int P> constexpr int kTileHeight = kTile * P;  // along dimension 0, in elements
template <int P> constexpr int kTileWidth = P == 1 ? kTileCols : 64;
template <int P> constexpr int kTilePer = kTileWidth<P> / kTileRows;  // accesses per thread and operand
// A tiled input's loads: kTileLanes lanes along one of its rows (the tile's width in
// accesses, a warp at most), kTileGroup rows a warp access, kTileSpan warp accesses a row.
template <int P> constexpr int kTileLanes = kTileWidth<P> / P < kTile ? kTileWidth<P> / P : kTile;
template <int P> constexpr int kTileGroup = kTile / kTileLanes<P>;
template <int P> constexpr int kTileSpan = kTileWidth<P> / (P * kTileLanes<P>);
// Shared memory per tiled input: 32 rows of kTileStride units, a unit one access (P
// elements of T): the tile's width and one spare 4-byte word or one spare unit, whichever
// is larger, so that a row is an odd number of words, or of units (no bank conflicts,
// below). kTileBanks units fill the 32 banks once.
template <typename T, int P> constexpr int kTileUnit = P * int(sizeof(T));
template <typename T, int P>
constexpr int kTileStride = kTileWidth<P> + (kTileUnit<T, P> < 4 ? 4 / kTileUnit<T, P> : 1);
template <typename T, int P> constexpr int kTileBanks = 128 / kTileUnit<T, P>;

// An access of P elements in registers and in shared memory. A pair or a four is 32-bit
// words (element 0 in the low half of word 0, as in memory) until the math, so that nvcc
// keeps a loaded access in whole registers: as a Vec of two 16-bit values, it split each
// pair right at its load, a use that waits for the data (and 95 registers instead of 46
// for a*b+c).
template <int kWords>
struct alignas(4 * kWords) Words {
  uint32_t w[kWords];
};
template <typename T, int P>
using TileAccess = std::conditional_t<P == 1, Vec<T, 1>, Words<P * int(sizeof(T)) / 4>>;

template <typename T, int P>
__device__ __forceinline__ Vec<T, P> unpack(const TileAccess<T, P>& a) {
  static_assert(sizeof(TileAccess<T, P>) == sizeof(Vec<T, P>), "an access is P elements");
  Vec<T, P> v;
  memcpy(&v, &a, sizeof v);
  return v;
}

// One access at `a`, or (`repeated`, P > 1) the one element there in the low half of
// word 0, copied to the others after every load is issued: a select of two loads, no branch.
template <typename T, int P>
__device__ __forceinline__ TileAccess<T, P> load_access(const char* a, bool repeated) {
  if constexpr (P == 1) {
    return *reinterpret_cast<const TileAccess<T, P>*>(a);
  } else {
    TileAccess<T, P> x;
    if (repeated) {
      x.w[0] = *reinterpret_cast<const uint16_t*>(a);
    } else {
      x = *reinterpret_cast<const TileAccess<T, P>*>(a);
    }
    return x;
  }
}

constexpr int8_t kDirect = -1;
constexpr int8_t kRepeated = -2;

template <int kN>
struct TileLoop {
  int64_t size0, size1;
  int64_t stride0[kN], stride1[kN];
  // The byte steps of operand k's accesses e = P * (S * m + n) + q along m, n and q
  // (tiled_place, direct_place): launch_tiles works them out for its P.
  int64_t step_m[kN], step_n[kN], step_q[kN];
  // The shared-memory tile of input k, or how it is read directly: kDirect, or kRepeated
  // (a step of 0 along dimension 0: with P > 1, one element loaded per access).
  int8_t slot[kN];
  OffsetCalculator<kN, uint64_t> outer;
};

// Where access e (< kTilePer) of thread (lane, row) = (threadIdx.x % 32, threadIdx.x / 32)
// lies: its first element, along dimensions 0 and 1 from the tile's first. With
// R = kTileRows (8), L = kTileLanes, G = kTileGroup, S = kTileSpan and e = P * (S * m + n) + q
// (q < P, n < S):
// - direct (a direct input, an output, and the read of a shared tile): the P elements
//   (P * lane + c, row + R * e), c < P: a warp along dimension 0 (a repeated input: its
//   element (P * lane, ...) once, copied to the others after the loads);
// - tiled (a tiled input's loads): the P elements (P * (lane / L + G * (row + R * m)) + q,
//   P * (lane % L + L * n) + c), c < P: L lanes along a row of the input, G rows a warp
//   access. Accesses P * b to P * b + P - 1 (block b = S * m + n) are P x P elements, P
//   consecutive rows of P.
// Both are affine in lane / L, lane % L, row, m, n and q, so that an operand's accesses
// are its first one and byte steps along m, n and q (TileLoop::step_*).
struct TilePlace {
  int d0, d1;
};

template <int P>
__host__ __device__ constexpr TilePlace direct_place(int lane, int row, int e) {
  return {P * lane, row + kTileRows * e};
}

template <int P>
__host__ __device__ constexpr TilePlace tiled_place(int lane, int row, int e) {
  constexpr int L = kTileLanes<P>;
  constexpr int S = kTileSpan<P>;
  const int b = e / P;
  return {P * (lane / L + kTileGroup<P> * (row + kTileRows * (b / S))) + e % P, P * (lane % L + L * (b % S))};
}

// Shared memory, per tiled input: unit [w][x] (w < 32, x < kTileWidth) holds the P
// elements (P * w + q, x), q < P, along dimensions 0 and 1 from the tile's first, as the
// direct access of lane w does: a block, transposed in registers, is units [w][x + c]
// (c < P, (P * w, x) = tiled_place(block's first access)), and the thread's direct access
// r afterwards is unit [lane][row + R * r]. Unit [w][x] is stored at column x ^ h(x),
// h(x) = x / kTileBanks % P (a swizzle of the columns within a block's P: P = 1 none).
// No bank conflicts (a warp's 4-byte units are one wavefront of the 32 banks, 8-byte
// ones two, half a warp each, the 16 8-byte bank pairs once):
// - a column read (unit [lane][x], x one for the warp, so is h(x)): a row is an odd number
//   of words or units (kTileStride), so 32 (or 16) lanes on consecutive rows hit distinct
//   banks;
// - a row write (a block's column c: unit [w][P * v + c], v = lane % L, w one for each L
//   lanes): P = 1 consecutive units (2-byte ones two lanes to a word); pairs (L = 32) put
//   lane v's column c at 2 * v + (c ^ v / 16): the lower half-warp on even banks and the
//   upper one on odd ones (or the other way); fours (L = 16, two rows a warp, one per
//   half-warp) at 4 * v + (c ^ v / 4 % 4): the 16 bank pairs of 4 * (v % 4) + 0..3 once.
template <typename T, int P, typename F>
__global__ void __launch_bounds__(kThreads) tiled_kernel(Pointers<F::kInputs + F::kOutputs> p,
                                                         TileLoop<F::kInputs + F::kOutputs> loop, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kPer = kTilePer<P>;
  constexpr int S = kTileSpan<P>;
  constexpr int kBanks = kTileBanks<T, P>;
  using A = TileAccess<T, P>;  // values stay in the storage type until the math
  extern __shared__ __align__(16) unsigned char tile_bytes[];
  auto tile = reinterpret_cast<A(*)[kTile][kTileStride<T, P>]>(tile_bytes);
  const int64_t first0 = int64_t(blockIdx.x) * kTileHeight<P>;
  const int64_t first1 = int64_t(blockIdx.y) * kTileWidth<P>;
  // The extent of the tile inside the loop: all of it but at the loop's ends.
  const int rows0 = static_cast<int>(min(loop.size0 - first0, int64_t(kTileHeight<P>)));
  const int rows1 = static_cast<int>(min(loop.size1 - first1, int64_t(kTileWidth<P>)));
  const auto inside = [&](TilePlace at) { return at.d0 < rows0 && at.d1 < rows1; };
  int64_t base[kIn + kOut];
  loop.outer.template offsets<true>(blockIdx.z, base);
  const int lane = threadIdx.x % kTile;
  const int row = threadIdx.x / kTile;
  // Operand k's access e of this thread, in one of the two places.
  const auto place = [&](bool tiled, int e) {
    return tiled ? tiled_place<P>(lane, row, e) : direct_place<P>(lane, row, e);
  };
  const auto first = [&](int k, bool tiled) {
    const TilePlace at = place(tiled, 0);
    return p.p[k] + base[k] + (first0 + at.d0) * loop.stride0[k] + (first1 + at.d1) * loop.stride1[k];
  };
  const auto step = [&](int k, int e) {
    return e / (P * S) * loop.step_m[k] + e / P % S * loop.step_n[k] + e % P * loop.step_q[k];
  };
  // Every load first, into registers, with no branch between them (but the bounds of a
  // tile at the edges), so that all of them are in flight at once (with a branch per
  // operand, nvcc waited for each load before the next: 28 registers, half the copy rate);
  // the places above. Then the tiled inputs go through shared memory, which transposes them.
  A x[kPer][kIn > 0 ? kIn : 1];
  const auto load = [&](auto edge) {
#pragma unroll
    for (int j = 0; j < kIn; ++j) {
      const int k = kOut + j;
      const bool tiled = loop.slot[k] >= 0;
      const char* at = first(k, tiled);
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        if (decltype(edge)::value && !inside(place(tiled, e))) {
          x[e][j] = A{};  // never stored: a value for the transpose
        } else {
          x[e][j] = load_access<T, P>(at + step(k, e), loop.slot[k] == kRepeated);
        }
      }
    }
  };
  if (rows0 == kTileHeight<P> && rows1 == kTileWidth<P>) {
    load(std::false_type{});
  } else {
    load(std::true_type{});
  }
#pragma unroll
  for (int j = 0; j < kIn; ++j) {
    const int s = loop.slot[kOut + j];
    if (s < 0) continue;
#pragma unroll
    for (int b = 0; b < kPer / P; ++b) {
      A column[P];  // column[c]: the block's column c, P elements along dimension 0
      if constexpr (P == 1) {
        column[0] = x[b][j];
      } else {  // word i of a column: its rows 2 * i and 2 * i + 1
#pragma unroll
        for (int c = 0; c < P; ++c) {
#pragma unroll
          for (int i = 0; i < P / 2; ++i) {
            column[c].w[i] = __byte_perm(x[P * b + 2 * i][j].w[c / 2], x[P * b + 2 * i + 1][j].w[c / 2],
                                         c % 2 ? 0x7632 : 0x5410);
          }
        }
      }
      const TilePlace at = tiled_place<P>(lane, row, P * b);
      const int h = at.d1 / kBanks % P;  // the same for the block's P columns (kBanks is a multiple of P)
#pragma unroll
      for (int c = 0; c < P; ++c) tile[s][at.d0 / P][at.d1 + (c ^ h)] = column[c];
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kIn; ++j) {
    const int s = loop.slot[kOut + j];
    if (s >= 0) {
      // Column x = row + R * r at x ^ h(x) = R * r + (row ^ h(R * r)): row < R, and R
      // divides kBanks.
#pragma unroll
      for (int r = 0; r < kPer; ++r) x[r][j] = tile[s][lane][kTileRows * r + (row ^ (kTileRows * r / kBanks % P))];
    } else if constexpr (P > 1) {
      if (s == kRepeated) {
#pragma unroll
        for (int r = 0; r < kPer; ++r) {
#pragma unroll
          for (int i = 0; i < P / 2; ++i) x[r][j].w[i] = __byte_perm(x[r][j].w[0], 0, 0x1010);  // the low half twice
        }
      }
    }
  }
  char* out[kOut];
  bool wanted[kOut];
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    out[k] = first(k, false);
    wanted[k] = p.p[k] != nullptr;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    if (inside(direct_place<P>(lane, row, r))) {
      Vec<T, P> in[kIn > 0 ? kIn : 1];
      Vec<T, P> y[kOut];
#pragma unroll
      for (int j = 0; j < kIn; ++j) in[j] = unpack<T, P>(x[r][j]);
      compute_vector(in, y, f);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (wanted[k]) *reinterpret_cast<Vec<T, P>*>(out[k]) = y[k];
      }
    }
#pragma unroll
    for (int k = 0; k < kOut; ++k) out[k] += loop.step_q[k];  // a direct place: access e at e * step_q
  }
}

// The kernels after the contiguous one, each with the test that picks it: the first that
// takes the loop runs it (launch_elementwise). Strides are operand k's byte steps,
// loop.strides[d * num_operands + k]; a null operand (an output not wanted) takes any path.

inline int64_t step(const CudaLoop& loop, int d, int k) { return loop.strides[d * loop.num_operands + k]; }

// Whether 32-bit index math may be used: fewer than 2^31 elements, and every operand's
// largest byte offset below 2^31 (PyTorch's can_use_32bit_indexing, in bytes).
inline bool fits_32bit(const CudaLoop& loop, int64_t n, int num_operands, size_t element_size) {
  constexpr int64_t kLimit = int64_t(1) << 31;
  if (n >= kLimit) return false;
  if (loop.ndim == 0) return n * int64_t(element_size) < kLimit;
  for (int k = 0; k < num_operands; ++k) {
    int64_t span = 0;
    for (int d = 0; d < loop.ndim; ++d) {
      const int64_t s = step(loop, d, k);
      span += (loop.sizes[d] - 1) * (s < 0 ? -s : s);
    }
    if (span >= kLimit) return false;
  }
  return true;
}

// An offset calculator over the loop's dimensions [from, ndim), dimension `from` counted
// in units of `group` elements (its steps `group` times the loop's).
template <typename Index, int kN>
OffsetCalculator<kN, Index> offset_calculator(const CudaLoop& loop, const Pointers<kN>& p, int from, int64_t group) {
  using Offset = typename OffsetCalculator<kN, Index>::Offset;
  OffsetCalculator<kN, Index> calc;
  calc.ndim = loop.ndim - from;
  for (int d = from; d < loop.ndim; ++d) {
    const int64_t unit = d == from ? group : 1;
    calc.sizes[d - from] = IntDivider<Index>(static_cast<Index>(loop.sizes[d] / unit));
    for (int k = 0; k < kN; ++k) calc.strides[d - from][k] = p.p[k] ? static_cast<Offset>(step(loop, d, k) * unit) : 0;
  }
  return calc;
}

// The vector kernel's modes of a loop whose dimension 0 splits into whole vectors: an
// operand is a vector access when it steps by one element along dimension 0 and its
// pointer and its other steps keep each vector aligned to its width; repeated when it
// steps by none (an input); gathered otherwise.
template <typename T, int kVec, int kN>
Modes<kN> vector_modes(const CudaLoop& loop, const Pointers<kN>& p, int num_outputs) {
  constexpr int64_t kBytes = int64_t(sizeof(T)) * kVec;
  Modes<kN> modes;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr) continue;
    const int64_t s = step(loop, 0, k);
    bool vector = s == int64_t(sizeof(T)) && reinterpret_cast<std::uintptr_t>(p.p[k]) % kBytes == 0;
    for (int d = 1; d < loop.ndim && vector; ++d) vector = step(loop, d, k) % kBytes == 0;
    if (s == 0 && k >= num_outputs) {
      modes.repeated |= 1u << k;
    } else if (!vector) {
      modes.gathered |= 1u << k;
      modes.step[k] = static_cast<int32_t>(s);
    }
  }
  return modes;
}

// The flat loop of the vector kernel, where dimension 0 does not split into vectors of
// kVec but the loop does: each operand dense (one run of elements in the loop's order: a
// step of one element along dimension 0, and along each further dimension the size of the
// one below, from a pointer aligned to a vector) or an input repeated along dimension 0
// (step 0: a per-channel scale of NCHW activations whose H * W is odd or 4 mod 8, as
// 362 * 362 is). Dimension 0 is at least kFlatRow long, so that few vectors cross the end of
// a row. Returns whether the loop is such, with its modes.
constexpr int64_t kFlatRow = 1024;

template <typename T, int kVec, int kN>
bool flat_modes(const CudaLoop& loop, const Pointers<kN>& p, int num_outputs, Modes<kN>& modes) {
  constexpr int64_t kElement = sizeof(T);
  if (loop.ndim < 2 || loop.sizes[0] < kFlatRow || loop.numel % kVec != 0) return false;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr) continue;
    if (step(loop, 0, k) == 0 && k >= num_outputs) {
      modes.repeated |= 1u << k;
      continue;
    }
    bool dense = step(loop, 0, k) == kElement && reinterpret_cast<std::uintptr_t>(p.p[k]) % (kElement * kVec) == 0;
    for (int d = 1; d < loop.ndim && dense; ++d) dense = step(loop, d, k) == step(loop, d - 1, k) * loop.sizes[d - 1];
    if (!dense) return false;
  }
  return true;
}

template <typename T, int kVec, bool kGathers, typename F>
bool launch_vector_of(const CudaLoop& loop, const Pointers<F::kInputs + F::kOutputs>& p, const F& f,
                      cudaStream_t stream) {
  Modes<F::kInputs + F::kOutputs> modes;
  const bool flat = loop.sizes[0] % kVec != 0;
  if (flat && !flat_modes<T, kVec>(loop, p, F::kOutputs, modes)) return false;
  if (!flat) modes = vector_modes<T, kVec>(loop, p, F::kOutputs);
  if (!kGathers && modes.gathered != 0) return false;
  const int64_t n_vec = loop.numel / kVec;
  const auto calc = offset_calculator<uint32_t>(loop, p, 0, 1);
  constexpr int64_t kChunk = int64_t(kThreads) * (kGathers ? kUnroll : kVectorUnroll);
  vector_kernel<T, kVec, kGathers, F><<<grid_size((n_vec + kChunk - 1) / kChunk), kThreads, 0, stream>>>(
      p, calc, static_cast<uint32_t>(n_vec), modes, flat, f);
  return true;
}

// Two vector kernels, the first that takes the loop: 16-byte vectors whose operands are
// each one access or one element repeated (a per-channel scale or bias, channels_last, a
// bias row: the common loops), then vectors that may also gather (a sliced input beside
// contiguous ones), 16 bytes wide and then 4 elements. The gathering code costs registers
// (the bf16 forward of a*b+c: 32 without it, 63 with it at 16 bytes), and a kernel of 78
// registers (3 blocks of 256 threads per SM) moved 2.1 TB/s on an NCHW per-channel bf16
// loop on the H200, where torch.compile's (30 registers) moved 4.0.
// Only with 32-bit index math (`index32`: fits_32bit, which the caller needs as well);
// more than kMaxVectorOperands operands (a backward of about 16 inputs): the strided kernel.
template <typename T, typename F>
bool launch_vector(const CudaLoop& loop, const Pointers<F::kInputs + F::kOutputs>& p, const F& f, bool index32,
                   cudaStream_t stream) {
  if constexpr (F::kInputs + F::kOutputs > kMaxVectorOperands) {
    return false;
  } else {
    if (loop.ndim == 0 || !index32) return false;
    if (launch_vector_of<T, kVecWidth<T>, false>(loop, p, f, stream)) return true;
    if constexpr (kVecWidth<T> > kVectorWidth<T>) {
      if (launch_vector_of<T, kVecWidth<T>, true>(loop, p, f, stream)) return true;
    }
    return launch_vector_of<T, kVectorWidth<T>, true>(loop, p, f, stream);
  }
}

// The accumulating kernel over a loop of Accumulating<F>::kOperands operands, which the
// runtime sends only for a loop of whole vectors of kAccumulatingWidth along dimension 0
// and 32-bit offsets, not fp64 (fusegen-runtime.cpp, accumulates_in_kernel). The inputs and
// outputs take the vector kernel's modes; an accumulator's step along dimension 0 is its
// Modes::step (0: one offset for the whole vector). Rows (RowLoop) along dimension 0 when
// some accumulator steps along it, else chunks; about one wave of blocks, so that a
// thread sums many vectors before it flushes.
template <typename T, typename F>
void launch_accumulating(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  using A = Accumulating<F>;
  constexpr int kN = A::kOperands;
  constexpr int kVec = kAccumulatingWidth;
  static_assert(kVec <= kVectorWidth<T>, "whole vectors of the vector kernel's");
  constexpr int64_t kSlots = int64_t(kThreads) * kAccumulatingUnroll;
  const auto p = pointers_of<kN>(loop);
  Modes<kN> modes = vector_modes<T, kVec>(loop, p, F::kOutputs);
  bool along_rows = false;
  uint32_t by_column = 0;
  for (int a = 0; a < A::kAccumulators; ++a) {
    const int k = A::kFirst + a;
    modes.repeated &= ~(1u << k);
    modes.gathered &= ~(1u << k);
    modes.step[k] = p.p[k] != nullptr ? static_cast<int32_t>(step(loop, 0, k)) : 0;
    along_rows = along_rows || modes.step[k] != 0;
    bool column = modes.step[k] != 0;
    for (int d = 1; d < loop.ndim && column; ++d) column = step(loop, d, k) == 0;
    if (column) by_column |= 1u << a;
  }
  const int64_t n_vec = loop.numel / kVec;
  const int64_t row = along_rows ? loop.sizes[0] / kVec : kSlots;
  const int64_t width = row < kSlots ? row : kSlots;
  const int64_t rows_per_step = kSlots / width;
  const int64_t num_rows = (n_vec + row - 1) / row;
  const int64_t segments = (row + width - 1) / width;
  const int64_t steps = (num_rows + rows_per_step - 1) / rows_per_step;
  const int64_t wave = int64_t(sm_count()) * blocks_per_sm<accumulating_kernel<T, kVec, F>>();
  int64_t groups = (wave + segments - 1) / segments;
  groups = groups < steps ? groups : steps;
  groups = groups < kMaxGridY ? groups : kMaxGridY;
  const int64_t rows_per_block = (steps + groups - 1) / groups * rows_per_step;
  groups = (num_rows + rows_per_block - 1) / rows_per_block;
  const RowLoop rl{static_cast<uint32_t>(n_vec), static_cast<uint32_t>(row), static_cast<uint32_t>(width),
                   static_cast<uint32_t>(rows_per_step), static_cast<uint32_t>(num_rows),
                   static_cast<uint32_t>(rows_per_block), by_column};
  // 8 KiB per accumulator at most (512 vectors of 4 floats): within the 48 KiB a launch may
  // ask for without opting in, for up to six of them.
  const auto shared_bytes = [&] { return size_t(__builtin_popcount(by_column)) * width * kVec * sizeof(float); };
  while (shared_bytes() > kMaxSharedBytes) by_column &= by_column - 1;  // the rest flush lane by lane
  const size_t shared = shared_bytes();
  const auto calc = offset_calculator<uint32_t>(loop, p, 0, kVec);
  const dim3 grid(static_cast<unsigned>(segments), static_cast<unsigned>(groups));
  accumulating_kernel<T, kVec, F><<<grid, kThreads, shared, stream>>>(p, calc, rl, modes, f);
}

// tiled_kernel with P elements per access over `tl` (`tiles` tiled inputs, `outer` the
// count over dimensions 2 and up), unless its grid or shared memory does not fit.
template <typename T, int P, typename F>
bool launch_tiles(const Pointers<F::kInputs + F::kOutputs>& p, TileLoop<F::kInputs + F::kOutputs> tl, int tiles,
                  int64_t outer, const F& f, cudaStream_t stream) {
  constexpr size_t kTileBytes = sizeof(TileAccess<T, P>) * kTile * kTileStride<T, P>;
  const int64_t tiles0 = (tl.size0 + kTileHeight<P> - 1) / kTileHeight<P>;
  const int64_t tiles1 = (tl.size1 + kTileWidth<P> - 1) / kTileWidth<P>;
  if (tiles * kTileBytes > kMaxSharedBytes || tiles0 >= (int64_t(1) << 31) || tiles1 > kMaxGridY || outer > kMaxGridY) {
    return false;
  }
  // Each operand's steps: the byte offsets of its accesses 1, P and P * S from access 0 in
  // tiled_kernel's places, (m, n, q) = (0, 0, 1), (0, 1, 0) and (1, 0, 0) (a step along an
  // index that is always 0, q for P = 1 and n for S = 1, adds nothing). A direct place is
  // linear in e: its accesses are step_q apart.
  for (int k = 0; k < F::kInputs + F::kOutputs; ++k) {
    const auto offset = [&](int e) {
      const TilePlace at = tl.slot[k] >= 0 ? tiled_place<P>(0, 0, e) : direct_place<P>(0, 0, e);
      return at.d0 * tl.stride0[k] + at.d1 * tl.stride1[k];
    };
    tl.step_q[k] = offset(1);
    tl.step_n[k] = offset(P);
    tl.step_m[k] = offset(P * kTileSpan<P>);
  }
  const dim3 grid(static_cast<unsigned>(tiles0), static_cast<unsigned>(tiles1), static_cast<unsigned>(outer));
  tiled_kernel<T, P, F><<<grid, kThreads, tiles * kTileBytes, stream>>>(p, tl, f);
  return true;
}

// Whether every access of P elements is whole and aligned to its P * sizeof(T) bytes: both
// sizes multiples of P (an access starts at a multiple of P), and every operand's pointer
// and steps multiples of P * sizeof(T) bytes, but for the step between an access's
// elements (along dimension 1 for a tiled input, along 0 for the others, which must step
// by one element there) and for a repeated input's (one element an access, any
// alignment). P = 1 takes any layout.
template <typename T, int kN>
bool accesses_fit(const CudaLoop& loop, const Pointers<kN>& p, const TileLoop<kN>& tl, int P) {
  constexpr int64_t kElement = sizeof(T);
  const int64_t bytes = P * kElement;
  if (P == 1) return true;
  if (loop.sizes[0] % P != 0 || loop.sizes[1] % P != 0) return false;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr || tl.slot[k] == kRepeated) continue;
    const bool tiled = tl.slot[k] >= 0;
    bool fits = reinterpret_cast<std::uintptr_t>(p.p[k]) % bytes == 0 &&
                (tiled ? tl.stride0[k] : tl.stride1[k]) % bytes == 0 && (tiled || tl.stride0[k] == kElement);
    for (int d = 2; d < loop.ndim; ++d) fits = fits && step(loop, d, k) % bytes == 0;
    if (!fits) return false;
  }
  return true;
}

// tiled_kernel with the widest P, from P down to 1, whose accesses fit the loop and whose
// grid and shared memory fit the device (three tiled inputs of fours would take 49 KiB).
template <typename T, int P, typename F>
bool launch_widest(const CudaLoop& loop, const Pointers<F::kInputs + F::kOutputs>& p,
                   const TileLoop<F::kInputs + F::kOutputs>& tl, int tiles, int64_t outer, const F& f,
                   cudaStream_t stream) {
  if (accesses_fit<T>(loop, p, tl, P) && launch_tiles<T, P>(p, tl, tiles, outer, f, stream)) return true;
  if constexpr (P > 1) {
    return launch_widest<T, P / 2>(loop, p, tl, tiles, outer, f, stream);
  } else {
    return false;
  }
}

// The tiled kernel takes the loop when some input steps by one element along dimension 1
// and not along dimension 0 (nor by 0: a repeated row is read directly), every output
// steps by one element along dimension 0, and the tiles fit in 48 KiB of shared memory.
// 2-byte types move fours, else pairs, where every access is whole and aligned
// (accesses_fit: rows whose length is a multiple of 4, or of 2, operands aligned to 8, or
// 4, bytes); else one element per access (rows of odd length, a sliced or misaligned
// operand: the kernel of P = 1, as for fp32).
template <typename T, typename F>
bool launch_tiled(const CudaLoop& loop, const Pointers<F::kInputs + F::kOutputs>& p, const F& f,
                  cudaStream_t stream) {
  constexpr int kN = F::kInputs + F::kOutputs;
  constexpr int64_t kElement = sizeof(T);
  if (loop.ndim < 2 || loop.sizes[0] < kTile / 2 || loop.sizes[1] < kTile / 2) return false;
  TileLoop<kN> tl;
  int tiles = 0;
  for (int k = 0; k < kN; ++k) {
    tl.slot[k] = kDirect;
    tl.stride0[k] = p.p[k] ? step(loop, 0, k) : 0;
    tl.stride1[k] = p.p[k] ? step(loop, 1, k) : 0;
    if (p.p[k] == nullptr) continue;
    if (k < F::kOutputs && tl.stride0[k] != kElement) return false;
    if (k >= F::kOutputs && tl.stride1[k] == kElement && tl.stride0[k] != kElement && tl.stride0[k] != 0) {
      tl.slot[k] = static_cast<int8_t>(tiles++);
    } else if (k >= F::kOutputs && tl.stride0[k] == 0) {
      tl.slot[k] = kRepeated;
    }
  }
  if (tiles == 0) return false;
  tl.size0 = loop.sizes[0];
  tl.size1 = loop.sizes[1];
  tl.outer = offset_calculator<uint64_t>(loop, p, 2, 1);
  const int64_t outer = loop.numel / (loop.sizes[0] * loop.sizes[1]);
  return launch_widest<T, kPack<T>>(loop, p, tl, tiles, outer, f, stream);
}

// The offset-calculator kernel over the loop, with Index-wide index math: any layout.
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
    calc = offset_calculator<Index>(loop, p, 0, 1);
  }
  strided_kernel<T, F, Index><<<wave_grid_size<strided_kernel<T, F, Index>>((n + kThreads - 1) / kThreads), kThreads,
                                0, stream>>>(p, calc, n, f);
}

// The kernels an entry point instantiates: every layout's (kEvery: an op's own), or the
// contiguous and offset-calculator kernels alone (kPlain: the auxiliary ops `<name>_grad2`
// and `<name>_jvp`, of double backward and forward-mode AD, off the training step's hot
// path; nor the accumulating kernel: their OpDef's backward_accumulates is false). The
// tiled and vector kernels in four dtypes were most of a new op's nvcc time, and the
// auxiliary ops' units its longest: on the CPU machine, nvcc of
// `generated/fma/fma_grad2.cu`'s fp16/bf16 backward unit took 4.2 s, fma.cu's own 2.5 s.
enum class Kernels { kEvery, kPlain };

// Launches F over the runtime's CudaLoop on `stream`: the 16-byte kernel when the loop is
// contiguous and every pointer 16-byte aligned (x[1:] of a float tensor is not), else the
// tiled kernel for a transposed input, the vector kernel when dimension 0 splits into
// vectors, and the offset-calculator kernel for anything else.
template <typename T, Kernels kKernels, typename F>
void launch_elementwise(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  constexpr int kN = F::kInputs + F::kOutputs;
  const auto p = pointers_of<kN>(loop);
  bool aligned = true;
  for (int k = 0; k < kN; ++k) aligned = aligned && reinterpret_cast<std::uintptr_t>(p.p[k]) % 16 == 0;  // null counts as aligned
  const int64_t n = loop.numel;
  if (loop.ndim == 0 && aligned) {
    constexpr int kVec = kVecWidth<T>;
    constexpr int64_t kChunk = int64_t(kThreads) * kUnroll;
    contiguous_kernel<T, kVec, F><<<grid_size((n / kVec + kChunk - 1) / kChunk), kThreads, 0, stream>>>(p, n, f);
    return;
  }
  // fp64 (gradcheck's dtype, rarely a fast path's) skips the tiled and vector kernels:
  // 0.3 s less nvcc per unit, in every new op's build.
  const bool index32 = fits_32bit(loop, n, kN, sizeof(T));
  if constexpr (sizeof(T) != 8 && kKernels == Kernels::kEvery) {
    if (launch_tiled<T>(loop, p, f, stream) || launch_vector<T>(loop, p, f, index32, stream)) return;
  }
  if (index32) {
    launch_strided<T, F, uint32_t>(loop, p, f, stream);
  } else {
    launch_strided<T, F, uint64_t>(loop, p, f, stream);
  }
}

// The launcher of an op's kernel for kGroup's dtypes (op_kernels.cu.j2): F built by
// make(zero of the compute type), run in the storage type of `dtype`.
// kAccumulates (a backward): a loop of Accumulating<F>::kOperands operands goes to the
// accumulating kernel (fp64, or more than kMaxVectorOperands of them, never comes with one).
// kKernels: which of the other kernels are instantiated (Kernels).
template <DtypeGroup kGroup, bool kAccumulates = false, Kernels kKernels = Kernels::kEvery, typename Make>
void run_cuda(Dtype dtype, const CudaLoop& loop, cudaStream_t stream, Make&& make) {
  dispatch_dtype<kGroup>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto f = make(acc_t<T>{});
    if constexpr (kAccumulates && sizeof(T) != 8 && Accumulating<decltype(f)>::kOperands <= kMaxVectorOperands) {
      if (loop.num_operands == Accumulating<decltype(f)>::kOperands) return launch_accumulating<T>(loop, f, stream);
    }
    launch_elementwise<T, kKernels>(loop, f, stream);
  });
}

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_CUH_
