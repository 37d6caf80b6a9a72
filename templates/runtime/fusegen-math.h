// fusegen-math.h: math helpers shared by every generated op, on the host and the device.
// No torch headers here: the CUDA kernels include this and compile with nvcc in seconds.
#ifndef FUSEGEN_MATH_H_
#define FUSEGEN_MATH_H_

#ifdef __CUDACC_RTC__
#include "fusegen-rtc.h"
#elif defined(FUSEGEN_CPU_LATER)
// An op's descriptor alone (its CPU kernels left for later, OpDef::cpu_later; its CUDA
// kernels compiled by NVRTC) computes nothing, and <cmath> would be most of its compile.
#include <cstdint>
#else
#include <cmath>
#include <cstdint>
#endif

#ifdef __CUDACC__
#define FUSEGEN_HD __host__ __device__ __forceinline__
#define FUSEGEN_HD_CONSTEXPR __host__ __device__ constexpr
#else
#define FUSEGEN_HD inline
#define FUSEGEN_HD_CONSTEXPR constexpr
#endif

// Which side of a CUDA build a translation unit compiles, for the kernel headers
// (fusegen-cuda-common.cuh): device code (kernels) under nvcc and NVRTC, host code
// (launchers) under nvcc and the host compiler; NVRTC, which compiles an op's kernels at
// run time, sees no host code. A build that defines both itself (tests/emulated: the
// kernels run on the CPU against a CUDA stand-in) keeps its choice.
#if defined(FUSEGEN_DEVICE_CODE) && defined(FUSEGEN_HOST_CODE)
#elif defined(__CUDACC_RTC__)
#define FUSEGEN_DEVICE_CODE 1
#define FUSEGEN_HOST_CODE 0
#elif defined(__CUDACC__)
#define FUSEGEN_DEVICE_CODE 1
#define FUSEGEN_HOST_CODE 1
#else
#define FUSEGEN_DEVICE_CODE 0
#define FUSEGEN_HOST_CODE 1
#endif

namespace fusegen {

// Storage dtypes the kernels are instantiated for. The host side maps at::ScalarType to
// this, so the .cu files never see a torch header.
enum class Dtype : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// torch.maximum/minimum propagate NaN; C's fmaxf/fminf return the other operand instead.
// A tie returns b, as torch's vectorized kernels do (it matters only for -0.0 vs 0.0).
template <typename T>
FUSEGEN_HD T maximum(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename T>
FUSEGEN_HD T minimum(T a, T b) {
  return (a != a || a < b) ? a : b;
}

// One step of a row sum (a SUM accumulator's combine, ir/rows.py). On the GPU it is
// __fadd_rn/__dadd_rn, which nvcc never contracts into a multiply-add with the product that
// made the term: whether it contracts depends on the code around it, and a row value must
// have the same bits in every kernel that computes it (the forward that saves it, the
// backward that computes it again). The CPU kernels are built without FMA (fusegen-cpu.h).
template <typename T>
FUSEGEN_HD T row_add(T a, T b) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == sizeof(float)) {
    return __fadd_rn(a, b);
  } else {
    return __dadd_rn(a, b);
  }
#else
  return a + b;
#endif
}

// torch.clamp with a number bound: std::max(x, lo) and std::min(x, hi). A NaN x stays
// NaN and a tie keeps x (clamp(-0.0, min=0) is -0.0), as torch's kernels compute it.
template <typename T>
FUSEGEN_HD T clamp_min(T x, T lo) {
  return x < lo ? lo : x;
}

template <typename T>
FUSEGEN_HD T clamp_max(T x, T hi) {
  return hi < x ? hi : x;
}

// torch.relu is clamp_min(x, 0): relu(NaN) is NaN, relu(-0.0) is -0.0.
template <typename T>
FUSEGEN_HD T relu(T x) {
  return clamp_min(x, T(0));
}

// torch.sign: -1, 0 or 1, and 0 for NaN.
template <typename T>
FUSEGEN_HD T sign(T x) {
  return static_cast<T>((T(0) < x) - (x < T(0)));
}

#ifndef FUSEGEN_CPU_LATER
// exp and true division as the GPU's approximate instructions compute them, for the fp16
// and bf16 kernels of a row op (its `approx::` functions, printer.py's approx mode). Those
// results round to 8 or 11 significant bits, and these differ from expf and IEEE division
// by a few float ulps, which the rounding hides: exp is ex2.approx of x * log2(e), a
// relative error of about 2^-22 near 0 that grows with |x| to 2^-16 at the ends of exp's
// range; division is div.full.f32, 2 ulps over the full range. They are torch.compile's
// spellings too (Triton's tl.exp and float32 `/`). expf and IEEE division take 8-10
// instructions each, and at 2 bytes an element a bf16 row kernel was bound by them. The
// host (tests/'s emulated kernels) computes them exactly, and so does a build with
// FUSEGEN_APPROX_MATH=0 (a macro, to measure).
#ifndef FUSEGEN_APPROX_MATH
#define FUSEGEN_APPROX_MATH 1
#endif
FUSEGEN_HD float approx_exp(float x) {
#if defined(__CUDA_ARCH__) && FUSEGEN_APPROX_MATH
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504f));
  return y;
#else
  return expf(x);
#endif
}

FUSEGEN_HD float approx_div(float a, float b) {
#if defined(__CUDA_ARCH__) && FUSEGEN_APPROX_MATH
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return a / b;
#endif
}

FUSEGEN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
FUSEGEN_HD double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// F.softplus(x) (beta 1, threshold 20), as torch's kernel computes it: x above the
// threshold, else log1p(exp(x)). Stable at both ends: exp never overflows (x <= 20), and
// log1p keeps the digits of a tiny exp(x) (large negative x gives exp(x), not 0).
FUSEGEN_HD float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
FUSEGEN_HD double softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }
#endif  // FUSEGEN_CPU_LATER

}  // namespace fusegen

#endif  // FUSEGEN_MATH_H_
