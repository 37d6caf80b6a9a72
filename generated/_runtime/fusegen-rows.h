// fusegen-rows.h: the CPU loop of a row op (an expression that reduces over the last
// dimension): per row, one pass over its elements per level of reductions, then one that
// writes the outputs. The functor F (the op's Forward or Backward, <name>.h) holds the math:
//   F::kPasses passes; pass P's accumulators init<P>, pass<P> (what one element adds),
//   combine<P> and finish<P> (the row's values row[k] from the accumulators);
//   operator()(x, row, y) the outputs of one element; F::per_row(k): output k is one value
//   per row (written once, at the row's first element).
#ifndef FUSEGEN_ROWS_H_
#define FUSEGEN_ROWS_H_

#include <cstdint>

#include "fusegen-cpu.h"
#include "fusegen-runtime.h"

namespace fusegen {

// The storage element of operand k at (row base, element j), in the compute type.
template <typename S>
inline typename Host<S>::acc row_load(const char* base, int64_t stride, int64_t j) {
  return Host<S>::load(*reinterpret_cast<const S*>(base + j * stride));
}

template <int kPass, typename S, typename F>
void row_passes(const F& f, char* const* in, const int64_t* stride, int64_t length,
                typename Host<S>::acc* row) {
  if constexpr (kPass < F::kPasses) {
    using A = typename Host<S>::acc;
    A acc[kRowSlots<F>];
    A v[kRowSlots<F>];
    f.template init<kPass>(acc);
    for (int64_t j = 0; j < length; ++j) {  // in order: the same sum on every run
      A x[F::kInputs > 0 ? F::kInputs : 1];
      for (int i = 0; i < F::kInputs; ++i) x[i] = row_load<S>(in[i], stride[i], j);
      f.template pass<kPass>(x, row, v);
      f.template combine<kPass>(acc, v);
    }
    f.template finish<kPass>(static_cast<A>(length), acc, row);
    row_passes<kPass + 1, S>(f, in, stride, length, row);
  }
}

// The loop over loop.sizes[1] rows of loop.sizes[0] elements: operand k's element (j, r)
// at data[k] + j * strides[k] + r * strides[num_operands + k] (bytes); outputs first.
template <typename S, typename F>
void rows_cpu(const CudaLoop& loop, const F& f) {
  using A = typename Host<S>::acc;
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kN = kIn + kOut;
  const int64_t length = loop.sizes[0];
  const int64_t rows = loop.sizes[1];
  const int64_t* col = loop.strides;
  const int64_t* step = loop.strides + loop.num_operands;
  for (int64_t r = 0; r < rows; ++r) {
    char* base[kN];
    for (int k = 0; k < kN; ++k)
      base[k] = loop.data[k] == nullptr ? nullptr : loop.data[k] + r * step[k];
    A row[kRowSlots<F>];
    row_passes<0, S>(f, base + kOut, col + kOut, length, row);
    for (int64_t j = 0; j < length; ++j) {
      A x[kIn > 0 ? kIn : 1];
      A y[kOut];
      for (int i = 0; i < kIn; ++i) x[i] = row_load<S>(base[kOut + i], col[kOut + i], j);
      f(x, row, y);
      for (int k = 0; k < kOut; ++k) {
        if (base[k] == nullptr || (F::per_row(k) && j > 0)) continue;
        *reinterpret_cast<S*>(base[k] + j * col[k]) = Host<S>::store(y[k]);
      }
    }
  }
}

// An op's row kernel on the CPU: F built by make(zero of the compute type).
template <typename Make>
void run_rows_cpu(Dtype dtype, const CudaLoop& loop, Make&& make) {
  host_dispatch(dtype, [&](auto storage) {
    using S = decltype(storage);
    rows_cpu<S>(loop, make(typename Host<S>::acc{}));
  });
}

}  // namespace fusegen

#endif  // FUSEGEN_ROWS_H_
