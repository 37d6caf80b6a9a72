// fusegen-cuda-step.cuh: the CUDA kernel of a step op and its launcher (an op's <name>.cu
// calls run_step_cuda). One launch covers many tensors, as ATen's multi_tensor_apply does:
// the runtime (fusegen-step.cpp) packs up to step_max_tensors() tensors into one launch,
// one block per chunk of kStepChunk elements; the tensors' pointers travel in the kernel's
// parameters, so a launch needs no copy to the device and can be captured in a CUDA graph.
#ifndef FUSEGEN_CUDA_STEP_CUH_
#define FUSEGEN_CUDA_STEP_CUH_

#include "fusegen-cuda-common.cuh"
#include "fusegen-runtime.h"

namespace fusegen {

// 512 threads, two blocks per SM: at most 64 registers (unbounded, the 4-element ILP of
// AdamW took 104, one block per SM).
constexpr int kStepThreads = 512;
constexpr int kStepVec = 4;  // elements per access: 16 bytes of float, 8 of fp16/bf16
// A launch whose operands are all 16-bit (bf16 params, gradients and state) moves 8 of them
// per access, 16 bytes per operand as the float path does, kept as raw bits until each
// element is computed, so that the registers stay those of the 4-element path.
constexpr int kStepNarrowVec = 8;
// FUSEGEN_STEP_NARROW=0: every float launch takes the 4-element path (a benchmark's control).
#ifndef FUSEGEN_STEP_NARROW
#define FUSEGEN_STEP_NARROW 1
#endif

// The parameters of one launch (at most 4 KiB, checked below).
template <int kN>
struct StepArgs {
  static constexpr int kTensors = step_max_tensors(kN);
  char* data[kTensors][kN];
  int64_t numel[kTensors];
  int32_t first_chunk[kTensors + 1];
  int32_t num_tensors;
  double scalars[kStepMaxScalars];
  const void* scalar_data[kStepMaxScalars];
  uint32_t scalar_is_double;
  int8_t dtypes[kN];
};

#if FUSEGEN_DEVICE_CODE
__device__ __forceinline__ int step_size(int8_t dtype) {
  return dtype == int8_t(Dtype::kFloat64) ? 8 : dtype == int8_t(Dtype::kFloat32) ? 4 : 2;
}

// One element of operand data `p` (of `dtype`) at index i, in T; and written from T.
template <typename T>
__device__ __forceinline__ T step_read(const char* p, int8_t dtype, int64_t i) {
  switch (static_cast<Dtype>(dtype)) {
    case Dtype::kFloat32: return static_cast<T>(reinterpret_cast<const float*>(p)[i]);
    case Dtype::kFloat64: return static_cast<T>(reinterpret_cast<const double*>(p)[i]);
    case Dtype::kFloat16: return static_cast<T>(to_acc(reinterpret_cast<const Half*>(p)[i]));
    case Dtype::kBFloat16: break;
  }
  return static_cast<T>(to_acc(reinterpret_cast<const BFloat16*>(p)[i]));
}

template <typename T>
__device__ __forceinline__ void step_write(char* p, int8_t dtype, int64_t i, T v) {
  switch (static_cast<Dtype>(dtype)) {
    case Dtype::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); return;
    case Dtype::kFloat64: reinterpret_cast<double*>(p)[i] = static_cast<double>(v); return;
    case Dtype::kFloat16:
      reinterpret_cast<Half*>(p)[i] = from_acc<Half>(static_cast<float>(v));
      return;
    case Dtype::kBFloat16: break;
  }
  reinterpret_cast<BFloat16*>(p)[i] = from_acc<BFloat16>(static_cast<float>(v));
}

// kStepVec elements at index i (a multiple of kStepVec, the data 16-byte aligned): one
// vector access per operand.
template <typename T>
__device__ __forceinline__ void step_read_vec(const char* p, int8_t dtype, int64_t i,
                                              T (&v)[kStepVec]) {
  switch (static_cast<Dtype>(dtype)) {
    case Dtype::kFloat32: {
      const float4 a = *reinterpret_cast<const float4*>(p + i * 4);
      v[0] = static_cast<T>(a.x), v[1] = static_cast<T>(a.y), v[2] = static_cast<T>(a.z),
      v[3] = static_cast<T>(a.w);
      return;
    }
    case Dtype::kFloat64: {
      const double2 a = *reinterpret_cast<const double2*>(p + i * 8);
      const double2 b = *reinterpret_cast<const double2*>(p + i * 8 + 16);
      v[0] = static_cast<T>(a.x), v[1] = static_cast<T>(a.y), v[2] = static_cast<T>(b.x),
      v[3] = static_cast<T>(b.y);
      return;
    }
    case Dtype::kFloat16:
    case Dtype::kBFloat16: break;
  }
  const uint2 a = *reinterpret_cast<const uint2*>(p + i * 2);
  const uint16_t bits[kStepVec] = {static_cast<uint16_t>(a.x), static_cast<uint16_t>(a.x >> 16),
                                   static_cast<uint16_t>(a.y), static_cast<uint16_t>(a.y >> 16)};
#pragma unroll
  for (int e = 0; e < kStepVec; ++e) {
    v[e] = dtype == int8_t(Dtype::kFloat16) ? static_cast<T>(to_acc(Half{bits[e]}))
                                            : static_cast<T>(to_acc(BFloat16{bits[e]}));
  }
}

template <typename T>
__device__ __forceinline__ void step_write_vec(char* p, int8_t dtype, int64_t i,
                                               const T (&v)[kStepVec]) {
  switch (static_cast<Dtype>(dtype)) {
    case Dtype::kFloat32:
      *reinterpret_cast<float4*>(p + i * 4) =
          make_float4(static_cast<float>(v[0]), static_cast<float>(v[1]), static_cast<float>(v[2]),
                      static_cast<float>(v[3]));
      return;
    case Dtype::kFloat64:
      *reinterpret_cast<double2*>(p + i * 8) =
          make_double2(static_cast<double>(v[0]), static_cast<double>(v[1]));
      *reinterpret_cast<double2*>(p + i * 8 + 16) =
          make_double2(static_cast<double>(v[2]), static_cast<double>(v[3]));
      return;
    case Dtype::kFloat16:
    case Dtype::kBFloat16: break;
  }
  uint16_t bits[kStepVec];
#pragma unroll
  for (int e = 0; e < kStepVec; ++e) {
    bits[e] = dtype == int8_t(Dtype::kFloat16) ? from_acc<Half>(static_cast<float>(v[e])).x
                                               : from_acc<BFloat16>(static_cast<float>(v[e])).x;
  }
  *reinterpret_cast<uint2*>(p + i * 2) =
      make_uint2(bits[0] | (static_cast<unsigned>(bits[1]) << 16),
                 bits[2] | (static_cast<unsigned>(bits[3]) << 16));
}

// 16-bit element e (0..7) of 16 bytes of raw bits, in T; and the bits of v put there.
__device__ __forceinline__ uint32_t step_word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ T step_narrow_read(const uint4& v, int8_t dtype, int e) {
  const uint16_t bits = static_cast<uint16_t>(step_word(v, e / 2) >> (16 * (e % 2)));
  return dtype == int8_t(Dtype::kFloat16) ? static_cast<T>(to_acc(Half{bits}))
                                          : static_cast<T>(to_acc(BFloat16{bits}));
}

template <typename T>
__device__ __forceinline__ void step_narrow_write(uint4& v, int8_t dtype, int e, T x) {
  const uint32_t bits = dtype == int8_t(Dtype::kFloat16)
                            ? from_acc<Half>(static_cast<float>(x)).x
                            : from_acc<BFloat16>(static_cast<float>(x)).x;
  const uint32_t word = bits << (16 * (e % 2));
  switch (e / 2) {
    case 0: v.x |= word; return;
    case 1: v.y |= word; return;
    case 2: v.z |= word; return;
    default: v.w |= word; return;
  }
}

// One block per chunk: the block's tensor and chunk from the parameters, the scalars from
// the parameters or the device, then F over the chunk, kStepVec elements per thread and step
// (kNarrow, every operand 16-bit: kStepNarrowVec).
template <typename T, typename F, bool kNarrow>
__global__ void __launch_bounds__(kStepThreads, 2)
    step_kernel(const StepArgs<F::kInputs + F::kOutputs> a, bool aligned) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kN = kIn + kOut;
  constexpr int kInRows = kIn > 0 ? kIn : 1;
  constexpr int kScalarSlots = F::kScalars > 0 ? F::kScalars : 1;
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  int t = 0;  // the last tensor whose first chunk is at most this block
  for (int lo = 0, hi = a.num_tensors - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (a.first_chunk[mid] <= block) {
      t = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t start = int64_t(block - a.first_chunk[t]) * kStepChunk;
  const int64_t left = a.numel[t] - start;
  const int64_t n = left < kStepChunk ? left : kStepChunk;
  double s[kScalarSlots] = {};
#pragma unroll
  for (int k = 0; k < F::kScalars; ++k) {
    const void* d = a.scalar_data[k];
    s[k] = d == nullptr                       ? a.scalars[k]
           : (a.scalar_is_double >> k) & 1u ? *static_cast<const double*>(d)
                                             : static_cast<double>(*static_cast<const float*>(d));
  }
  const F f = F::make(s);
  char* p[kN];
  int8_t dtype[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    dtype[k] = a.dtypes[k];
    p[k] = a.data[t][k] + start * step_size(dtype[k]);
  }
  if constexpr (kNarrow) {
    constexpr int kVec = kStepNarrowVec;
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < n; i += int64_t(kStepThreads) * kVec) {
      if (aligned && i + kVec <= n) {
        uint4 in[kInRows];
        uint4 out[kOut];
#pragma unroll
        for (int k = 0; k < kIn; ++k) in[k] = *reinterpret_cast<const uint4*>(p[kOut + k] + i * 2);
#pragma unroll
        for (int j = 0; j < kOut; ++j) out[j] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          T xe[kInRows];
          T ye[kOut];
#pragma unroll
          for (int k = 0; k < kIn; ++k) xe[k] = step_narrow_read<T>(in[k], dtype[kOut + k], e);
          f(xe, ye);
#pragma unroll
          for (int j = 0; j < kOut; ++j) step_narrow_write(out[j], dtype[j], e, ye[j]);
        }
#pragma unroll
        for (int j = 0; j < kOut; ++j) *reinterpret_cast<uint4*>(p[j] + i * 2) = out[j];
        continue;
      }
      for (int64_t e = i; e < i + kVec && e < n; ++e) {  // the chunk's tail
        T xe[kInRows];
        T ye[kOut];
#pragma unroll
        for (int k = 0; k < kIn; ++k) xe[k] = step_read<T>(p[kOut + k], dtype[kOut + k], e);
        f(xe, ye);
#pragma unroll
        for (int j = 0; j < kOut; ++j) step_write(p[j], dtype[j], e, ye[j]);
      }
    }
  } else {
    for (int64_t i = int64_t(threadIdx.x) * kStepVec; i < n;
         i += int64_t(kStepThreads) * kStepVec) {
      T x[kInRows][kStepVec];
      T y[kOut][kStepVec];
      const bool whole = aligned && i + kStepVec <= n;
      if (whole) {
#pragma unroll
        for (int k = 0; k < kIn; ++k) step_read_vec(p[kOut + k], dtype[kOut + k], i, x[k]);
      } else {
#pragma unroll
        for (int k = 0; k < kIn; ++k) {
#pragma unroll
          for (int e = 0; e < kStepVec; ++e)
            x[k][e] = i + e < n ? step_read<T>(p[kOut + k], dtype[kOut + k], i + e) : T(0);
        }
      }
#pragma unroll
      for (int e = 0; e < kStepVec; ++e) {
        T xe[kInRows];
        T ye[kOut];
#pragma unroll
        for (int k = 0; k < kIn; ++k) xe[k] = x[k][e];
        f(xe, ye);
#pragma unroll
        for (int j = 0; j < kOut; ++j) y[j][e] = ye[j];
      }
      if (whole) {
#pragma unroll
        for (int j = 0; j < kOut; ++j) step_write_vec(p[j], dtype[j], i, y[j]);
      } else {
#pragma unroll
        for (int j = 0; j < kOut; ++j) {
#pragma unroll
          for (int e = 0; e < kStepVec; ++e)
            if (i + e < n) step_write(p[j], dtype[j], i + e, y[j][e]);
        }
      }
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, typename F, bool kNarrow>
const KernelRef& step_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::step_kernel", TypeName<T>::get(), functor_name<F>(def), kNarrow);
    }
  };
  return kernel_ref<Name>(f);
}
#endif

#if FUSEGEN_HOST_CODE
// One launch of F over the runtime's StepLaunch on `stream`: in double when an operand is
// float64, else in float.
template <template <typename> class F>
void run_step_cuda(const StepLaunch& l, cudaStream_t stream) {
  constexpr int kN = F<float>::kInputs + F<float>::kOutputs;
  static_assert(sizeof(StepArgs<kN>) <= 4096, "a kernel's parameters fit in 4 KiB");
  StepArgs<kN> a{};
  for (int t = 0; t < l.num_tensors; ++t) {
    for (int k = 0; k < kN; ++k) a.data[t][k] = l.data[t * kN + k];
    a.numel[t] = l.numel[t];
  }
  for (int t = 0; t <= l.num_tensors; ++t) a.first_chunk[t] = l.first_chunk[t];
  a.num_tensors = l.num_tensors;
  const unsigned blocks = static_cast<unsigned>(l.first_chunk[l.num_tensors]);
  for (int k = 0; k < l.num_scalars && k < kStepMaxScalars; ++k) {
    a.scalars[k] = l.scalars[k];
    a.scalar_data[k] = l.scalar_data[k];
    if (l.scalar_is_double[k]) a.scalar_is_double |= 1u << k;
  }
  bool wide = false, narrow = true;
  for (int k = 0; k < kN; ++k) {
    a.dtypes[k] = static_cast<int8_t>(l.dtypes[k]);
    wide = wide || l.dtypes[k] == Dtype::kFloat64;
    narrow = narrow && (l.dtypes[k] == Dtype::kFloat16 || l.dtypes[k] == Dtype::kBFloat16);
  }
  if (wide) {
    launch(FUSEGEN_KERNEL(F<double>{}, step_kernel, double, F<double>, false), {blocks},
           kStepThreads, 0, stream, a, l.aligned);
  } else if (FUSEGEN_STEP_NARROW && narrow && l.aligned) {
    launch(FUSEGEN_KERNEL(F<float>{}, step_kernel, float, F<float>, true), {blocks}, kStepThreads,
           0, stream, a, l.aligned);
  } else {
    launch(FUSEGEN_KERNEL(F<float>{}, step_kernel, float, F<float>, false), {blocks}, kStepThreads,
           0, stream, a, l.aligned);
  }

}

#endif  // FUSEGEN_HOST_CODE

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_STEP_CUH_
