// fusegen-rows.h: the CPU loop of a row op (an expression that reduces over the last
// dimension): per row, one pass over its elements per level of reductions, then one that
// writes the outputs. The functor F (the op's Forward or Backward, <name>.h) holds the math:
//   F::kPasses passes; pass P's accumulators init<P>, pass<P> (what one element adds),
//   combine<P> and finish<P> (the row's values row[k] from the accumulators and the row's
//   per-row inputs);
//   operator()(x, row, col, y) the outputs of one element (col: its index along the row,
//   which a gather compares with its index); F::per_row(k): output k is one value per row
//   (written once, at the row's first element); F::raw(k): output k (one value per row) is
//   stored in the compute type, a row value the forward saves for its backward;
//   F::index(i): input i is one value per row in the compute type (a gather's index, or a
//   saved row value).
#ifndef FUSEGEN_ROWS_H_
#define FUSEGEN_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fusegen-cpu.h"
#include "fusegen-runtime.h"

namespace fusegen {

// A row is computed a block at a time: its inputs converted into buffers of the compute
// type, the math over the block in one loop without a branch (which GCC vectorizes, as the
// elementwise loop), and a pass's values summed into kCpuLanes partial accumulators, lane
// e % kCpuLanes for element e, combined in lane order at the end: a fixed order, so the
// same bits on every run, that the compiler can keep in vector registers.
constexpr int64_t kCpuRowBlock = 256;
constexpr int kCpuLanes = 8;

// Elements [j, j + m) of each input in the compute type: xp[i][0 .. m), the input itself
// where it is contiguous and of the compute type already, else its values converted into
// x[i].
template <typename S, typename F, typename A>
FUSEGEN_CPU_TARGETS void row_block_inputs(char* const* in, const int64_t* stride, int64_t j,
                                          int64_t m, A (*x)[kCpuRowBlock], const A** xp) {
  for (int i = 0; i < F::kInputs; ++i) {
    const char* base = in[i] + j * stride[i];
    xp[i] = x[i];
    if (stride[i] == 0) {  // (a gather's index always: one per row, converted to A)
      const A value = F::index(i) ? *reinterpret_cast<const A*>(base)
                                  : Host<S>::load(*reinterpret_cast<const S*>(base));
      for (int64_t e = 0; e < m; ++e) x[i][e] = value;
    } else if (stride[i] == static_cast<int64_t>(sizeof(S))) {
      const S* p = reinterpret_cast<const S*>(base);
      if constexpr (std::is_same_v<S, A>) {
        xp[i] = p;
      } else {
        for (int64_t e = 0; e < m; ++e) x[i][e] = Host<S>::load(p[e]);
      }
    } else {
      for (int64_t e = 0; e < m; ++e)
        x[i][e] = Host<S>::load(*reinterpret_cast<const S*>(base + e * stride[i]));
    }
  }
}

// The row's per-row inputs (F::index), which a finish may read: first[i] (0 for the others).
template <typename F, typename A>
FUSEGEN_CPU_TARGETS void row_firsts(char* const* in, A* first) {
  for (int i = 0; i < F::kInputs; ++i)
    first[i] = F::index(i) ? *reinterpret_cast<const A*>(in[i]) : A(0);
}

template <int kPass, typename S, typename F>
FUSEGEN_CPU_TARGETS void row_passes(const F& f, char* const* in, const int64_t* stride,
                                    int64_t length, const typename Host<S>::acc* first,
                                    typename Host<S>::acc* row) {
  if constexpr (kPass < F::kPasses) {
    using A = typename Host<S>::acc;
    constexpr int kBegin = F::pass_begin(kPass);
    constexpr int kEnd = F::pass_begin(kPass + 1);
    // lanes[k][l]: accumulator k's value in lane l, accumulator-major, so that adding a run
    // of kCpuLanes elements into the lanes is one vector operation per accumulator.
    A lanes[kRowSlots<F>][kCpuLanes];
    for (int l = 0; l < kCpuLanes; ++l) {
      A acc[kRowSlots<F>];
      f.template init<kPass>(acc);
      for (int k = kBegin; k < kEnd; ++k) lanes[k][l] = acc[k];
    }
    A x[F::kInputs > 0 ? F::kInputs : 1][kCpuRowBlock];
    A v[kRowSlots<F>][kCpuRowBlock];
    // element e of the block into lane e % kCpuLanes (kCpuRowBlock is a multiple of it)
    const auto into_lane = [&](int l, int64_t e) {
      A acc[kRowSlots<F>];
      A other[kRowSlots<F>];
      for (int k = kBegin; k < kEnd; ++k) {
        acc[k] = lanes[k][l];
        other[k] = v[k][e];
      }
      f.template combine<kPass>(acc, other);
      for (int k = kBegin; k < kEnd; ++k) lanes[k][l] = acc[k];
    };
    for (int64_t j = 0; j < length; j += kCpuRowBlock) {
      const int64_t m = length - j < kCpuRowBlock ? length - j : kCpuRowBlock;
      const A* xp[F::kInputs > 0 ? F::kInputs : 1];
      row_block_inputs<S, F>(in, stride, j, m, x, xp);
#pragma GCC ivdep
      for (int64_t e = 0; e < m; ++e) {
        A xe[F::kInputs > 0 ? F::kInputs : 1];
        A ve[kRowSlots<F>];
        for (int i = 0; i < F::kInputs; ++i) xe[i] = xp[i][e];
        f.template pass<kPass>(xe, row, static_cast<A>(j + e), ve);
        for (int k = kBegin; k < kEnd; ++k) v[k][e] = ve[k];
      }
      const int64_t whole = m - m % kCpuLanes;
      for (int64_t e = 0; e < whole; e += kCpuLanes) {
        for (int l = 0; l < kCpuLanes; ++l) into_lane(l, e + l);
      }
      for (int64_t e = whole; e < m; ++e) into_lane(static_cast<int>(e % kCpuLanes), e);
    }
    A total[kRowSlots<F>];
    for (int k = kBegin; k < kEnd; ++k) total[k] = lanes[k][0];
    for (int l = 1; l < kCpuLanes; ++l) {
      A other[kRowSlots<F>];
      for (int k = kBegin; k < kEnd; ++k) other[k] = lanes[k][l];
      f.template combine<kPass>(total, other);
    }
    f.template finish<kPass>(first, static_cast<A>(length), total, row);
    row_passes<kPass + 1, S>(f, in, stride, length, first, row);
  }
}

// The loop over loop.sizes[1] rows of loop.sizes[0] elements: operand k's element (j, r)
// at data[k] + j * strides[k] + r * strides[num_operands + k] (bytes); outputs first. Each
// sum over the rows (CudaLoop::sums: a summed output has no data) is added to its row of
// the compute type, row after row: a fixed order.
template <typename S, typename F>
FUSEGEN_CPU_TARGETS void rows_cpu(const CudaLoop& loop, const F& f) {
  using A = typename Host<S>::acc;
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kN = kIn + kOut;
  const int64_t length = loop.sizes[0];
  const int64_t rows = loop.sizes[1];
  const int64_t* col = loop.strides;
  const int64_t* step = loop.strides + loop.num_operands;
  A x[kIn > 0 ? kIn : 1][kCpuRowBlock];
  A y[kOut][kCpuRowBlock];
  for (int64_t r = 0; r < rows; ++r) {
    char* base[kN];
    for (int k = 0; k < kN; ++k)
      base[k] = loop.data[k] == nullptr ? nullptr : loop.data[k] + r * step[k];
    A first[kIn > 0 ? kIn : 1];
    row_firsts<F>(base + kOut, first);
    A row[kRowSlots<F>];
    row_passes<0, S>(f, base + kOut, col + kOut, length, first, row);
    // (outputs of one value per row each: element 0 alone, fusegen-runtime.h's all_per_row)
    const int64_t span = all_per_row<F>() ? std::min<int64_t>(length, 1) : length;
    for (int64_t j = 0; j < span; j += kCpuRowBlock) {
      const int64_t m = span - j < kCpuRowBlock ? span - j : kCpuRowBlock;
      const A* xp[kIn > 0 ? kIn : 1];
      row_block_inputs<S, F>(base + kOut, col + kOut, j, m, x, xp);
#pragma GCC ivdep
      for (int64_t e = 0; e < m; ++e) {
        A xe[kIn > 0 ? kIn : 1];
        A ye[kOut];
        for (int i = 0; i < kIn; ++i) xe[i] = xp[i][e];
        f(xe, row, static_cast<A>(j + e), ye);
        for (int k = 0; k < kOut; ++k) y[k][e] = ye[k];
      }
      for (int s = 0; s < loop.num_sums; ++s) {  // (the outputs it names, then dout)
        const RowSum& sum = loop.sums[s];
        A* into = reinterpret_cast<A*>(sum.data) + j;
        for (int k = 0; k <= kOut; ++k) {
          if (!(k < kOut ? sum.outputs >> k & 1 : kIn > 0 && sum.dout)) continue;
          const A* v = k < kOut ? y[k] : xp[0];
          for (int64_t e = 0; e < m; ++e) into[e] += v[e];
        }
      }
      for (int k = 0; k < kOut; ++k) {
        if (base[k] == nullptr || (F::per_row(k) && j > 0)) continue;
        const int64_t count = F::per_row(k) ? 1 : m;
        char* out = base[k] + j * col[k];
        if (F::raw(k)) {  // (one value per row, in the compute type)
          *reinterpret_cast<A*>(out) = y[k][0];
          continue;
        }
        if (col[k] == static_cast<int64_t>(sizeof(S))) {  // (a loop GCC vectorizes)
          S* o = reinterpret_cast<S*>(out);
          for (int64_t e = 0; e < count; ++e) o[e] = Host<S>::store(y[k][e]);
          continue;
        }
        for (int64_t e = 0; e < count; ++e)
          *reinterpret_cast<S*>(out + e * col[k]) = Host<S>::store(y[k][e]);
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
