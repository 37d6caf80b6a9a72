// fusegen-cpu.h: the CPU loop an op's CPU kernels run (run_cpu): its elementwise function
// over one run of TensorIterator's loop, vectorized by the compiler.
#ifndef FUSEGEN_CPU_H_
#define FUSEGEN_CPU_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fusegen-half.h"
#include "fusegen-math.h"
#include "fusegen-runtime.h"

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
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && \
    defined(__GLIBC__)
#define FUSEGEN_CPU_TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define FUSEGEN_CPU_TARGETS
#endif

namespace fusegen {

// Storage type -> compute type (opmath) and back.
template <typename T>
struct Host {
  using acc = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
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

// `first`: the linear index of element 0 of the block (a functor that draws random numbers
// draws them per element, fusegen-random.h).
template <typename A, typename F>
FUSEGEN_CPU_TARGETS void compute_block(const A* const* x, A* const* y, int64_t m, const F& f,
                                       int64_t first) {
  // Local copies: the compiler then knows the stores through y[k] cannot move a pointer.
  const A* xs[F::kInputs > 0 ? F::kInputs : 1];
  A* ys[F::kOutputs];
  for (int j = 0; j < F::kInputs; ++j) xs[j] = x[j];
  for (int k = 0; k < F::kOutputs; ++k) ys[k] = y[k];
  // A functor that draws takes the block's uniforms, drawn first, four (a coarse stream's:
  // eight) elements to a Philox block (the math loop then vectorizes as for any other op).
  constexpr int kStreams = kRandomOf<F> > 0 ? kRandomOf<F> : 1;
  A u[kRandomOf<F> > 0 ? kCpuBlock : 1][kStreams];
  if constexpr (kRandomOf<F> > 0) {
    uniforms<kStreams, kCpuBlock, 1, kCoarseOf<F>>(f.random, static_cast<uint64_t>(first), u);
  } else {
    (void)u;
    (void)first;
  }
#pragma GCC ivdep
  for (int64_t i = 0; i < m; ++i) {
    A xi[F::kInputs > 0 ? F::kInputs : 1];
    A yi[F::kOutputs];
    for (int j = 0; j < F::kInputs; ++j) xi[j] = xs[j][i];
    if constexpr (kRandomOf<F> > 0) {
      f(xi, u[i], yi);
    } else {
      f(xi, yi);
    }
    for (int k = 0; k < F::kOutputs; ++k) ys[k][i] = yi[k];
  }
}

template <typename T, typename F>
void elementwise_cpu(char* const* data, const int64_t* strides, int64_t n, const F& f,
                     int64_t first) {
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
  if (direct && kRandomOf<F> == 0) {  // (a functor that draws goes by blocks: its uniforms')
    const A* x[kIn > 0 ? kIn : 1];
    A* y[kOut];
    for (int j = 0; j < kIn; ++j) x[j] = reinterpret_cast<const A*>(in[j]);
    for (int k = 0; k < kOut; ++k) y[k] = reinterpret_cast<A*>(out[k]);
    compute_block(x, y, n, f, first);
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
  for (int k = 0; k < kOut; ++k)
    out_place[k] = !kNarrow && out[k] != nullptr && out_strides[k] == kSize;

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
          for (int64_t i = 0; i < m; ++i)
            std::memcpy(&staging[i], p + i * in_strides[j], sizeof(T));
          run = staging;
        }
        convert(run, in_buf[j], m);
      } else {
        for (int64_t i = 0; i < m; ++i)
          in_buf[j][i] = *reinterpret_cast<const T*>(p + i * in_strides[j]);
      }
    }
    for (int k = 0; k < kOut; ++k)
      y[k] = out_place[k] ? reinterpret_cast<A*>(out[k]) + begin : out_buf[k];
    compute_block(x, y, m, f, first + begin);
    for (int k = 0; k < kOut; ++k) {
      if (out_place[k] || out[k] == nullptr) continue;
      char* p = out[k] + begin * out_strides[k];
      if constexpr (kNarrow) {
        if (out_strides[k] == kSize) {
          convert(out_buf[k], reinterpret_cast<T*>(p), m);
          continue;
        }
        convert(out_buf[k], staging, m);
        for (int64_t i = 0; i < m; ++i)
          std::memcpy(p + i * out_strides[k], &staging[i], sizeof(T));
      } else {
        for (int64_t i = 0; i < m; ++i)
          *reinterpret_cast<T*>(p + i * out_strides[k]) = out_buf[k][i];
      }
    }
  }
}

// A CpuKernel for the elementwise function F, in the compute type of `dtype`. `make(tag)`
// builds F for the compute type of tag's storage type (the scalars converted to it).
// `first`: the run's first linear index (Random::first; 0 for an op that draws nothing).
template <typename Make>
void run_cpu(Dtype dtype, char* const* data, const int64_t* strides, int64_t n, int64_t first,
             Make&& make) {
  host_dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    elementwise_cpu<T>(data, strides, n, make(typename Host<T>::acc{}), first);
  });
}

}  // namespace fusegen

#endif  // FUSEGEN_CPU_H_
