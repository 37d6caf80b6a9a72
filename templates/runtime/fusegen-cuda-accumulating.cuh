// fusegen-cuda-accumulating.cuh: the backward kernel that sums the gradients of
// broadcast inputs itself.
#ifndef FUSEGEN_CUDA_ACCUMULATING_CUH_
#define FUSEGEN_CUDA_ACCUMULATING_CUH_

#include "fusegen-cuda-common.cuh"
#include "fusegen-cuda-vector.cuh"

namespace fusegen {

// A backward that sums gradients of broadcast inputs (a bias, a per-channel scale) in the
// kernel itself, as torch.compile's fused reductions do, instead of writing them at the
// broadcast shape for ATen to sum (a write and a read of the whole tensor each): after
// F's outputs and inputs come kOut + 1 accumulators (Accumulating), float sums at
// the input's shape, which TensorIterator lays out as inputs (step 0 along the summed
// dimensions); accumulator k < kOut sums F's output k (then a null output), accumulator
// kOut sums input 0 (dout: a bias's gradient, which needs no kernel of its own).
template <typename F>
struct Accumulating {
  static constexpr int kAccumulators = F::kOutputs + 1;
  static constexpr int kOperands = F::kInputs + F::kOutputs + kAccumulators;
  static constexpr int kFirst = F::kInputs + F::kOutputs;  // accumulator a is operand kFirst + a
};

// The sums of one accumulator in one thread's slot: the byte offset they belong at (-1:
// none yet) and kVec partial sums (element e at offset + e * step; a step of 0 puts all
// of them in sum[0]). A thread adds to them while the offset stays, and flushes them when
// it changes: lanes of a warp that flush together and share an offset with their
// neighbours (every lane, for a per-channel sum of an NCHW tensor) sum their values by a
// segmented scan over shuffles, and the first lane of each run of equal offsets adds the
// run's sum to global memory with one atomicAdd.
template <int kVec>
struct Partial {
  int32_t offset = -1;
  float sum[kVec] = {};
};

// Collective over the warp (every lane calls it with the same trip counts); `flush` says
// whether this lane's sums go out now.
#if FUSEGEN_DEVICE_CODE
template <int kVec>
__device__ __forceinline__ void flush_partial(bool flush, Partial<kVec>& part, char* base,
                                              int32_t step) {
  constexpr unsigned kAll = 0xffffffffu;
  if (__ballot_sync(kAll, flush) == 0) return;
  const int lane = threadIdx.x % 32;
  const int32_t key = flush ? part.offset : -1 - lane;  // lanes not flushing: runs of their own
  const int32_t next = __shfl_down_sync(kAll, key, 1);
  const int32_t prev = __shfl_up_sync(kAll, key, 1);
  const unsigned ends = __ballot_sync(kAll, lane == 31 || next != key);
  const int end = lane + __ffs(ends >> lane) - 1;  // the last lane of this lane's run
  const bool head = flush && (lane == 0 || prev != key);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (step == 0 && e > 0) break;
    float v = part.sum[e];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float other = __shfl_down_sync(kAll, v, d);
      if (lane + d <= end) v += other;
    }
    if (head) atomicAdd(reinterpret_cast<float*>(base + part.offset + e * step), v);
  }
  if (flush) {
    part.offset = -1;
#pragma unroll
    for (int e = 0; e < kVec; ++e) part.sum[e] = 0.f;
  }
}
#endif  // FUSEGEN_DEVICE_CODE

// The loop as rows of `row` vectors (the loop's dimension 0 when an accumulator varies
// along it: a lane then keeps one column, so a channels_last per-channel sum keeps its
// offset for the whole kernel; else chunks of kThreads * kAccumulatingUnroll vectors: a lane's
// offset changes only where the summed tensor's does, every H*W elements of NCHW). A
// block step covers `width` vectors of `rows_per_step` rows (whole rows when they are
// short); blockIdx.x picks the columns, blockIdx.y a range of `rows_per_block` rows.
// Accumulator a in `by_column` (bit a) has one offset per column (a channels_last
// per-channel sum): a block adds its threads' sums in shared memory first, one float per
// element of its columns, and then adds those to global memory, so that each element takes
// one atomicAdd per block. With every lane flushing its own 4 elements, the ~1000 atomics
// per element from the whole grid (a wave of blocks) serialized on the same addresses:
// a channels_last backward took 2.5x the NCHW one on the H200.
struct RowLoop {
  uint32_t n_vec, row, width, rows_per_step, rows, rows_per_block;
  uint32_t by_column;
};

// One vector per thread and step, and registers for 4 blocks of 256 threads per SM (62-64,
// no spills). On the H200 (tests/gpu/h200_run.sh vector, n = 2^26, the backward kernel
// alone) against two vectors and 3 blocks (80 registers, 72-104 bytes spilled): 265 -> 227
// us fp32 and 306 -> 234 us bf16 (NCHW per-channel), 376 -> 305 and 423 -> 325 us
// (channels_last); 5 blocks (48 registers, spills) lost in fp32 (285, 388 us). Two
// vectors and 4 blocks spill 192-356 bytes. FUSEGEN_ACCUMULATING_BLOCKS=1 gives nvcc's
// choice of registers (tests/gpu/h200_run.sh accumulating).
#ifndef FUSEGEN_ACCUMULATING_BLOCKS
#define FUSEGEN_ACCUMULATING_BLOCKS 4
#endif
// FUSEGEN_ACCUMULATING_UNROLL: vectors per thread and step (tests/gpu/h200_run.sh vector).
#ifndef FUSEGEN_ACCUMULATING_UNROLL
#define FUSEGEN_ACCUMULATING_UNROLL 1
#endif
constexpr int kAccumulatingUnroll = FUSEGEN_ACCUMULATING_UNROLL;
#if FUSEGEN_DEVICE_CODE
template <typename T, int kVec, typename F>
__global__ void __launch_bounds__(kThreads, FUSEGEN_ACCUMULATING_BLOCKS)
    accumulating_kernel(Pointers<Accumulating<F>::kOperands> p,
                        OffsetCalculator<Accumulating<F>::kOperands, uint32_t> calc, RowLoop rows,
                        Modes<Accumulating<F>::kOperands> modes, F f) {
  using A = Accumulating<F>;
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kAcc = A::kAccumulators;
  constexpr int kWarpSlots = 32 * kAccumulatingUnroll;
  // Slot u of a thread: a warp's 32 * kAccumulatingUnroll slots are consecutive (lanes
  // along the row, every access coalesced), so a warp's lanes share a per-channel offset
  // far more often.
  const uint32_t warp_first = threadIdx.x / 32 * kWarpSlots + threadIdx.x % 32;
  uint32_t row_of[kAccumulatingUnroll], col_of[kAccumulatingUnroll];
#pragma unroll
  for (int u = 0; u < kAccumulatingUnroll; ++u) {
    const uint32_t slot = warp_first + u * 32;
    row_of[u] = slot / rows.width;
    col_of[u] = blockIdx.x * rows.width + slot % rows.width;
  }
  Partial<kVec> part_of[kAcc][kAccumulatingUnroll];
  extern __shared__ float column_sums[];  // per by_column accumulator, width * kVec floats
  const uint32_t span = rows.width * kVec;
  const auto sums_of = [&](int a) {
    return column_sums + __popc(rows.by_column & ((1u << a) - 1)) * span;
  };
  if (rows.by_column != 0) {
    const uint32_t floats = __popc(rows.by_column) * span;
    for (uint32_t i = threadIdx.x; i < floats; i += kThreads) column_sums[i] = 0.f;
    __syncthreads();  // the same branch in every thread of the block
  }
  const uint32_t first_row = blockIdx.y * rows.rows_per_block;
  const uint32_t end_row = min(first_row + rows.rows_per_block, rows.rows);
  for (uint32_t r = first_row; r < end_row;
       r += rows.rows_per_step) {  // the same trip count in every lane
    Vec<T, kVec> x_v[kAccumulatingUnroll][kIn];
    int32_t offset[kAccumulatingUnroll][A::kOperands];
    uint32_t vec[kAccumulatingUnroll];  // the vector's place in the loop's linear order
    bool valid[kAccumulatingUnroll];
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      const uint32_t row = r + row_of[u];
      const uint32_t v = row * rows.row + col_of[u];
      vec[u] = v;
      valid[u] =
          row_of[u] < rows.rows_per_step && row < end_row && col_of[u] < rows.row && v < rows.n_vec;
      if (!valid[u]) continue;
      calc.template offsets<true>(v, offset[u]);
#pragma unroll
      for (int j = 0; j < kIn; ++j)
        load_operand<true>(modes, kOut + j, p.p[kOut + j] + offset[u][kOut + j], x_v[u][j]);
    }
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      float add[kAcc][kVec];  // what each accumulator sums: F's outputs unrounded, and dout
      if (valid[u]) {
        Vec<T, kVec> y_v[kOut];
        // (its first element's linear index numbers the draws of an op that makes them, as
        // in every kernel of its)
        compute_vector(x_v[u], y_v, f, [&](int e, const acc_t<T>* x, const acc_t<T>* y) {
#pragma unroll
          for (int k = 0; k < kOut; ++k) add[k][e] = y[k];
          add[kOut][e] = x[0];
        }, uint64_t(vec[u]) * kVec);
#pragma unroll
        for (int k = 0; k < kOut; ++k) {
          if (p.p[k] != nullptr) store_operand<true>(modes, k, p.p[k] + offset[u][k], y_v[k]);
        }
      }
#pragma unroll
      for (int a = 0; a < kAcc; ++a) {
        const int k = A::kFirst + a;
        if (p.p[k] == nullptr) continue;  // the same in every lane
        Partial<kVec>& part = part_of[a][u];
        const int32_t at = valid[u] ? offset[u][k] : -1;
        flush_partial(valid[u] && part.offset >= 0 && part.offset != at, part, p.p[k],
                      modes.step[k]);
        if (!valid[u]) continue;
        part.offset = at;
        if (modes.step[k] == 0) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) part.sum[0] += add[a][e];
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) part.sum[e] += add[a][e];
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    const int k = A::kFirst + a;
    if (p.p[k] == nullptr || rows.by_column >> a & 1) continue;
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u)
      flush_partial(part_of[a][u].offset >= 0, part_of[a][u], p.p[k], modes.step[k]);
  }
  if (rows.by_column == 0) return;
  // by_column: the block's sums in shared memory (zeroed before), then to global memory.
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    if (!(rows.by_column >> a & 1)) continue;
    float* sums = sums_of(a);
#pragma unroll
    for (int u = 0; u < kAccumulatingUnroll; ++u) {
      const Partial<kVec>& part = part_of[a][u];
      if (part.offset < 0) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        atomicAdd(sums + (col_of[u] - blockIdx.x * rows.width) * kVec + e, part.sum[e]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < kAcc; ++a) {
    if (!(rows.by_column >> a & 1)) continue;
    const int k = A::kFirst + a;
    const float* sums = sums_of(a);
    for (uint32_t i = threadIdx.x; i < span; i += kThreads) {
      const uint32_t element = blockIdx.x * span + i;  // along dimension 0
      if (element < rows.row * kVec && sums[i] != 0.f) {
        atomicAdd(reinterpret_cast<float*>(p.p[k] + int64_t(element) * modes.step[k]), sums[i]);
      }
    }
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, int kVec, typename F>
const KernelRef& accumulating_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::accumulating_kernel", TypeName<T>::get(), kVec,
                         functor_name<F>(def));
    }
  };
  return kernel_ref<Name>(f);
}
#endif

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_ACCUMULATING_CUH_
