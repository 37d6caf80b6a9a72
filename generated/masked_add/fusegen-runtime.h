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

#include "fusegen-math.h"

#ifdef FUSEGEN_WITH_CUDA
// The CUDA runtime's own spelling of a stream handle, so this header needs no CUDA header.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
#endif

namespace fusegen {

// CPU kernels: elements [begin, end) of flat, contiguous arrays of the op's dtype.
// in: the forward's tensors (forward), or dout then the tensors the backward reads
// (backward); scalars: the forward's scalars, or those the backward reads; grads: one per
// kernel gradient, nullptr when not requested.
using ForwardCpu = void (*)(Dtype dtype, int64_t begin, int64_t end, const void* const* in,
                            void* out, const double* scalars);
using BackwardCpu = void (*)(Dtype dtype, int64_t begin, int64_t end, const void* const* in,
                             void* const* grads, const double* scalars);
// CUDA launchers, the same arrays over all n elements, on `stream` (a cudaStream_t).
using ForwardCuda = void (*)(Dtype dtype, int64_t n, const void* const* in, void* out,
                             const double* scalars, void* stream);
using BackwardCuda = void (*)(Dtype dtype, int64_t n, const void* const* in, void* const* grads,
                              const double* scalars, void* stream);

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
  int num_backward_inputs;          // the tensors the backward reads, in input order
  const int* backward_inputs;       // ... as indices into the inputs
  int num_backward_scalars;
  const int* backward_scalars;      // indices into the scalars
  int num_kernel_grads;             // gradients the backward kernel computes
  const int* kernel_grads;          // ... as indices into the inputs
  const bool* passthrough;          // per input: its gradient is dout itself (no kernel)
  ForwardCpu forward_cpu;
  BackwardCpu backward_cpu;         // nullptr without kernel gradients
  ForwardCuda forward_cuda;         // nullptr in a build without CUDA
  BackwardCuda backward_cuda;
};

constexpr int kAbi = 1;

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
  return bits_float(sign | (two_w < (UINT32_C(1) << 27) ? float_bits(denormalized) : float_bits(normalized)));
}

// c10::detail::fp16_ieee_from_fp32_value (portable path).
inline Half to_half(float f) {
  float base = (std::fabs(f) * bits_float(UINT32_C(239) << 23)) * bits_float(UINT32_C(17) << 23);
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = bits_float((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & UINT32_C(0x00007C00)) + (bits & UINT32_C(0x00000FFF));
  return Half{static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign))};
}

inline float to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.x) << 16); }

// c10::detail::round_to_nearest_even.
inline BFloat16 to_bfloat16(float f) {
  if (std::isnan(f)) return BFloat16{UINT16_C(0x7FC0)};
  const uint32_t u = float_bits(f);
  return BFloat16{static_cast<uint16_t>((u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16)};
}

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

}  // namespace fusegen

#endif  // FUSEGEN_RUNTIME_H_
