// fusegen-math.h: math helpers shared by every generated op, on the host and the device.
// Hand-written, not templated; copied next to the generated sources so they build alone.
// No torch headers here: the CUDA kernels include this and compile with nvcc in seconds.
// Include guard, not #pragma once: a bundle of ops includes several identical copies.
#ifndef FUSEGEN_H_
#define FUSEGEN_H_

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define FUSEGEN_HD __host__ __device__ __forceinline__
#else
#define FUSEGEN_HD inline
#endif

namespace fusegen {

// Storage dtypes the kernels are instantiated for. The host side maps at::ScalarType to
// this, so the .cu files never see a torch header.
enum class Dtype : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// torch.maximum/minimum propagate NaN; C's fmaxf/fminf return the other operand instead.
template <typename T>
FUSEGEN_HD T maximum(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename T>
FUSEGEN_HD T minimum(T a, T b) {
  return (a != a || a < b) ? a : b;
}

// d/da maximum(a, b) = heaviside(a - b): torch gives each side half the gradient on a tie,
// and all of it to both when the comparison is NaN.
template <typename T>
FUSEGEN_HD T heaviside(T x) {
  return x == T(0) ? T(0.5) : (x < T(0) ? T(0) : T(1));
}

// torch.sign: -1, 0 or 1, and 0 for NaN.
template <typename T>
FUSEGEN_HD T sign(T x) {
  return static_cast<T>((T(0) < x) - (x < T(0)));
}

FUSEGEN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
FUSEGEN_HD double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

}  // namespace fusegen

#endif  // FUSEGEN_H_
