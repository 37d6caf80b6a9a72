// fusegen-cuda.cuh: the launcher an op's .cu calls (run_cuda): it picks, per loop, the
// kernel that takes its layout. The kernels are in a header per kind.
#ifndef FUSEGEN_CUDA_CUH_
#define FUSEGEN_CUDA_CUH_

#include "fusegen-cuda-accumulating.cuh"
#include "fusegen-cuda-common.cuh"
#include "fusegen-cuda-contiguous.cuh"
#include "fusegen-cuda-rows.cuh"
#include "fusegen-cuda-strided.cuh"
#include "fusegen-cuda-tiled.cuh"
#include "fusegen-cuda-vector.cuh"

#if FUSEGEN_HOST_CODE
namespace fusegen {

// What the launchers ask of a functor: an op's own F, whose counts are compile-time, or a
// launched one (Launched), whose operand count is and whose outputs and random draws are
// its LaunchDef's.
template <typename F>
constexpr int operands_of() {
  if constexpr (kLaunched<F>) {
    return F::kOperands;
  } else {
    return F::kInputs + F::kOutputs;
  }
}
template <typename F> constexpr int kOperandsOf = operands_of<F>();
// A backward's operands with its accumulators (Accumulating).
template <typename F>
constexpr int accumulating_operands() {
  if constexpr (kLaunched<F>) {
    return F::kOperands;
  } else {
    return Accumulating<F>::kOperands;
  }
}
template <typename F>
int outputs_of([[maybe_unused]] const F& f) {
  if constexpr (kLaunched<F>) {
    return f.def->outputs;
  } else {
    return F::kOutputs;
  }
}
template <typename F>
bool draws_random([[maybe_unused]] const F& f) {
  if constexpr (kLaunched<F>) {
    return f.def->random > 0;
  } else {
    return kRandomOf<F> > 0;
  }
}

// The kernels after the contiguous one, each with the test that picks it: the first that
// takes the loop runs it (launch_elementwise). Strides are operand k's byte steps,
// loop.strides[d * num_operands + k]; a null operand (an output not wanted) takes any path.

inline int64_t step(const CudaLoop& loop, int d, int k) {
  return loop.strides[d * loop.num_operands + k];
}

// Whether 32-bit index math may be used: fewer than 2^31 elements, and every operand's
// largest byte offset below 2^31 (PyTorch's can_use_32bit_indexing, in bytes).
inline bool fits_32bit(const CudaLoop& loop, int64_t n, int num_operands, size_t element_size) {
  constexpr int64_t kLimit = int64_t(1) << 31;
  if (n >= kLimit) return false;
  if (loop.ndim == 0) return n * int64_t(element_size) < kLimit;
  for (int k = 0; k < num_operands; ++k) {
    int64_t span = 0;
    for (int d = 0; d < loop.ndim; ++d) {
      const int64_t s = step(loop, d, k);
      span += (loop.sizes[d] - 1) * (s < 0 ? -s : s);
    }
    if (span >= kLimit) return false;
  }
  return true;
}

// An offset calculator over the loop's dimensions [from, ndim), dimension `from` counted
// in units of `group` elements (its steps `group` times the loop's).
template <typename Index, int kN>
OffsetCalculator<kN, Index> offset_calculator(const CudaLoop& loop, const Pointers<kN>& p, int from,
                                              int64_t group) {
  using Offset = typename OffsetCalculator<kN, Index>::Offset;
  OffsetCalculator<kN, Index> calc;
  calc.ndim = loop.ndim - from;
  for (int d = from; d < loop.ndim; ++d) {
    const int64_t unit = d == from ? group : 1;
    calc.sizes[d - from] = IntDivider<Index>(static_cast<Index>(loop.sizes[d] / unit));
    for (int k = 0; k < kN; ++k)
      calc.strides[d - from][k] = p.p[k] ? static_cast<Offset>(step(loop, d, k) * unit) : 0;
  }
  return calc;
}

// The vector kernel's modes of a loop whose dimension 0 splits into whole vectors: an
// operand is a vector access when it steps by one element along dimension 0 and its
// pointer and its other steps keep each vector aligned to its width; repeated when it
// steps by none (an input); gathered otherwise.
template <typename T, int kVec, int kN>
Modes<kN> vector_modes(const CudaLoop& loop, const Pointers<kN>& p, int num_outputs) {
  constexpr int64_t kBytes = int64_t(sizeof(T)) * kVec;
  Modes<kN> modes;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr) continue;
    const int64_t s = step(loop, 0, k);
    bool vector = s == int64_t(sizeof(T)) && reinterpret_cast<std::uintptr_t>(p.p[k]) % kBytes == 0;
    for (int d = 1; d < loop.ndim && vector; ++d) vector = step(loop, d, k) % kBytes == 0;
    if (s == 0 && k >= num_outputs) {
      modes.repeated |= 1u << k;
    } else if (!vector) {
      modes.gathered |= 1u << k;
      modes.step[k] = static_cast<int32_t>(s);
    }
  }
  return modes;
}

// The flat loop of the vector kernel, where dimension 0 does not split into vectors of
// kVec but the loop does: each operand dense (one run of elements in the loop's order: a
// step of one element along dimension 0, and along each further dimension the size of the
// one below, from a pointer aligned to a vector) or an input repeated along dimension 0
// (step 0: a per-channel scale of NCHW activations whose H * W is odd or 4 mod 8, as
// 362 * 362 is). Dimension 0 is at least kFlatRow long, so that few vectors cross the end of
// a row. Returns whether the loop is such, with its modes.
constexpr int64_t kFlatRow = 1024;

template <typename T, int kVec, int kN>
bool flat_modes(const CudaLoop& loop, const Pointers<kN>& p, int num_outputs, Modes<kN>& modes) {
  constexpr int64_t kElement = sizeof(T);
  if (loop.ndim < 2 || loop.sizes[0] < kFlatRow || loop.numel % kVec != 0) return false;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr) continue;
    if (step(loop, 0, k) == 0 && k >= num_outputs) {
      modes.repeated |= 1u << k;
      continue;
    }
    bool dense = step(loop, 0, k) == kElement &&
                 reinterpret_cast<std::uintptr_t>(p.p[k]) % (kElement * kVec) == 0;
    for (int d = 1; d < loop.ndim && dense; ++d)
      dense = step(loop, d, k) == step(loop, d - 1, k) * loop.sizes[d - 1];
    if (!dense) return false;
  }
  return true;
}

template <typename T, int kVec, bool kGathers, typename F>
bool launch_vector_of(const CudaLoop& loop, const Pointers<kOperandsOf<F>>& p, const F& f,
                      cudaStream_t stream) {
  Modes<kOperandsOf<F>> modes;
  const bool flat = loop.sizes[0] % kVec != 0;
  if (flat && !flat_modes<T, kVec>(loop, p, outputs_of(f), modes)) return false;
  if (!flat) modes = vector_modes<T, kVec>(loop, p, outputs_of(f));
  if (!kGathers && modes.gathered != 0) return false;
  const int64_t n_vec = loop.numel / kVec;
  const auto calc = offset_calculator<uint32_t>(loop, p, 0, 1);
  constexpr int64_t kChunk = int64_t(kThreads) * (kGathers ? kUnroll : kVectorUnroll);
  const unsigned grid = grid_size((n_vec + kChunk - 1) / kChunk);
  launch(FUSEGEN_KERNEL(f, vector_kernel, T, kVec, kGathers, F), {grid}, kThreads, 0, stream, p,
         calc, static_cast<uint32_t>(n_vec), modes, flat, f);
  return true;
}

// Two vector kernels, the first that takes the loop: 16-byte vectors whose operands are
// each one access or one element repeated (a per-channel scale or bias, channels_last, a
// bias row: the common loops), then vectors that may also gather (a sliced input beside
// contiguous ones), 16 bytes wide and then 4 elements. The gathering code costs registers
// (the bf16 forward of a*b+c: 32 without it, 63 with it at 16 bytes), and a kernel of 78
// registers (3 blocks of 256 threads per SM) moved 2.1 TB/s on an NCHW per-channel bf16
// loop on the H200, where torch.compile's (30 registers) moved 4.0.
// Only with 32-bit index math (`index32`: fits_32bit, which the caller needs as well);
// more than kMaxVectorOperands operands (a backward of about 16 inputs): the strided kernel.
template <typename T, typename F>
bool launch_vector(const CudaLoop& loop, const Pointers<kOperandsOf<F>>& p, const F& f,
                   bool index32, cudaStream_t stream) {
  if constexpr (kOperandsOf<F> > kMaxVectorOperands) {
    return false;
  } else {
    if (loop.ndim == 0 || !index32) return false;
    if (launch_vector_of<T, kVecWidth<T>, false>(loop, p, f, stream)) return true;
    if constexpr (kVecWidth<T> > kVectorWidth<T>) {
      if (launch_vector_of<T, kVecWidth<T>, true>(loop, p, f, stream)) return true;
    }
    return launch_vector_of<T, kVectorWidth<T>, true>(loop, p, f, stream);
  }
}

// The accumulating kernel over a loop of Accumulating<F>::kOperands operands, which the
// runtime sends only for a loop of whole vectors of kAccumulatingWidth along dimension 0
// and 32-bit offsets, not fp64 (fusegen-runtime.cpp, accumulates_in_kernel). The inputs and
// outputs take the vector kernel's modes; an accumulator's step along dimension 0 is its
// Modes::step (0: one offset for the whole vector). Rows (RowLoop) along dimension 0 when
// some accumulator steps along it, else chunks; about one wave of blocks, so that a
// thread sums many vectors before it flushes.
template <typename T, int kVec, typename F>
void launch_accumulating_of(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  constexpr int kN = accumulating_operands<F>();
  const int accumulators = outputs_of(f) + 1;  // Accumulating<F>::kAccumulators
  const int first = kN - accumulators;         // ... kFirst
  static_assert(kVec <= kVecWidth<T>, "whole vectors of the vector kernel's");
  constexpr int64_t kSlots = int64_t(kThreads) * kAccumulatingUnroll;
  const auto p = pointers_of<kN>(loop);
  Modes<kN> modes = vector_modes<T, kVec>(loop, p, outputs_of(f));
  bool along_rows = false;
  uint32_t by_column = 0;
  for (int a = 0; a < accumulators; ++a) {
    const int k = first + a;
    modes.repeated &= ~(1u << k);
    modes.gathered &= ~(1u << k);
    modes.step[k] = p.p[k] != nullptr ? static_cast<int32_t>(step(loop, 0, k)) : 0;
    along_rows = along_rows || modes.step[k] != 0;
    bool column = modes.step[k] != 0;
    for (int d = 1; d < loop.ndim && column; ++d) column = step(loop, d, k) == 0;
    if (column) by_column |= 1u << a;
  }
  const int64_t n_vec = loop.numel / kVec;
  const int64_t row = along_rows ? loop.sizes[0] / kVec : kSlots;
  const int64_t width = row < kSlots ? row : kSlots;
  const int64_t rows_per_step = kSlots / width;
  const int64_t num_rows = (n_vec + row - 1) / row;
  const int64_t segments = (row + width - 1) / width;
  const int64_t steps = (num_rows + rows_per_step - 1) / rows_per_step;
  const int64_t wave =
      int64_t(sm_count()) * FUSEGEN_BLOCKS_PER_SM(f, accumulating_kernel, T, kVec, F);
  int64_t groups = (wave + segments - 1) / segments;
  groups = groups < steps ? groups : steps;
  groups = groups < kMaxGridY ? groups : kMaxGridY;
  const int64_t rows_per_block = (steps + groups - 1) / groups * rows_per_step;
  groups = (num_rows + rows_per_block - 1) / rows_per_block;
  const RowLoop rl{static_cast<uint32_t>(n_vec),
                   static_cast<uint32_t>(row),
                   static_cast<uint32_t>(width),
                   static_cast<uint32_t>(rows_per_step),
                   static_cast<uint32_t>(num_rows),
                   static_cast<uint32_t>(rows_per_block),
                   by_column};
  // 8 KiB per accumulator at most (512 vectors of 4 floats): within the 48 KiB a launch may
  // ask for without opting in, for up to six of them.
  const auto shared_bytes = [&] {
    return size_t(__builtin_popcount(by_column)) * width * kVec * sizeof(float);
  };
  while (shared_bytes() > kMaxSharedBytes)
    by_column &= by_column - 1;  // the rest flush lane by lane
  const size_t shared = shared_bytes();
  const auto calc = offset_calculator<uint32_t>(loop, p, 0, kVec);
  const Grid grid{static_cast<unsigned>(segments), static_cast<unsigned>(groups)};
  launch(FUSEGEN_KERNEL(f, accumulating_kernel, T, kVec, F), grid, kThreads, shared, stream, p,
         calc, rl, modes, f);
}

// A 16-bit backward that draws random numbers moves 16-byte vectors (eight elements) where
// dimension 0 splits into them, so that each vector takes a whole Philox block of a
// dropout's stream (eight 16-bit draws) instead of computing one for four elements: on an
// H100, bias-dropout-add's bf16 step at 16384 x 4096 went from 0.346 to 0.262 ms, the time
// of the same step without draws (docs/benchmarks.md). FUSEGEN_RANDOM_ACCUMULATING_WIDE=0
// gives the four-element kernel back, to compare (tests/gpu/h200_run.sh random_width).
#ifndef FUSEGEN_RANDOM_ACCUMULATING_WIDE
#define FUSEGEN_RANDOM_ACCUMULATING_WIDE 1
#endif

template <typename T, typename F>
void launch_accumulating(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  if constexpr (FUSEGEN_RANDOM_ACCUMULATING_WIDE && sizeof(T) == 2) {
    if (draws_random(f) && loop.sizes[0] % kVecWidth<T> == 0)
      return launch_accumulating_of<T, kVecWidth<T>>(loop, f, stream);
  }
  launch_accumulating_of<T, kAccumulatingWidth>(loop, f, stream);
}

// tiled_kernel with P elements per access over `tl` (`tiles` tiled inputs, `outer` the
// count over dimensions 2 and up), unless its grid or shared memory does not fit.
template <typename T, int P, typename F>
bool launch_tiles(const Pointers<kOperandsOf<F>>& p,
                  TileLoop<kOperandsOf<F>> tl, int tiles, int64_t outer, const F& f,
                  cudaStream_t stream) {
  constexpr size_t kTileBytes = sizeof(TileAccess<T, P>) * kTile * kTileStride<T, P>;
  const int64_t tiles0 = (tl.size0 + kTileHeight<P> - 1) / kTileHeight<P>;
  const int64_t tiles1 = (tl.size1 + kTileWidth<P> - 1) / kTileWidth<P>;
  if (tiles * kTileBytes > kMaxSharedBytes || tiles0 >= (int64_t(1) << 31) || tiles1 > kMaxGridY ||
      outer > kMaxGridY) {
    return false;
  }
  // Each operand's steps: the byte offsets of its accesses 1, P and P * S from access 0 in
  // tiled_kernel's places, (m, n, q) = (0, 0, 1), (0, 1, 0) and (1, 0, 0) (a step along an
  // index that is always 0, q for P = 1 and n for S = 1, adds nothing). A direct place is
  // linear in e: its accesses are step_q apart.
  for (int k = 0; k < kOperandsOf<F>; ++k) {
    const auto offset = [&](int e) {
      const TilePlace at = tl.slot[k] >= 0 ? tiled_place<P>(0, 0, e) : direct_place<P>(0, 0, e);
      return at.d0 * tl.stride0[k] + at.d1 * tl.stride1[k];
    };
    tl.step_q[k] = offset(1);
    tl.step_n[k] = offset(P);
    tl.step_m[k] = offset(P * kTileSpan<P>);
  }
  const Grid grid{static_cast<unsigned>(tiles0), static_cast<unsigned>(tiles1),
                  static_cast<unsigned>(outer)};
  launch(FUSEGEN_KERNEL(f, tiled_kernel, T, P, F), grid, kThreads, tiles * kTileBytes, stream, p,
         tl, f);
  return true;
}

// Whether every access of P elements is whole and aligned to its P * sizeof(T) bytes: both
// sizes multiples of P (an access starts at a multiple of P), and every operand's pointer
// and steps multiples of P * sizeof(T) bytes, but for the step between an access's
// elements (along dimension 1 for a tiled input, along 0 for the others, which must step
// by one element there) and for a repeated input's (one element an access, any
// alignment). P = 1 takes any layout.
template <typename T, int kN>
bool accesses_fit(const CudaLoop& loop, const Pointers<kN>& p, const TileLoop<kN>& tl, int P) {
  constexpr int64_t kElement = sizeof(T);
  const int64_t bytes = P * kElement;
  if (P == 1) return true;
  if (loop.sizes[0] % P != 0 || loop.sizes[1] % P != 0) return false;
  for (int k = 0; k < kN; ++k) {
    if (p.p[k] == nullptr || tl.slot[k] == kRepeated) continue;
    const bool tiled = tl.slot[k] >= 0;
    bool fits = reinterpret_cast<std::uintptr_t>(p.p[k]) % bytes == 0 &&
                (tiled ? tl.stride0[k] : tl.stride1[k]) % bytes == 0 &&
                (tiled || tl.stride0[k] == kElement);
    for (int d = 2; d < loop.ndim; ++d) fits = fits && step(loop, d, k) % bytes == 0;
    if (!fits) return false;
  }
  return true;
}

// tiled_kernel with the widest P, from P down to 1, whose accesses fit the loop and whose
// grid and shared memory fit the device (three tiled inputs of fours would take 49 KiB).
template <typename T, int P, typename F>
bool launch_widest(const CudaLoop& loop, const Pointers<kOperandsOf<F>>& p,
                   const TileLoop<kOperandsOf<F>>& tl, int tiles, int64_t outer,
                   const F& f, cudaStream_t stream) {
  if (accesses_fit<T>(loop, p, tl, P) && launch_tiles<T, P>(p, tl, tiles, outer, f, stream))
    return true;
  if constexpr (P > 1) {
    return launch_widest<T, P / 2>(loop, p, tl, tiles, outer, f, stream);
  } else {
    return false;
  }
}

// The tiled kernel takes the loop when some input steps by one element along dimension 1
// and not along dimension 0 (nor by 0: a repeated row is read directly), every output
// steps by one element along dimension 0, and the tiles fit in 48 KiB of shared memory.
// 2-byte types move fours, else pairs, where every access is whole and aligned
// (accesses_fit: rows whose length is a multiple of 4, or of 2, operands aligned to 8, or
// 4, bytes); else one element per access (rows of odd length, a sliced or misaligned
// operand: the kernel of P = 1, as for fp32).
template <typename T, typename F>
bool launch_tiled(const CudaLoop& loop, const Pointers<kOperandsOf<F>>& p, const F& f,
                  cudaStream_t stream) {
  constexpr int kN = kOperandsOf<F>;
  constexpr int64_t kElement = sizeof(T);
  if (loop.ndim < 2 || loop.sizes[0] < kTile / 2 || loop.sizes[1] < kTile / 2) return false;
  const int outputs = outputs_of(f);
  TileLoop<kN> tl;
  int tiles = 0;
  for (int k = 0; k < kN; ++k) {
    tl.slot[k] = kDirect;
    tl.stride0[k] = p.p[k] ? step(loop, 0, k) : 0;
    tl.stride1[k] = p.p[k] ? step(loop, 1, k) : 0;
    if (p.p[k] == nullptr) continue;
    if (k < outputs && tl.stride0[k] != kElement) return false;
    if (k >= outputs && tl.stride1[k] == kElement && tl.stride0[k] != kElement &&
        tl.stride0[k] != 0) {
      tl.slot[k] = static_cast<int8_t>(tiles++);
    } else if (k >= outputs && tl.stride0[k] == 0) {
      tl.slot[k] = kRepeated;
    }
  }
  if (tiles == 0) return false;
  tl.size0 = loop.sizes[0];
  tl.size1 = loop.sizes[1];
  tl.outer = offset_calculator<uint64_t>(loop, p, 2, 1);
  const int64_t outer = loop.numel / (loop.sizes[0] * loop.sizes[1]);
  return launch_widest<T, kPack<T>>(loop, p, tl, tiles, outer, f, stream);
}

// The offset-calculator kernel over the loop, with Index-wide index math: any layout.
template <typename T, typename F, typename Index>
void launch_strided(const CudaLoop& loop, const Pointers<kOperandsOf<F>>& p, const F& f,
                    cudaStream_t stream) {
  constexpr int kN = kOperandsOf<F>;
  using Calc = OffsetCalculator<kN, Index>;
  using Offset = typename Calc::Offset;
  const int64_t n = loop.numel;
  Calc calc;
  if (loop.ndim == 0) {  // contiguous but misaligned: one dimension of unit steps
    calc.ndim = 1;
    calc.sizes[0] = IntDivider<Index>(static_cast<Index>(n));
    for (int k = 0; k < kN; ++k) calc.strides[0][k] = p.p[k] != nullptr ? Offset(sizeof(T)) : 0;
  } else {
    calc = offset_calculator<Index>(loop, p, 0, 1);
  }
  const int blocks = FUSEGEN_BLOCKS_PER_SM(f, strided_kernel, T, F, Index);
  const unsigned grid = wave_grid_size((n + kThreads - 1) / kThreads, blocks);
  launch(FUSEGEN_KERNEL(f, strided_kernel, T, F, Index), {grid}, kThreads, 0, stream, p, calc, n,
         f);
}

// The kernels an entry point instantiates: every layout's (kEvery: an op's own), or the
// contiguous and offset-calculator kernels alone (kPlain: the auxiliary ops `<name>_grad2`
// and `<name>_jvp`, of double backward and forward-mode AD, off the training step's hot
// path; nor the accumulating kernel: their OpDef's backward_accumulates is false). The
// tiled and vector kernels in four dtypes are most of a new op's nvcc time, and without
// them the auxiliary ops' units are no longer than the op's own.
enum class Kernels { kEvery, kPlain };

// Launches F over the runtime's CudaLoop on `stream`: the 16-byte kernel when the loop is
// contiguous and every pointer 16-byte aligned (x[1:] of a float tensor is not), else the
// tiled kernel for a transposed input, the vector kernel when dimension 0 splits into
// vectors, and the offset-calculator kernel for anything else.
template <typename T, Kernels kKernels, typename F>
void launch_elementwise(const CudaLoop& loop, const F& f, cudaStream_t stream) {
  constexpr int kN = kOperandsOf<F>;
  const auto p = pointers_of<kN>(loop);
  bool aligned = true;
  for (int k = 0; k < kN; ++k)
    aligned =
        aligned && reinterpret_cast<std::uintptr_t>(p.p[k]) % 16 == 0;  // null counts as aligned
  const int64_t n = loop.numel;
  if (loop.ndim == 0 && aligned) {
    constexpr int kVec = kVecWidth<T>;
    constexpr int64_t kChunk = int64_t(kThreads) * kUnroll;
    const unsigned grid = grid_size((n / kVec + kChunk - 1) / kChunk);
    launch(FUSEGEN_KERNEL(f, contiguous_kernel, T, kVec, F), {grid}, kThreads, 0, stream, p, n, f);
    return;
  }
  // fp64 (gradcheck's dtype, rarely a fast path's) skips the tiled and vector kernels:
  // 0.3 s less nvcc per unit, in every new op's build.
  const bool index32 = fits_32bit(loop, n, kN, sizeof(T));
  // An op that draws random numbers numbers its elements in the loop's linear order (the
  // runtime enforces it): the tiled kernel's order is another.
  if constexpr (sizeof(T) != 8 && kKernels == Kernels::kEvery) {
    if constexpr (kLaunched<F> || kRandomOf<F> == 0) {
      if (!draws_random(f) && launch_tiled<T>(loop, p, f, stream)) return;
    }
    if (launch_vector<T>(loop, p, f, index32, stream)) return;
  }
  if (index32) {
    launch_strided<T, F, uint32_t>(loop, p, f, stream);
  } else {
    launch_strided<T, F, uint64_t>(loop, p, f, stream);
  }
}

// The launcher of an op's kernel for kGroup's dtypes (op_kernels.cu.j2): F built by
// make(zero of the compute type), run in the storage type of `dtype`.
// kAccumulates (a backward): a loop of Accumulating<F>::kOperands operands goes to the
// accumulating kernel (fp64, or more than kMaxVectorOperands of them, never comes with one).
// kKernels: which of the other kernels are instantiated (Kernels).
template <DtypeGroup kGroup, bool kAccumulates = false, Kernels kKernels = Kernels::kEvery,
          typename Make>
void run_cuda(Dtype dtype, const CudaLoop& loop, cudaStream_t stream, Make&& make) {
  dispatch_dtype<kGroup>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto f = make(acc_t<T>{});
    if constexpr (kAccumulates && sizeof(T) != 8 &&
                  Accumulating<decltype(f)>::kOperands <= kMaxVectorOperands) {
      if (loop.num_operands == Accumulating<decltype(f)>::kOperands)
        return launch_accumulating<T>(loop, f, stream);
    }
    launch_elementwise<T, kKernels>(loop, f, stream);
  });
}

}  // namespace fusegen
#endif  // FUSEGEN_HOST_CODE

#endif  // FUSEGEN_CUDA_CUH_
