// fusegen-runtime.h: what a generated op hands to the shared runtime (fusegen-runtime.cpp):
// one OpDef descriptor with its names, schemas and kernel function pointers. The runtime
// does everything that is the same for every op (argument checks, type promotion,
// broadcasting, allocation, the CPU parallel loop, the CUDA device guard and stream, the
// Meta impl, autograd and the torch registration), so an op's own translation unit
// includes no torch header and compiles in about a second.
// Hand-written, not templated; copied next to the generated sources so they build alone.
// Include guard, not #pragma once: a bundle of ops includes several identical copies.
#ifndef FUSEGEN_RUNTIME_H_
#define FUSEGEN_RUNTIME_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fusegen-math.h"

#ifdef FUSEGEN_WITH_CUDA
// The CUDA runtime's own spelling of a stream handle, so this header needs no CUDA header.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
#endif

// Vector versions of the C math functions for the CPU loop: glibc's libmvec has a SIMD
// variant of each (exp, log, tanh, erf, ...), which GCC calls from a vectorized loop when
// the function is declared `simd` and errno is off (-fno-math-errno, part of fusegen's
// flags; the op library links -lmvec). glibc declares them so only under -ffast-math;
// declaring them here keeps IEEE semantics otherwise. float only: their accuracy is within
// a few ulp, like the Sleef functions of eager's vectorized fp32 kernels, while float64,
// the dtype of gradcheck and of every oracle, keeps glibc's scalar functions (within an ulp)
// so that ill-conditioned derivatives (1 - tanh(x)^2 near saturation) stay eager's.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && \
    defined(__GLIBC__) && defined(FUSEGEN_LIBMVEC)
#define FUSEGEN_SIMD_MATH(name) float name##f(float) noexcept __attribute__((simd("notinbranch")));
extern "C" {
FUSEGEN_SIMD_MATH(exp)
FUSEGEN_SIMD_MATH(expm1)
FUSEGEN_SIMD_MATH(log)
FUSEGEN_SIMD_MATH(log1p)
FUSEGEN_SIMD_MATH(sin)
FUSEGEN_SIMD_MATH(cos)
FUSEGEN_SIMD_MATH(tan)
FUSEGEN_SIMD_MATH(tanh)
FUSEGEN_SIMD_MATH(atan)
FUSEGEN_SIMD_MATH(erf)
FUSEGEN_SIMD_MATH(erfc)
float powf(float, float) noexcept __attribute__((simd("notinbranch")));
}
#undef FUSEGEN_SIMD_MATH
#endif

// The CPU loop is compiled twice, for x86-64's baseline (SSE2, 4 floats a step) and for
// AVX2 (8 floats a step, libmvec's AVX2 variants), and the loader picks one for the CPU
// it runs on (an ifunc), so a cached library stays valid on any x86-64 machine. AVX2
// without FMA: `a*b + c` stays two roundings, as eager computes it.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && defined(__GLIBC__)
#define FUSEGEN_CPU_TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define FUSEGEN_CPU_TARGETS
#endif

namespace fusegen {

// The kernel interface: the runtime lays out the operands with at::TensorIterator
// (broadcasting, type promotion, output allocation and memory format, as eager does) and
// hands an op's kernels data pointers and byte strides, never tensors. Operands come
// outputs first, then inputs, as TensorIterator orders them: the forward's one output and
// its tensors; the backward's gradients (one per kernel gradient, a null pointer when not
// requested) and dout, then the tensors the backward reads. scalars: the forward's scalars,
// or those the backward reads.
//
// CPU: one 1-D run of n elements, the inner loop of TensorIterator::for_each (which splits
// the work over threads with at::parallel_for). strides[k] is operand k's step in bytes.
using CpuKernel = void (*)(Dtype dtype, char* const* data, const int64_t* strides, int64_t n,
                           const double* scalars);

// CUDA: the whole iteration space. ndim == 0 when it is contiguous (after TensorIterator
// has coalesced its dimensions); otherwise sizes[ndim] (dimension 0 the fastest) and
// strides[d * num_operands + k], operand k's byte stride along dimension d.
constexpr int kMaxDims = 25;  // at::MAX_DIMS, so no dimension count ATen allows is refused
struct CudaLoop {
  int64_t numel;
  int ndim;
  int num_operands;
  const int64_t* sizes;
  const int64_t* strides;
  char* const* data;
};
using CudaKernel = void (*)(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);

// A backward's CUDA kernel that sums gradients of broadcast inputs (fusegen-cuda.cuh,
// accumulating_kernel) moves vectors of this many elements along the loop's dimension 0;
// the runtime sends it only loops whose dimension 0 splits into them.
constexpr int kAccumulatingWidth = 4;
// The vector and accumulating kernels mark each operand's access in one bit of a 32-bit
// mask (64 bits cost the 16-bit vector kernel 19 registers): a loop of more operands (a
// backward of about 16 inputs) takes the strided kernel, and a backward of more sums in ATen.
constexpr int kMaxVectorOperands = 32;

// A gradient that is a function of dout alone, as the eager ops that compute it, applied
// to dout in order: `a - b` gives b the steps {'-'}, `2*x` gives x {'*', 2}. No kernel
// reads the inputs for it.
struct DoutStep {
  char op;       // '-': negate; '*': multiply by value; '/': divide by value
  double value;
};

// Where one input's gradient comes from.
struct GradDef {
  int output;              // the backward kernel's output that holds it (identical gradients
                           // share one), -1: none
  int num_steps;           // >= 0: a function of dout alone, `steps` applied to dout (0: dout
                           // itself, no kernel ever); -1: only the kernel computes it
  const DoutStep* steps;
};

// backward_inputs[i] == kResult: the backward reads the forward's output, saved with
// save_for_backward (so an in-place change of the output before backward is caught).
constexpr int kResult = -1;

// One op, described by its generated code. Names are strings (any user name works); all
// arrays are static data of the op's translation unit.
struct OpDef {
  int abi;                          // kAbi of the header the op was compiled with
  const char* name;                 // the op's name: fusegen::<name>
  const char* schema;               // "<name>(Tensor a, ..., float s, ...) -> Tensor"
  const char* backward_schema;      // "<name>_backward(...) -> Tensor[]", nullptr without one
  int num_inputs;
  const char* const* input_names;   // the user's names (schema, messages)
  int num_scalars;
  const char* const* scalar_names;
  int num_backward_inputs;          // the tensors the backward reads (after dout)
  const int* backward_inputs;       // ... as indices into the inputs, or kResult
  const char* const* backward_input_names;  // ... named for messages (the user's names)
  int num_backward_scalars;
  const int* backward_scalars;      // indices into the scalars
  int num_kernel_grads;             // outputs of the backward kernel: distinct gradients
  const GradDef* grads;             // per input: where its gradient comes from
  CpuKernel forward_cpu;
  CpuKernel backward_cpu;           // nullptr without kernel gradients
  CudaKernel forward_cuda;          // nullptr in a build without CUDA
  CudaKernel backward_cuda;
  bool backward_accumulates;        // backward_cuda takes accumulators (accumulates_in_kernel):
                                    // not an auxiliary op's, whose kernels are plain
  // Forward-mode AD through fusegen::<name>_jvp (built into the same library): its tensor
  // arguments, each an index into the inputs (that input's primal) or num_inputs + i
  // (input i's tangent), and its scalars as indices into the scalars. num_jvp_args: -1 when
  // the op has no fused forward mode (an auxiliary op), 0 when every gradient is zero (so
  // is the tangent; there is no <name>_jvp).
  int num_jvp_args;
  const int* jvp_args;
  int num_jvp_scalars;
  const int* jvp_scalars;
};

constexpr int kAbi = 6;

// Defines fusegen::<name> (and <name>_backward) and registers the op's CPU, Meta, CUDA and
// Autograd kernels. Called once per op from a static initializer of the op's library.
bool register_op(const OpDef& def);

// ---------------------------------------------------------------------------------------
// Host fp16 and bf16: storage types for the CPU kernels, converted exactly as c10::Half
// and c10::BFloat16 convert (round to nearest even, NaN kept), and computed in float as
// at::opmath does.

struct Half {
  uint16_t x;
};
struct BFloat16 {
  uint16_t x;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c10::detail::fp16_ieee_to_fp32_value (portable path).
inline float to_float(Half h) {
  const uint32_t w = static_cast<uint32_t>(h.x) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (UINT32_C(0xE0) << 23)) * bits_float(UINT32_C(15) << 23);
  const float denormalized = bits_float((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
  // A mask, not a branch: both sides are computed anyway, and a loop of these vectorizes
  // (GCC does not if-convert a select between float results under -ftrapping-math).
  const uint32_t subnormal = UINT32_C(0) - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
  return bits_float(sign | (subnormal & float_bits(denormalized)) | (~subnormal & float_bits(normalized)));
}

// c10::detail::fp16_ieee_from_fp32_value (portable path).
inline Half to_half(float f) {
  float base = (std::fabs(f) * bits_float(UINT32_C(239) << 23)) * bits_float(UINT32_C(17) << 23);
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  bias = bias < UINT32_C(0x71000000) ? UINT32_C(0x71000000) : bias;
  base = bits_float((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & UINT32_C(0x00007C00)) + (bits & UINT32_C(0x00000FFF));
  const uint32_t nan = UINT32_C(0) - static_cast<uint32_t>(shl1_w > UINT32_C(0xFF000000));
  return Half{static_cast<uint16_t>((sign >> 16) | (nan & UINT32_C(0x7E00)) | (~nan & nonsign))};
}

inline float to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.x) << 16); }

// c10::detail::round_to_nearest_even.
inline BFloat16 to_bfloat16(float f) {
  if (std::isnan(f)) return BFloat16{UINT16_C(0x7FC0)};
  const uint32_t u = float_bits(f);
  return BFloat16{static_cast<uint16_t>((u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16)};
}

// The same conversions over a contiguous run of n values, bit for bit: the CPU loop
// converts its fp16/bf16 operands a block at a time through these. Defined in
// fusegen-runtime.cpp (one copy, compiled once), which picks F16C (fp16) or AVX2 (bf16)
// instructions when the CPU it runs on has them and a portable loop otherwise.
void convert(const Half* x, float* y, int64_t n);
void convert(const float* x, Half* y, int64_t n);
void convert(const BFloat16* x, float* y, int64_t n);
void convert(const float* x, BFloat16* y, int64_t n);

// Storage type -> compute type (opmath) and back.
template <typename T> struct Host { using acc = T; static T load(T v) { return v; } static T store(T v) { return v; } };
template <> struct Host<Half> {
  using acc = float;
  static float load(Half v) { return to_float(v); }
  static Half store(float v) { return to_half(v); }
};
template <> struct Host<BFloat16> {
  using acc = float;
  static float load(BFloat16 v) { return to_float(v); }
  static BFloat16 store(float v) { return to_bfloat16(v); }
};

// Calls f(T{}) for the storage type of `dtype`: the one switch over dtypes on the host.
template <typename F>
void host_dispatch(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32: f(float{}); break;
    case Dtype::kFloat64: f(double{}); break;
    case Dtype::kFloat16: f(Half{}); break;
    case Dtype::kBFloat16: f(BFloat16{}); break;
  }
}

// ---------------------------------------------------------------------------------------
// The CPU loop every kernel shares: one elementwise function F of F::kInputs inputs and
// F::kOutputs outputs in the compute type (F(const acc* x, acc* y)), over one CpuKernel run.
//
// The math runs in one loop over contiguous arrays of the compute type, which the compiler
// vectorizes (no branch, no stride, no aliasing: `ivdep`). All contiguous float/double
// operands are used in place. Anything else goes through small per-block buffers:
// fp16/bf16 operands are converted a block at a time by the vectorized `convert` (a
// strided one gathered into or scattered from a staging block of its own type), other
// strided inputs are gathered into one, a broadcast (stride 0) input is converted once,
// strided outputs are scattered from one, and a gradient nobody asked for (a null
// pointer) is written to one and dropped.
constexpr int64_t kCpuBlock = 256;  // elements per block: the buffers of a block stay in L1

template <typename A, typename F>
FUSEGEN_CPU_TARGETS void compute_block(const A* const* x, A* const* y, int64_t m, const F& f) {
  // Local copies: the compiler then knows the stores through y[k] cannot move a pointer.
  const A* xs[F::kInputs];
  A* ys[F::kOutputs];
  for (int j = 0; j < F::kInputs; ++j) xs[j] = x[j];
  for (int k = 0; k < F::kOutputs; ++k) ys[k] = y[k];
#pragma GCC ivdep
  for (int64_t i = 0; i < m; ++i) {
    A xi[F::kInputs];
    A yi[F::kOutputs];
    for (int j = 0; j < F::kInputs; ++j) xi[j] = xs[j][i];
    f(xi, yi);
    for (int k = 0; k < F::kOutputs; ++k) ys[k][i] = yi[k];
  }
}

template <typename T, typename F>
void elementwise_cpu(char* const* data, const int64_t* strides, int64_t n, const F& f) {
  using A = typename Host<T>::acc;
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr bool kNarrow = !std::is_same<T, A>::value;  // fp16/bf16: converted on the way
  char* const* out = data;
  char* const* in = data + kOut;
  const int64_t* out_strides = strides;
  const int64_t* in_strides = strides + kOut;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T));

  bool direct = !kNarrow;  // every operand contiguous and present: no buffer at all
  for (int k = 0; k < kOut; ++k) direct = direct && out[k] != nullptr && out_strides[k] == kSize;
  for (int j = 0; j < kIn; ++j) direct = direct && in_strides[j] == kSize;
  if (direct) {
    const A* x[kIn > 0 ? kIn : 1];
    A* y[kOut];
    for (int j = 0; j < kIn; ++j) x[j] = reinterpret_cast<const A*>(in[j]);
    for (int k = 0; k < kOut; ++k) y[k] = reinterpret_cast<A*>(out[k]);
    compute_block(x, y, n, f);
    return;
  }

  A in_buf[kIn > 0 ? kIn : 1][kCpuBlock];
  A out_buf[kOut][kCpuBlock];
  T staging[kNarrow ? kCpuBlock : 1];  // a strided fp16/bf16 operand's block, unconverted
  const A* x[kIn > 0 ? kIn : 1];
  A* y[kOut];
  bool in_place[kIn > 0 ? kIn : 1];
  bool out_place[kOut];
  for (int j = 0; j < kIn; ++j) {
    in_place[j] = !kNarrow && in_strides[j] == kSize;
    if (in_strides[j] == 0) {  // broadcast: one value, converted once
      const A v = Host<T>::load(*reinterpret_cast<const T*>(in[j]));
      for (int64_t i = 0; i < kCpuBlock; ++i) in_buf[j][i] = v;
    }
  }
  for (int k = 0; k < kOut; ++k) out_place[k] = !kNarrow && out[k] != nullptr && out_strides[k] == kSize;

  for (int64_t begin = 0; begin < n; begin += kCpuBlock) {
    const int64_t m = n - begin < kCpuBlock ? n - begin : kCpuBlock;
    for (int j = 0; j < kIn; ++j) {
      if (in_place[j]) {
        x[j] = reinterpret_cast<const A*>(in[j]) + begin;
        continue;
      }
      x[j] = in_buf[j];
      if (in_strides[j] == 0) continue;
      const char* p = in[j] + begin * in_strides[j];
      if constexpr (kNarrow) {
        const T* run = reinterpret_cast<const T*>(p);
        if (in_strides[j] != kSize) {
          for (int64_t i = 0; i < m; ++i) std::memcpy(&staging[i], p + i * in_strides[j], sizeof(T));
          run = staging;
        }
        convert(run, in_buf[j], m);
      } else {
        for (int64_t i = 0; i < m; ++i) in_buf[j][i] = *reinterpret_cast<const T*>(p + i * in_strides[j]);
      }
    }
    for (int k = 0; k < kOut; ++k) y[k] = out_place[k] ? reinterpret_cast<A*>(out[k]) + begin : out_buf[k];
    compute_block(x, y, m, f);
    for (int k = 0; k < kOut; ++k) {
      if (out_place[k] || out[k] == nullptr) continue;
      char* p = out[k] + begin * out_strides[k];
      if constexpr (kNarrow) {
        if (out_strides[k] == kSize) {
          convert(out_buf[k], reinterpret_cast<T*>(p), m);
          continue;
        }
        convert(out_buf[k], staging, m);
        for (int64_t i = 0; i < m; ++i) std::memcpy(p + i * out_strides[k], &staging[i], sizeof(T));
      } else {
        for (int64_t i = 0; i < m; ++i) *reinterpret_cast<T*>(p + i * out_strides[k]) = out_buf[k][i];
      }
    }
  }
}

// A CpuKernel for the elementwise function F, in the compute type of `dtype`. `make(tag)`
// builds F for the compute type of tag's storage type (the scalars converted to it).
template <typename Make>
void run_cpu(Dtype dtype, char* const* data, const int64_t* strides, int64_t n, Make&& make) {
  host_dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise_cpu<T>(data, strides, n, make(typename Host<T>::acc{}));
  });
}

}  // namespace fusegen

#endif  // FUSEGEN_RUNTIME_H_
