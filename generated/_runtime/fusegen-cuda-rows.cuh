// fusegen-cuda-rows.cuh: the CUDA kernel of a row op (an expression that reduces over the
// last dimension; fusegen-rows.h is its CPU loop and describes the functor). One row per
// warp for rows of up to kWarpRowLength elements, one row per block beyond (of 128 threads
// for short 16-bit rows, kRowHalfBlock; 256 otherwise): each pass over
// the row accumulates per thread, then combines across the warp by butterfly shuffles and
// across the block's warps through shared memory, in a fixed order, so every thread holds
// the same bits and every run gives them; then the outputs are written. Rows of unit
// stride, 16-byte aligned, whose length splits into 16-byte vectors (kVector), move 16
// bytes per access, and such a row that fits is held in registers (RowCache): loaded once,
// its loads all in flight together; a longer row is read again by each pass, from L1 or
// L2. A backward that sums a weight's or a bias's gradient over the rows (RowSum:
// fusegen-runtime.h) runs a grid of a few blocks per SM instead, striding over the rows: a
// thread's columns are the same on every row, so it sums them in its own slots of shared
// memory, and each block writes one partial row of each sum.
#ifndef FUSEGEN_CUDA_ROWS_CUH_
#define FUSEGEN_CUDA_ROWS_CUH_

#include "fusegen-cuda-common.cuh"

#ifndef __CUDACC_RTC__
#include <utility>
#endif

namespace fusegen {

// (kRowBlock threads per block, kWarpRowLength, row_block: fusegen-runtime.h, whose layout
// needs them.)

// A 16-bit row that a block holds in registers in at most FUSEGEN_ROW_HALF_FORWARD_VECTORS
// vectors of each input a thread in a forward (rows of up to 4096 elements at 4),
// FUSEGEN_ROW_HALF_VECTORS in a backward (2048 at 2), takes kRowHalfBlock threads, one row
// a block of that many, not kRowBlock: the row's registers are the same, the threads' own
// (addresses, accumulators) half as many, so an SM keeps more rows in flight. On an H100,
// fwd+bwd at 16384 x 2048 in bf16: softmax 0.172 -> 0.155 ms, LayerNorm 0.254 -> 0.238.
// At 4 vectors (rows of 4096) softmax's forward went from 143 to 122 us but its backward,
// 93 registers a thread, from 173 to 200: so a forward's bound and a backward's. 0: every
// row longer than a warp's takes kRowBlock threads. Macros, to measure.
#ifndef FUSEGEN_ROW_HALF_FORWARD_VECTORS
#define FUSEGEN_ROW_HALF_FORWARD_VECTORS 4
#endif
#ifndef FUSEGEN_ROW_HALF_VECTORS
#define FUSEGEN_ROW_HALF_VECTORS 2
#endif
constexpr int kRowHalfBlock = kRowBlock / 2;

// Long rows in few rows split over blocks (row_split_chunk). 0: one block takes each row
// whole. A macro, to measure.
#ifndef FUSEGEN_ROW_SPLIT
#define FUSEGEN_ROW_SPLIT 1
#endif

// One launch: per operand its data (none for a summed output), its byte stride along a row
// and from row to row, and the sums over the rows (fusegen-runtime.h, RowSum: each block
// writes its partial row of each). A sum picks its outputs by bits, since tests of k ==
// summed are folded into an indexed access that moves arrays to local memory.
template <int kN>
struct RowArgs {
  char* p[kN];
  int64_t along[kN];
  int64_t next[kN];
  int64_t length;
  int64_t rows;
  int num_sums;
  RowSum sums[kMaxRowSums];
};

// Whether a row cache (RowCache) holds input i: not a gather's index or a saved row value
// (which arrive in the compute type, one value per row), and, unless kEvery, one that a
// pass over the row reads (F::in_passes). The outputs read the others from memory once, so
// holding them through the passes would only take registers: LayerNorm's forward reads its
// weight and bias in its outputs alone (bf16 rows of 4096: 109 registers a thread holding
// all three inputs). A summing kernel (kEvery) holds every input, keeping a weight's vectors
// from row to row. FUSEGEN_ROW_HOLD_ALL=1 holds every input in every kernel (a macro, to
// measure).
#ifndef FUSEGEN_ROW_HOLD_ALL
#define FUSEGEN_ROW_HOLD_ALL 0
#endif
template <typename F, bool kEvery>
FUSEGEN_HD_CONSTEXPR bool row_holds(int i) {
  return !F::index(i) && (kEvery || FUSEGEN_ROW_HOLD_ALL || F::in_passes(i));
}

// The inputs read along the row (not a gather's index or a saved row value). Which rows are
// held (row_cache_vectors) counts them all, as a summing kernel holds them: the rule the
// launch shapes were measured on, also where a kernel holds fewer.
template <typename F>
FUSEGEN_HD_CONSTEXPR int row_cached_inputs() {
  int n = 0;
  for (int i = 0; i < F::kInputs; ++i) n += F::index(i) ? 0 : 1;
  return n;
}

// A pass over a row that is not held in registers unrolls its loop by this many accesses,
// so that their loads go in flight together (on an H100, fwd+bwd of the cross-entropy at
// 16384 x 32000 in bf16: 2.10 ms at 1, 1.70 at 4; LayerNorm at 16384 x 8192 in fp32: 1.62
// and 1.27). A macro, to measure.
#ifndef FUSEGEN_ROW_UNROLL
#define FUSEGEN_ROW_UNROLL 4
#endif
constexpr int kRowUnroll = FUSEGEN_ROW_UNROLL;

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

// A thread's share of a row held in registers (kIters > 0: fusegen-runtime.h,
// row_cache_vectors): v[t][i] is input i's 16-byte vector at element (t * kRowThreads +
// lane) * kVec, in the storage type (half the registers of the compute type for 16-bit
// rows), for the inputs it holds (row_holds<F, kEvery>). Inputs of stride 0 along the row
// are not held either: they are one value per row, read where used.
template <typename S, typename F, int kIters, bool kEvery = false>
struct RowCache {
  FUSEGEN_HD_CONSTEXPR static bool holds(int i) { return kIters > 0 && row_holds<F, kEvery>(i); }
  Vec<S, kVecWidth<S>> v[kIters > 0 ? kIters : 1][F::kInputs > 0 ? F::kInputs : 1];
};

// body(t, j) for each of a thread's accesses to a row, j its first element, in the order
// of j: with kIters > 0 (a row cache's vectors, or the summing kernel's columns) the loop
// is unrolled, so that t names registers or fixed slots; without, the elements from
// `begin` to `length` (a split row's chunk: rows_split_kernel).
template <int kRowThreads, int kVec, int kIters, typename Body>
__device__ __forceinline__ void row_each(int64_t length, int lane, Body&& body,
                                         int64_t begin = 0) {
  if constexpr (kIters > 0) {
#pragma unroll
    for (int t = 0; t < kIters; ++t) {
      const int64_t j = (int64_t(t) * kRowThreads + lane) * kVec;
      if (j < length) body(t, j);
    }
  } else {
#pragma unroll kRowUnroll
    for (int64_t j = begin + int64_t(lane) * kVec; j < length; j += int64_t(kRowThreads) * kVec)
      body(0, j);
  }
}

// The kVec elements from j of every input, in the compute type: x[e][i] is element j + e of
// input i (an input of stride 0 along the row is read once), from the row cache c[t] where
// it holds the input.
template <typename S, typename F, bool kVector, int kIters, bool kEvery, int kN>
__device__ __forceinline__ void row_inputs(const RowArgs<kN>& a, char* const* base, int64_t j,
                                           const RowCache<S, F, kIters, kEvery>& c, int t,
                                           acc_t<S> (*x)[F::kInputs > 0 ? F::kInputs : 1]) {
  constexpr int kVec = kRowVec<S, kVector>;
#pragma unroll
  for (int i = 0; i < F::kInputs; ++i) {
    const int k = F::kOutputs + i;
    if (kVec == 1 || F::index(i) || a.along[k] == 0) {
      const char* p = base[k] + j * a.along[k];
      const acc_t<S> value = F::index(i) ? *reinterpret_cast<const acc_t<S>*>(p)
                                         : to_acc(*reinterpret_cast<const S*>(p));
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e][i] = value;
    } else {
      const auto* p = reinterpret_cast<const Vec<S, kVec>*>(base[k] + j * sizeof(S));
      Vec<S, kVec> v;
      if constexpr (kIters > 0) {
        v = c.holds(i) ? c.v[t][i] : *p;
      } else {
        v = *p;
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e][i] = to_acc(v.v[e]);
    }
  }
}

// A row's vectors loaded into the row cache, every load issued before any pass waits on one
// (kRowsOnly: not those of an input of one value per column, already there).
template <typename S, typename F, int kRowThreads, bool kRowsOnly = false, int kIters, bool kEvery,
          int kN>
__device__ __forceinline__ void row_load(const RowArgs<kN>& a, char* const* base, int lane,
                                         RowCache<S, F, kIters, kEvery>& c) {
  if constexpr (kIters > 0) {
    row_each<kRowThreads, kVecWidth<S>, kIters>(a.length, lane, [&](int t, int64_t j) {
#pragma unroll
      for (int i = 0; i < F::kInputs; ++i) {
        const int k = F::kOutputs + i;
        if (F::index(i) || a.along[k] == 0 || (kRowsOnly && a.next[k] == 0)) continue;
        const char* p = base[k] + j * sizeof(S);
        if (c.holds(i)) {
          c.v[t][i] = *reinterpret_cast<const Vec<S, kVecWidth<S>>*>(p);
        } else if (a.next[k] != 0) {  // (the outputs alone read it: in L2 by then)
          prefetch_l2(p);
        }
      }
    });
  }
}

// The row's per-row inputs (F::index), which a finish may read: first[i] (0 for the others).
template <typename F, typename A>
__device__ __forceinline__ void row_firsts(char* const* base, A* first) {
#pragma unroll
  for (int i = 0; i < F::kInputs; ++i)
    first[i] = F::index(i) ? *reinterpret_cast<const A*>(base[F::kOutputs + i]) : A(0);
}

// Pass kP's values of the kVec elements from j of a row, combined into acc.
template <int kP, typename S, typename F, bool kVector, int kIters, bool kEvery, int kN>
__device__ __forceinline__ void row_accumulate(const F& f, const RowArgs<kN>& a, char* const* base,
                                               int64_t j, const RowCache<S, F, kIters, kEvery>& c,
                                               int t,
                                               const acc_t<S>* row, acc_t<S>* acc) {
  using A = acc_t<S>;
  constexpr int kVec = kRowVec<S, kVector>;
  A x[kVec][F::kInputs > 0 ? F::kInputs : 1];
  row_inputs<S, F, kVector>(a, base, j, c, t, x);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    A v[kRowSlots<F>];
    f.template pass<kP>(x[e], row, static_cast<A>(j + e), v);
    f.template combine<kP>(acc, v);
  }
}

template <int kP, typename S, typename F, int kRowThreads, bool kVector, int kIters, bool kEvery,
          int kN>
__device__ __forceinline__ void row_passes(const F& f, const RowArgs<kN>& a, char* const* base,
                                           int lane, const RowCache<S, F, kIters, kEvery>& c,
                                           const acc_t<S>* first, acc_t<S>* row,
                                           acc_t<S> (*shared)[kRowSlots<F>]) {
  if constexpr (kP < F::kPasses) {
    using A = acc_t<S>;
    constexpr int kVec = kRowVec<S, kVector>;
    A acc[kRowSlots<F>];
    f.template init<kP>(acc);
    row_each<kRowThreads, kVec, kIters>(a.length, lane, [&](int t, int64_t j) {
      row_accumulate<kP, S, F, kVector>(f, a, base, j, c, t, row, acc);
    });
    row_combine<kP, kRowThreads>(f, acc, shared);
    f.template finish<kP>(first, static_cast<A>(a.length), acc, row);
    row_passes<kP + 1, S, F, kRowThreads, kVector>(f, a, base, lane, c, first, row, shared);
  }
}

// The outputs of the kVec elements from j of a row: y[e][k] is output k of element j + e.
template <typename S, typename F, bool kVector, int kIters, bool kEvery, int kN>
__device__ __forceinline__ void row_outputs(const F& f, const RowArgs<kN>& a, char* const* base,
                                            int64_t j, const RowCache<S, F, kIters, kEvery>& c,
                                            int t,
                                            const acc_t<S>* row, acc_t<S> (*y)[F::kOutputs]) {
  constexpr int kVec = kRowVec<S, kVector>;
  acc_t<S> x[kVec][F::kInputs > 0 ? F::kInputs : 1];
  row_inputs<S, F, kVector>(a, base, j, c, t, x);
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
  if (F::raw(k)) {  // a row value saved for the backward: one per row, in the compute type
    *reinterpret_cast<acc_t<S>*>(base[k]) = y[0][k];
    return;
  }
  if (kVec == 1 || F::per_row(k)) {
    *reinterpret_cast<S*>(base[k] + j * a.along[k]) = from_acc<S>(y[0][k]);
  } else {
    Vec<S, kVec> v;
#pragma unroll
    for (int e = 0; e < kVec; ++e) v.v[e] = from_acc<S>(y[e][k]);
    *reinterpret_cast<Vec<S, kVec>*>(base[k] + j * sizeof(S)) = v;
  }
}

// The outputs of the kVec elements from j of a row, written into their rows.
template <typename S, typename F, bool kVector, int kIters, bool kEvery, int kN>
__device__ __forceinline__ void row_write(const F& f, const RowArgs<kN>& a, char* const* base,
                                          int64_t j, const RowCache<S, F, kIters, kEvery>& c, int t,
                                          const acc_t<S>* row) {
  acc_t<S> y[kRowVec<S, kVector>][F::kOutputs];
  row_outputs<S, F, kVector>(f, a, base, j, c, t, row, y);
#pragma unroll
  for (int k = 0; k < F::kOutputs; ++k) row_store<S, F, kVector>(a, base, j, k, y);
}

// Row r's operands: base[k] is operand k's row.
template <int kN>
__device__ __forceinline__ void row_bases(const RowArgs<kN>& a, int64_t r, char** base) {
#pragma unroll
  for (int k = 0; k < kN; ++k) base[k] = a.p[k] == nullptr ? nullptr : a.p[k] + r * a.next[k];
}

// Where a thread keeps its sum at element e of its access t to a row, in its group's sums
// (rows_kernel's kSums): consecutive lanes at consecutive addresses, free of bank conflicts.
template <int kRowThreads, int kVec>
__device__ __forceinline__ int row_sum_slot(int t, int lane, int e) {
  return (t * kVec + e) * kRowThreads + lane;
}

// A block's sums (RowArgs::sums), each into its partial row: in warp mode its warps' sums
// added in warp order, so the bits do not depend on timing. sum[g]: the sums of the rows
// group g took, sum s from s * kColumns / kMaxRowSums, each at its column's row_sum_slot.
template <typename S, int kRowThreads, int kVec, int kColumns, int kN>
__device__ __forceinline__ void row_partials(const RowArgs<kN>& a,
                                             const acc_t<S> (*sum)[kColumns]) {
  using A = acc_t<S>;
  constexpr int kBlock = row_block(kRowThreads);
  constexpr int kGroups = row_groups(kRowThreads);
  __syncthreads();
  for (int s = 0; s < a.num_sums; ++s) {
    A* partial = reinterpret_cast<A*>(a.sums[s].data + int64_t(blockIdx.x) * a.sums[s].next);
    const int from = s * (kColumns / kMaxRowSums);
    for (int c = threadIdx.x; c < a.length; c += kBlock) {
      const int slot = from + row_sum_slot<kRowThreads, kVec>(c / (kRowThreads * kVec),
                                                              c / kVec % kRowThreads, c % kVec);
      A v = sum[0][slot];
#pragma unroll
      for (int g = 1; g < kGroups; ++g) v = v + sum[g][slot];
      partial[c] = v;
    }
  }
}

// One row per warp or block (kRowThreads), or, when kSums, a grid of CudaLoop::sum_blocks
// blocks striding over the rows, each thread adding each sum's operands (RowArgs::sums) at
// its columns (at most row_sum_columns of them, shared by the sums: the rows' length fits,
// row_sums_fit) into shared memory, which row_partials writes at the end. kCache > 0: each
// row is loaded into registers once
// (RowCache), kCache vectors of each input a thread, as many as the row needs, since the
// registers held set how many rows an SM keeps in flight; a summing kernel keeps an input
// of one value per column (a weight) there from row to row.
template <typename S, typename F, int kRowThreads, bool kVector, bool kSums, int kCache>
__global__ void
__launch_bounds__(row_block(kRowThreads), kSums ? row_sum_blocks_per_sm(sizeof(S)) : 1)
    rows_kernel(const RowArgs<F::kInputs + F::kOutputs> a, const F f) {
  using A = acc_t<S>;
  constexpr int kN = F::kInputs + F::kOutputs;
  constexpr int kGroups = row_groups(kRowThreads);
  constexpr int kVec = kRowVec<S, kVector>;
  static_assert(kCache == 0 || kVector, "a row cache holds 16-byte vectors");
  __shared__ A shared[row_block(kRowThreads) / 32][kRowSlots<F>];
  const int lane = threadIdx.x % kRowThreads;
  const int64_t first = int64_t(blockIdx.x) * kGroups + threadIdx.x / kRowThreads;
  char* base[kN];
  A row[kRowSlots<F>];
  RowCache<S, F, kCache, kSums> c;
  if constexpr (!kSums) {
    if (first >= a.rows) return;  // whole warps (kRowThreads 32) or the whole block
    row_bases(a, first, base);
    row_load<S, F, kRowThreads>(a, base, lane, c);
    A first[F::kInputs > 0 ? F::kInputs : 1];
    row_firsts<F>(base, first);
    row_passes<0, S, F, kRowThreads, kVector>(f, a, base, lane, c, first, row, shared);
    const auto outputs = [&](int t, int64_t j) {
      row_write<S, F, kVector>(f, a, base, j, c, t, row);
    };
    if constexpr (all_per_row<F>()) {
      if (lane == 0) outputs(0, 0);  // (every thread holds the row's values)
    } else {
      row_each<kRowThreads, kVec, kCache>(a.length, lane, outputs);
    }
  } else {
    // A thread's columns: its cached vectors', or row_sum_columns (in shared memory: with its
    // 32 sums in registers the float32 kernel of 16-byte rows took 104-128 registers, here
    // 70-74; ptxas -v for sm_90, RMSNorm's backward). Sum s takes the slots from s *
    // kRegion (two sums: rows of at most half the columns, row_sums_fit).
    constexpr int kSumIters = kCache > 0 ? kCache : row_sum_columns(sizeof(A)) / kVec;
    constexpr int kColumns = kRowThreads * row_sum_columns(sizeof(A));
    constexpr int kRegion = kColumns / kMaxRowSums;
    static_assert(kSumIters * kVec <= row_sum_columns(sizeof(A)), "a thread's sums fit");
    __shared__ A sum[kGroups][kColumns];
    A(*mine)[kColumns] = sum + threadIdx.x / kRowThreads;
    row_each<kRowThreads, kVec, kSumIters>(a.length, lane, [&](int t, int64_t) {
      for (int s = 0; s < a.num_sums; ++s) {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          mine[0][s * kRegion + row_sum_slot<kRowThreads, kVec>(t, lane, e)] = A(0);
      }
    });
    for (int64_t r = first; r < a.rows; r += int64_t(gridDim.x) * kGroups) {
      row_bases(a, r, base);  // (a summed output's is null: row_store skips it)
      if (r == first) {
        row_load<S, F, kRowThreads>(a, base, lane, c);
      } else {  // (an input of one value per column, a weight, stays in the cache)
        row_load<S, F, kRowThreads, true>(a, base, lane, c);
      }
      A first[F::kInputs > 0 ? F::kInputs : 1];
      row_firsts<F>(base, first);
      row_passes<0, S, F, kRowThreads, kVector>(f, a, base, lane, c, first, row, shared);
      // (the thread's kSumIters accesses, unrolled: t names its sums' slots; each sum's
      // outputs by their bits, RowSum)
      row_each<kRowThreads, kVec, kSumIters>(a.length, lane, [&](int t, int64_t j) {
        A x[kVec][F::kInputs > 0 ? F::kInputs : 1];
        A y[kVec][F::kOutputs];
        row_inputs<S, F, kVector>(a, base, j, c, t, x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) f(x[e], row, static_cast<A>(j + e), y[e]);
#pragma unroll
        for (int k = 0; k < F::kOutputs; ++k) row_store<S, F, kVector>(a, base, j, k, y);
#pragma unroll
        for (int s = 0; s < kMaxRowSums; ++s) {
          if (s >= a.num_sums) break;
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            A v = A(0);
#pragma unroll
            for (int k = 0; k < F::kOutputs; ++k) {
              if (a.sums[s].outputs >> k & 1) v += y[e][k];
            }
            if (F::kInputs > 0 && a.sums[s].dout) v += x[e][0];
            mine[0][s * kRegion + row_sum_slot<kRowThreads, kVec>(t, lane, e)] += v;
          }
        }
      });
    }
    row_partials<S, kRowThreads, kVec, kColumns>(a, sum);
  }
}

// The row's values of passes kP .. kUntil - 1 from the partial accumulators of its chunks
// (part: chunks of kRowSlots<F> each), combined in chunk order.
template <int kP, int kUntil, typename F, typename A>
__device__ __forceinline__ void split_row_values(const F& f, const A* part, int chunks,
                                                 const A* first, A length, A* row) {
  if constexpr (kP < kUntil) {
    constexpr int kBegin = F::pass_begin(kP);
    constexpr int kEnd = F::pass_begin(kP + 1);
    A acc[kRowSlots<F>];
#pragma unroll
    for (int k = kBegin; k < kEnd; ++k) acc[k] = part[k];
    for (int c = 1; c < chunks; ++c) {
      A other[kRowSlots<F>];
#pragma unroll
      for (int k = kBegin; k < kEnd; ++k) other[k] = part[c * kRowSlots<F> + k];
      f.template combine<kP>(acc, other);
    }
    f.template finish<kP>(first, length, acc, row);
    split_row_values<kP + 1, kUntil>(f, part, chunks, first, length, row);
  }
}

// A long row split over blocks (row_split_chunk): block (c, r) takes elements [c * chunk,
// (c + 1) * chunk) of row r, one launch per pass. Launch kP < F::kPasses makes pass kP
// over its chunk and writes the block's accumulators into part (rows x chunks x
// kRowSlots<F>, their slots of pass kP); launch F::kPasses writes the chunk's outputs.
// Each first makes the row's values of the earlier passes from every chunk's accumulators,
// in chunk order: each block of a row holds the same bits, on every run.
template <typename S, typename F, bool kVector, int kP>
__global__ void __launch_bounds__(kRowBlock)
    rows_split_kernel(const RowArgs<F::kInputs + F::kOutputs> a, acc_t<S>* part, int chunks,
                      int64_t chunk, const F f) {
  using A = acc_t<S>;
  constexpr int kN = F::kInputs + F::kOutputs;
  constexpr int kVec = kRowVec<S, kVector>;
  const int64_t r = blockIdx.y;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < a.length ? begin + chunk : a.length;
  char* base[kN];
  row_bases(a, r, base);
  A first[F::kInputs > 0 ? F::kInputs : 1];
  row_firsts<F>(base, first);
  A row[kRowSlots<F>];
  A* mine = part + r * chunks * kRowSlots<F>;
  split_row_values<0, kP>(f, mine, chunks, first, static_cast<A>(a.length), row);
  RowCache<S, F, 0> none;  // (no row is held: read, never written)
  if constexpr (kP < F::kPasses) {
    __shared__ A shared[kRowBlock / 32][kRowSlots<F>];
    A acc[kRowSlots<F>];
    f.template init<kP>(acc);
    row_each<kRowBlock, kVec, 0>(end, threadIdx.x, [&](int, int64_t j) {
      row_accumulate<kP, S, F, kVector>(f, a, base, j, none, 0, row, acc);
    }, begin);
    row_combine<kP, kRowBlock>(f, acc, shared);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = F::pass_begin(kP); k < F::pass_begin(kP + 1); ++k)
        mine[int64_t(blockIdx.x) * kRowSlots<F> + k] = acc[k];
    }
  } else {
    const auto outputs = [&](int, int64_t j) {
      row_write<S, F, kVector>(f, a, base, j, none, 0, row);
    };
    if constexpr (all_per_row<F>()) {
      if (blockIdx.x == 0 && threadIdx.x == 0) outputs(0, 0);
    } else {
      row_each<kRowBlock, kVec, 0>(end, threadIdx.x, outputs, begin);
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename S, typename F, int kRowThreads, bool kVector, bool kSums, int kCache>
const KernelRef& rows_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::rows_kernel", TypeName<S>::get(), functor_name<F>(def),
                         kRowThreads, kVector, kSums, kCache);
    }
  };
  return kernel_ref<Name>(f);
}

template <typename S, typename F, bool kVector, int kP>
const KernelRef& rows_split_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::rows_split_kernel", TypeName<S>::get(), functor_name<F>(def),
                         kVector, kP);
    }
  };
  return kernel_ref<Name>(f);
}
#endif

#if FUSEGEN_HOST_CODE
// The launches of a split row (rows_split_kernel): one per pass, then the outputs'.
template <typename S, typename F, bool kVector, int... kP>
void launch_split(std::integer_sequence<int, kP...>, const RowArgs<F::kInputs + F::kOutputs>& a,
                  acc_t<S>* part, int chunks, int64_t chunk, cudaStream_t stream, const F& f) {
  const Grid grid{static_cast<unsigned>(chunks), static_cast<unsigned>(a.rows)};
  (launch(FUSEGEN_KERNEL(f, rows_split_kernel, S, F, kVector, kP), grid, kRowBlock, 0, stream, a,
          part, chunks, chunk, f),
   ...);
}

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
    for (int k = 0; k < kN; ++k) {
      a.p[k] = loop.data[k];
      a.along[k] = loop.strides[k];
      a.next[k] = loop.strides[loop.num_operands + k];
    }
    a.num_sums = loop.num_sums;  // (at most kMaxRowSums: the runtime's)
    for (int s = 0; s < kMaxRowSums; ++s) a.sums[s] = s < loop.num_sums ? loop.sums[s] : RowSum{};
    a.length = loop.sizes[0];
    a.rows = loop.sizes[1];
    // 16-byte accesses: every operand of unit stride along its rows (or one value per row),
    // its rows 16-byte aligned, and rows that split into vectors (the sums are not S).
    bool vector = a.length % kVecWidth<S> == 0;
    for (int k = 0; k < kN; ++k) {
      if (a.p[k] == nullptr || a.along[k] == 0) continue;
      vector = vector && a.along[k] == int64_t(sizeof(S)) &&
               reinterpret_cast<std::uintptr_t>(a.p[k]) % 16 == 0 && a.next[k] % 16 == 0;
    }
    const auto go = [&](auto threads, auto vectors, auto cached, auto sums) {
      constexpr int kRowThreads = decltype(threads)::value;
      constexpr bool kVector = decltype(vectors)::value;
      constexpr int kCache = decltype(cached)::value;
      constexpr bool kSum = decltype(sums)::value;
      // (a reference: the NVRTC route keys its kernels by the address of their names)
      const auto& kernel =
          FUSEGEN_KERNEL(f, rows_kernel, S, F, kRowThreads, kVector, kSum, kCache);
      constexpr int kBlock = row_block(kRowThreads);
      if constexpr (kSum) {
        launch(kernel, {static_cast<unsigned>(loop.sum_blocks)}, kBlock, 0, stream, a, f);
      } else {
        constexpr int64_t kPerBlock = row_groups(kRowThreads);
        const unsigned grid = static_cast<unsigned>((a.rows + kPerBlock - 1) / kPerBlock);
        launch(kernel, {grid}, kBlock, 0, stream, a, f);
      }
    };
    using Warp = std::integral_constant<int, 32>;
    using Block = std::integral_constant<int, kRowBlock>;
    using HalfBlock = std::integral_constant<int, kRowHalfBlock>;
    using On = std::true_type;
    using Off = std::false_type;
    using None = std::integral_constant<int, 0>;  // (no row cache)
    using Any = std::integral_constant<int, 8>;  // (held: as many vectors as row_cache_vectors)
    using HalfMost = std::integral_constant<int, kSums ? FUSEGEN_ROW_HALF_VECTORS
                                                        : FUSEGEN_ROW_HALF_FORWARD_VECTORS>;
    const bool warp = row_threads(a.length) == 32;
    // A row that fits the registers of a warp or a block (row_cache_vectors) is held there,
    // in 1, 2, 4 or 8 vectors of each input a thread; a longer one, or one of other strides,
    // is read again by each pass. A summing kernel holds at most row_sum_held_vectors; a
    // 16-bit row that kRowHalfBlock threads hold (HalfMost) takes that many.
    constexpr int kMost = row_cache_vectors(row_cached_inputs<F>());
    constexpr int kMostSummed =
        row_sum_held_vectors(sizeof(S), sizeof(acc_t<S>), row_cached_inputs<F>());
    const auto held = [&](auto threads, auto sums, auto most) {
      constexpr int64_t kPerVector = int64_t(decltype(threads)::value) * kVecWidth<S>;
      constexpr int kMostHere = decltype(most)::value;
      [[maybe_unused]] const int64_t needed = (a.length + kPerVector - 1) / kPerVector;
      bool done = false;
      const auto one = [&](auto size) {
        constexpr int kSize = decltype(size)::value;
        if constexpr (kSize <= kMost && kSize <= kMostHere) {
          if (!done && needed <= kSize) {
            go(threads, On{}, size, sums);
            done = true;
          }
        }
      };
      one(std::integral_constant<int, 1>{});
      one(std::integral_constant<int, 2>{});
      one(std::integral_constant<int, 4>{});
      one(std::integral_constant<int, 8>{});
      return done;
    };
    if constexpr (kSums) {
      // (where row_sums_fit: fusegen-layout.cpp)
      if (a.num_sums > 0) {
        using Sum = std::true_type;
        using SumMost = std::integral_constant<int, kMostSummed>;
        if constexpr (row_sums_in_warps(sizeof(S))) {
          if (warp) {
            if (vector && held(Warp{}, Sum{}, SumMost{})) return;
            vector ? go(Warp{}, On{}, None{}, Sum{}) : go(Warp{}, Off{}, None{}, Sum{});
            return;
          }
        }
        if (vector && held(Block{}, Sum{}, SumMost{})) return;
        vector ? go(Block{}, On{}, None{}, Sum{}) : go(Block{}, Off{}, None{}, Sum{});
        return;
      }
    }
#if FUSEGEN_ROW_SPLIT
    const int64_t chunk = loop.scratch == nullptr
                              ? 0
                              : row_split_chunk(a.length, a.rows, sm_count(), kVecWidth<S>);
    if (chunk > 0) {
      const int chunks = static_cast<int>((a.length + chunk - 1) / chunk);
      using A = acc_t<S>;
      const size_t bytes = sizeof(A) * size_t(a.rows) * size_t(chunks) * kRowSlots<F>;
      A* part = static_cast<A*>(loop.scratch(loop.scratch_owner, bytes));
      const auto passes = std::make_integer_sequence<int, F::kPasses + 1>{};
      vector ? launch_split<S, F, true>(passes, a, part, chunks, chunk, stream, f)
             : launch_split<S, F, false>(passes, a, part, chunks, chunk, stream, f);
      return;
    }
#endif
    if (vector && warp && held(Warp{}, Off{}, Any{})) return;
    if constexpr (sizeof(S) == 2) {
      if (vector && !warp && held(HalfBlock{}, Off{}, HalfMost{})) return;
    }
    if (vector && held(Block{}, Off{}, Any{})) return;
    if (warp) {  // (rows of other strides: a vector row of a warp's length is held)
      go(Warp{}, Off{}, None{}, Off{});
    } else {
      vector ? go(Block{}, On{}, None{}, Off{}) : go(Block{}, Off{}, None{}, Off{});
    }
  });
}
#endif  // FUSEGEN_HOST_CODE

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_ROWS_CUH_
