// fusegen-cuda-rows.cuh: the CUDA kernel of a row op (an expression that reduces over the
// last dimension; fusegen-rows.h is its CPU loop and describes the functor). One row per
// warp for rows of up to kWarpRowLength elements, one row per block beyond: each pass over
// the row accumulates per thread, then combines across the warp by butterfly shuffles and
// across the block's warps through shared memory, in a fixed order, so every thread holds
// the same bits and every run gives them; then the outputs are written. Rows of unit
// stride, 16-byte aligned, whose length splits into 16-byte vectors (kVector), move 16
// bytes per access; later passes read the row again, from L1 or L2 (a row of 8192 bf16 is
// 16 KiB), so memory sees about one read of each input. A backward whose outputs include a
// weight's gradient (summed over the rows: fusegen-runtime.h) runs a grid of a few blocks
// per SM instead, striding over the rows: a thread's columns are the same on every row, so
// it sums them in registers, and each block writes one partial row.
#ifndef FUSEGEN_CUDA_ROWS_CUH_
#define FUSEGEN_CUDA_ROWS_CUH_

#include "fusegen-cuda-common.cuh"

namespace fusegen {

// (kRowBlock threads per block, kWarpRowLength: fusegen-runtime.h, whose layout needs them.)

// One launch: per operand its data, its byte stride along a row and from row to row, and
// the output summed over the rows (fusegen-runtime.h: its partial rows instead), or -1.
template <int kN>
struct RowArgs {
  char* p[kN];
  int64_t along[kN];
  int64_t next[kN];
  int64_t length;
  int64_t rows;
  int summed;
};

#if FUSEGEN_DEVICE_CODE
// Pass P's accumulators combined across the kRowThreads threads of a row.
template <int kP, int kRowThreads, typename F, typename A>
__device__ __forceinline__ void row_combine(const F& f, A* acc, A (*shared)[kRowSlots<F>]) {
  constexpr int kBegin = F::pass_begin(kP);
  constexpr int kEnd = F::pass_begin(kP + 1);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    A other[kRowSlots<F>];
#pragma unroll
    for (int k = kBegin; k < kEnd; ++k) other[k] = __shfl_xor_sync(0xffffffffu, acc[k], offset);
    f.template combine<kP>(acc, other);
  }
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int k = kBegin; k < kEnd; ++k) shared[warp][k] = acc[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = kBegin; k < kEnd; ++k) acc[k] = shared[0][k];
    for (int w = 1; w < kWarps; ++w) {
      A other[kRowSlots<F>];
#pragma unroll
      for (int k = kBegin; k < kEnd; ++k) other[k] = shared[w][k];
      f.template combine<kP>(acc, other);
    }
    __syncthreads();  // before the next pass writes shared again
  }
}

// Elements per access: a 16-byte vector, or one element.
template <typename S, bool kVector>
constexpr int kRowVec = kVector ? kVecWidth<S> : 1;

// The kVec elements from j of every input, in the compute type: x[e][i] is element j + e of
// input i (an input of stride 0 along the row is read once).
template <typename S, typename F, bool kVector, int kN>
__device__ __forceinline__ void row_inputs(const RowArgs<kN>& a, char* const* base, int64_t j,
                                           acc_t<S> (*x)[F::kInputs > 0 ? F::kInputs : 1]) {
  constexpr int kVec = kRowVec<S, kVector>;
#pragma unroll
  for (int i = 0; i < F::kInputs; ++i) {
    const int k = F::kOutputs + i;
    if (kVec == 1 || a.along[k] == 0) {  // (a gather's index always: one per row, in acc_t)
      const char* p = base[k] + j * a.along[k];
      const acc_t<S> value = F::index(i) ? *reinterpret_cast<const acc_t<S>*>(p)
                                         : to_acc(*reinterpret_cast<const S*>(p));
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e][i] = value;
    } else {
      const Vec<S, kVec> v = *reinterpret_cast<const Vec<S, kVec>*>(base[k] + j * sizeof(S));
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e][i] = to_acc(v.v[e]);
    }
  }
}

template <int kP, typename S, typename F, int kRowThreads, bool kVector, int kN>
__device__ __forceinline__ void row_passes(const F& f, const RowArgs<kN>& a, char* const* base,
                                           int lane, acc_t<S>* row,
                                           acc_t<S> (*shared)[kRowSlots<F>]) {
  if constexpr (kP < F::kPasses) {
    using A = acc_t<S>;
    constexpr int kVec = kRowVec<S, kVector>;
    A acc[kRowSlots<F>];
    f.template init<kP>(acc);
    for (int64_t j = int64_t(lane) * kVec; j < a.length; j += int64_t(kRowThreads) * kVec) {
      A x[kVec][F::kInputs > 0 ? F::kInputs : 1];
      row_inputs<S, F, kVector>(a, base, j, x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        A v[kRowSlots<F>];
        f.template pass<kP>(x[e], row, static_cast<A>(j + e), v);
        f.template combine<kP>(acc, v);
      }
    }
    row_combine<kP, kRowThreads>(f, acc, shared);
    f.template finish<kP>(static_cast<A>(a.length), acc, row);
    row_passes<kP + 1, S, F, kRowThreads, kVector>(f, a, base, lane, row, shared);
  }
}

// The outputs of the kVec elements from j of a row: y[e][k] is output k of element j + e.
template <typename S, typename F, bool kVector, int kN>
__device__ __forceinline__ void row_outputs(const F& f, const RowArgs<kN>& a, char* const* base,
                                            int64_t j, const acc_t<S>* row,
                                            acc_t<S> (*y)[F::kOutputs]) {
  constexpr int kVec = kRowVec<S, kVector>;
  acc_t<S> x[kVec][F::kInputs > 0 ? F::kInputs : 1];
  row_inputs<S, F, kVector>(a, base, j, x);
#pragma unroll
  for (int e = 0; e < kVec; ++e) f(x[e], row, static_cast<acc_t<S>>(j + e), y[e]);
}

// Output k of those elements written into its row (once, at j == 0, when it is one value per
// row).
template <typename S, typename F, bool kVector, int kN>
__device__ __forceinline__ void row_store(const RowArgs<kN>& a, char* const* base, int64_t j,
                                          int k, const acc_t<S> (*y)[F::kOutputs]) {
  constexpr int kVec = kRowVec<S, kVector>;
  if (base[k] == nullptr || (F::per_row(k) && j > 0)) return;
  if (kVec == 1 || F::per_row(k)) {
    *reinterpret_cast<S*>(base[k] + j * a.along[k]) = from_acc<S>(y[0][k]);
  } else {
    Vec<S, kVec> v;
#pragma unroll
    for (int e = 0; e < kVec; ++e) v.v[e] = from_acc<S>(y[e][k]);
    *reinterpret_cast<Vec<S, kVec>*>(base[k] + j * sizeof(S)) = v;
  }
}

// Row r's operands: base[k] is operand k's row.
template <int kN>
__device__ __forceinline__ void row_bases(const RowArgs<kN>& a, int64_t r, char** base) {
#pragma unroll
  for (int k = 0; k < kN; ++k) base[k] = a.p[k] == nullptr ? nullptr : a.p[k] + r * a.next[k];
}

// A block's sums of the summed output (RowArgs::summed), into its partial row: in warp mode
// its warps' sums added in warp order through shared memory, so the bits do not depend on
// timing. sum[t][e]: the sum at column (t * kRowThreads + lane) * kVec + e.
template <typename S, int kRowThreads, bool kVector, int kIters, int kN>
__device__ __forceinline__ void row_partials(const RowArgs<kN>& a, int lane,
                                             const acc_t<S> (*sum)[kRowVec<S, kVector>]) {
  using A = acc_t<S>;
  constexpr int kVec = kRowVec<S, kVector>;
  constexpr int kGroups = kRowBlock / kRowThreads;  // rows the block takes at once
  char* partial = a.p[a.summed] + int64_t(blockIdx.x) * a.next[a.summed];
  const int64_t along = a.along[a.summed];
  if constexpr (kGroups == 1) {
#pragma unroll
    for (int t = 0; t < kIters; ++t) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int64_t c = (int64_t(t) * kRowThreads + lane) * kVec + e;
        if (c < a.length) *reinterpret_cast<A*>(partial + c * along) = sum[t][e];
      }
    }
  } else {
    __shared__ A column[kWarpRowLength];
    const int group = threadIdx.x / kRowThreads;
    for (int g = 0; g < kGroups; ++g) {
      if (group == g) {
#pragma unroll
        for (int t = 0; t < kIters; ++t) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const int c = (t * kRowThreads + lane) * kVec + e;
            if (c >= a.length) continue;
            const A v = g == 0 ? sum[t][e] : column[c] + sum[t][e];
            if (g + 1 < kGroups) {
              column[c] = v;
            } else {
              *reinterpret_cast<A*>(partial + c * along) = v;
            }
          }
        }
      }
      __syncthreads();
    }
  }
}

// One row per warp or block (kRowThreads), or, when kSums, a grid of CudaLoop::sum_blocks
// blocks striding over the rows, each thread summing the summed output at its columns (at
// most row_sum_columns of them: the rows' length fits, row_sums_fit) in registers, which
// row_partials writes at the end.
template <typename S, typename F, int kRowThreads, bool kVector, bool kSums>
__global__ void __launch_bounds__(kRowBlock, kSums ? kRowSumBlocksPerSm : 1)
    rows_kernel(const RowArgs<F::kInputs + F::kOutputs> a, const F f) {
  using A = acc_t<S>;
  constexpr int kN = F::kInputs + F::kOutputs;
  constexpr int kGroups = kRowBlock / kRowThreads;
  constexpr int kVec = kRowVec<S, kVector>;
  __shared__ A shared[kRowBlock / 32][kRowSlots<F>];
  const int lane = threadIdx.x % kRowThreads;
  const int64_t first = int64_t(blockIdx.x) * kGroups + threadIdx.x / kRowThreads;
  char* base[kN];
  A row[kRowSlots<F>];
  if constexpr (!kSums) {
    if (first >= a.rows) return;  // whole warps (kRowThreads 32) or the whole block
    row_bases(a, first, base);
    row_passes<0, S, F, kRowThreads, kVector>(f, a, base, lane, row, shared);
    for (int64_t j = int64_t(lane) * kVec; j < a.length; j += int64_t(kRowThreads) * kVec) {
      A y[kVec][F::kOutputs];
      row_outputs<S, F, kVector>(f, a, base, j, row, y);
#pragma unroll
      for (int k = 0; k < F::kOutputs; ++k) row_store<S, F, kVector>(a, base, j, k, y);
    }
  } else {
    constexpr int kIters = row_sum_columns(sizeof(A)) / kVec;
    A sum[kIters][kVec] = {};
    for (int64_t r = first; r < a.rows; r += int64_t(gridDim.x) * kGroups) {
      row_bases(a, r, base);
      row_passes<0, S, F, kRowThreads, kVector>(f, a, base, lane, row, shared);
#pragma unroll
      for (int t = 0; t < kIters; ++t) {
        const int64_t j = (int64_t(t) * kRowThreads + lane) * kVec;
        if (j >= a.length) continue;
        A y[kVec][F::kOutputs];
        row_outputs<S, F, kVector>(f, a, base, j, row, y);
#pragma unroll
        for (int k = 0; k < F::kOutputs; ++k) {
          if (k != a.summed) {
            row_store<S, F, kVector>(a, base, j, k, y);
            continue;
          }
#pragma unroll
          for (int e = 0; e < kVec; ++e) sum[t][e] += y[e][k];
        }
      }
    }
    row_partials<S, kRowThreads, kVector, kIters>(a, lane, sum);
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename S, typename F, int kRowThreads, bool kVector, bool kSums>
const KernelRef& rows_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::rows_kernel", TypeName<S>::get(), functor_name<F>(def),
                         kRowThreads, kVector, kSums);
    }
  };
  return kernel_ref<Name>(f);
}
#endif

#if FUSEGEN_HOST_CODE
// The launcher of a row op's kernel for kGroup's dtypes (op_kernels.cu.j2): F built by
// make(zero of the compute type), run in the storage type of `dtype` over the runtime's
// two-dimensional loop (fusegen-runtime.h, RowCpuKernel). kSums: a backward's, whose loop
// may sum an output over the rows (the kernels that do are compiled for it alone).
template <DtypeGroup kGroup, bool kSums = false, typename Make>
void run_rows_cuda(Dtype dtype, const CudaLoop& loop, cudaStream_t stream, Make&& make) {
  dispatch_dtype<kGroup>(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const auto f = make(acc_t<S>{});
    using F = std::remove_const_t<decltype(f)>;
    constexpr int kN = F::kInputs + F::kOutputs;
    RowArgs<kN> a;
    a.summed = -1;
    for (int k = 0; k < kN; ++k) {
      a.p[k] = loop.data[k];
      a.along[k] = loop.strides[k];
      a.next[k] = loop.strides[loop.num_operands + k];
      if (loop.summed != nullptr && loop.summed[k]) a.summed = k;  // (one: the runtime's)
    }
    a.length = loop.sizes[0];
    a.rows = loop.sizes[1];
    // 16-byte accesses: every operand of unit stride along its rows (or one value per row),
    // its rows 16-byte aligned, and rows that split into vectors (the sums are not S).
    bool vector = a.length % kVecWidth<S> == 0;
    for (int k = 0; k < kN; ++k) {
      if (a.p[k] == nullptr || a.along[k] == 0 || k == a.summed) continue;
      vector = vector && a.along[k] == int64_t(sizeof(S)) &&
               reinterpret_cast<std::uintptr_t>(a.p[k]) % 16 == 0 && a.next[k] % 16 == 0;
    }
    const auto go = [&](auto threads, auto vectors) {
      constexpr int kRowThreads = decltype(threads)::value;
      constexpr bool kVector = decltype(vectors)::value;
      // (the runtime sums float32 and float64 rows only, where row_sums_fit: run_rows; no
      // 16-bit summing kernel is built)
      if constexpr (kSums && sizeof(S) >= 4) {
        if (a.summed >= 0) {
          launch(FUSEGEN_KERNEL(f, rows_kernel, S, F, kRowThreads, kVector, true),
                 {static_cast<unsigned>(loop.sum_blocks)}, kRowBlock, 0, stream, a, f);
          return;
        }
      }
      constexpr int64_t kPerBlock = kRowBlock / kRowThreads;
      const unsigned grid = static_cast<unsigned>((a.rows + kPerBlock - 1) / kPerBlock);
      launch(FUSEGEN_KERNEL(f, rows_kernel, S, F, kRowThreads, kVector, false), {grid},
             kRowBlock, 0, stream, a, f);
    };
    using Warp = std::integral_constant<int, 32>;
    using Block = std::integral_constant<int, kRowBlock>;
    using On = std::true_type;
    using Off = std::false_type;
    if (row_threads(a.length) == 32) {
      vector ? go(Warp{}, On{}) : go(Warp{}, Off{});
    } else {
      vector ? go(Block{}, On{}) : go(Block{}, Off{});
    }
  });
}
#endif  // FUSEGEN_HOST_CODE

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_ROWS_CUH_
