// fusegen-cuda-vector.cuh: the kernel of loops whose dimension 0 splits into vectors
// (broadcast scales and biases, channels_last, sliced inputs).
#ifndef FUSEGEN_CUDA_VECTOR_CUH_
#define FUSEGEN_CUDA_VECTOR_CUH_

#include "fusegen-cuda-common.cuh"

namespace fusegen {

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
// above); `element` alone would leave the byte permutes in place.
#if FUSEGEN_DEVICE_CODE
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
__device__ __forceinline__ void load_operand(const Modes<kN>& modes, int k, const char* at,
                                             Vec<T, kVec>& out) {
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
__device__ __forceinline__ void store_operand(const Modes<kN>& modes, int k, char* at,
                                              const Vec<T, kVec>& value) {
  if (kGathers && modes.gathered >> k & 1) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) *reinterpret_cast<T*>(at + e * modes.step[k]) = value.v[e];
  } else {
    *reinterpret_cast<Vec<T, kVec>*>(at) = value;
  }
}
#endif  // FUSEGEN_DEVICE_CODE

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
#if FUSEGEN_DEVICE_CODE
template <typename T, int kVec, typename F>
__device__ __forceinline__ void compute_crossing(
    const Pointers<F::kInputs + F::kOutputs>& p,
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
      const int32_t at = !(modes.repeated >> k & 1) ? offset[k] + e * int32_t(sizeof(T))
                         : e < left                 ? offset[k]
                                                    : next[k];
      x[j] = to_acc(*reinterpret_cast<const T*>(p.p[k] + at));
    }
    call(f, x, y, static_cast<uint64_t>(i) + e);
#pragma unroll
    for (int k = 0; k < kOut; ++k) {
      if (p.p[k] != nullptr)
        *reinterpret_cast<T*>(p.p[k] + offset[k] + e * int32_t(sizeof(T))) = from_acc<T>(y[k]);
    }
  }
}

template <typename T, int kVec, bool kGathers, typename F>
__global__ void __launch_bounds__(kThreads, FUSEGEN_VECTOR_BLOCKS)
    vector_kernel(Pointers<F::kInputs + F::kOutputs> p,
                  OffsetCalculator<F::kInputs + F::kOutputs, uint32_t> calc, uint32_t n_vec,
                  Modes<F::kInputs + F::kOutputs> modes, bool flat, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kU = kGathers ? kUnroll : kVectorUnroll;
  using Offset = int32_t;
  constexpr int64_t kChunk = int64_t(kThreads) * kU;
  const IntDivider<uint32_t>& row = calc.sizes[0];
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base < n_vec;
       base += int64_t(gridDim.x) * kChunk) {
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
      compute_vector(x_v[u], y_v, f, NoVisit{}, static_cast<uint64_t>(base + u * kThreads) * kVec);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (p.p[k] != nullptr) store_operand<kGathers>(modes, k, p.p[k] + offset[u][k], y_v[k]);
      }
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, int kVec, bool kGathers, typename F>
const KernelRef& vector_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::vector_kernel", TypeName<T>::get(), kVec, kGathers,
                         functor_name<F>(def));
    }
  };
  return kernel_ref<Name>(f);
}
#endif

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_VECTOR_CUH_
