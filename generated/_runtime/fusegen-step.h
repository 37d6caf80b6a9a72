// fusegen-step.h: the CPU loop of a step op (an op's <name>.cpp calls run_step_cpu). Each
// operand has its own dtype: a block of each operand read is converted to the compute
// type, the op's Step runs per element, and each updated operand's block is converted back
// to its own dtype, so bf16 parameters and fp32 state mix in one pass.
#ifndef FUSEGEN_STEP_H_
#define FUSEGEN_STEP_H_

#include <cstdint>

#include "fusegen-half.h"
#include "fusegen-math.h"
#include "fusegen-runtime.h"

namespace fusegen {

// Elements per block: every operand's block of doubles (24 operands at most) fits in
// 24 KiB of stack and in the L1 cache.
constexpr int64_t kStepBlock = 128;

inline int64_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat64: return 8;
    case Dtype::kFloat16:
    case Dtype::kBFloat16: return 2;
    case Dtype::kFloat32: break;
  }
  return 4;
}

// n (<= kStepBlock) values of `dtype` at p, as T.
template <typename T, typename S>
inline void load_as(const char* p, int64_t n, T* out) {
  const S* x = reinterpret_cast<const S*>(p);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i]);
}

template <typename T, typename S>
inline void load_narrow(const char* p, int64_t n, T* out) {
  float wide[kStepBlock];
  convert(reinterpret_cast<const S*>(p), wide, n);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(wide[i]);
}

template <typename T>
inline void step_load(const char* p, Dtype dtype, int64_t n, T* out) {
  switch (dtype) {
    case Dtype::kFloat32: return load_as<T, float>(p, n, out);
    case Dtype::kFloat64: return load_as<T, double>(p, n, out);
    case Dtype::kFloat16: return load_narrow<T, Half>(p, n, out);
    case Dtype::kBFloat16: return load_narrow<T, BFloat16>(p, n, out);
  }
}

template <typename T, typename S>
inline void store_as(const T* in, int64_t n, char* p) {
  S* y = reinterpret_cast<S*>(p);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<S>(in[i]);
}

template <typename T, typename S>
inline void store_narrow(const T* in, int64_t n, char* p) {
  float wide[kStepBlock];
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<float>(in[i]);
  convert(wide, reinterpret_cast<S*>(p), n);
}

template <typename T>
inline void step_store(const T* in, Dtype dtype, int64_t n, char* p) {
  switch (dtype) {
    case Dtype::kFloat32: return store_as<T, float>(in, n, p);
    case Dtype::kFloat64: return store_as<T, double>(in, n, p);
    case Dtype::kFloat16: return store_narrow<T, Half>(in, n, p);
    case Dtype::kBFloat16: return store_narrow<T, BFloat16>(in, n, p);
  }
}

template <typename F, typename T>
void step_loop(char* const* data, const Dtype* dtypes, int64_t n, const double* scalars) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kInRows = kIn > 0 ? kIn : 1;  // C++ has no empty arrays
  const F f = F::make(scalars);
  T in[kInRows][kStepBlock];
  T out[kOut][kStepBlock];
  for (int64_t start = 0; start < n; start += kStepBlock) {
    const int64_t m = n - start < kStepBlock ? n - start : kStepBlock;
    for (int k = 0; k < kIn; ++k) {
      const Dtype d = dtypes[kOut + k];
      step_load(data[kOut + k] + start * dtype_size(d), d, m, in[k]);
    }
    for (int64_t e = 0; e < m; ++e) {
      T x[kInRows];
      T y[kOut];
      for (int k = 0; k < kIn; ++k) x[k] = in[k][e];
      f(x, y);
      for (int j = 0; j < kOut; ++j) out[j][e] = y[j];
    }
    for (int j = 0; j < kOut; ++j)
      step_store(out[j], dtypes[j], m, data[j] + start * dtype_size(dtypes[j]));
  }
}

// The op's Step<T> over one run: in double when an operand is float64, else in float
// (fp16/bf16 compute in float, as PyTorch's opmath does).
template <template <typename> class F>
void run_step_cpu(char* const* data, const Dtype* dtypes, int64_t n, const double* scalars) {
  constexpr int kN = F<float>::kInputs + F<float>::kOutputs;
  bool wide = false;
  for (int k = 0; k < kN; ++k) wide = wide || dtypes[k] == Dtype::kFloat64;
  if (wide) {
    step_loop<F<double>, double>(data, dtypes, n, scalars);
  } else {
    step_loop<F<float>, float>(data, dtypes, n, scalars);
  }
}

}  // namespace fusegen

#endif  // FUSEGEN_STEP_H_
