// fusegen-runtime.h: what a generated op hands to the shared runtime: one OpDef descriptor
// with its names, schemas and kernel function pointers, registered by register_op. The
// runtime does everything that is the same for every op (argument checks, type promotion,
// broadcasting, allocation, the CPU parallel loop, the CUDA device guard and stream, the
// Meta impl, autograd and the torch registration), so an op's own translation unit
// includes no torch header and compiles in about a second.
#ifndef FUSEGEN_RUNTIME_H_
#define FUSEGEN_RUNTIME_H_

#include "fusegen-math.h"
#include "fusegen-random.h"

#ifndef __CUDACC_RTC__
#include <cstddef>
#include <cstdint>
#endif

#if defined(FUSEGEN_WITH_CUDA) && !defined(__CUDACC_RTC__)
// The CUDA runtime's own spelling of a stream handle, so this header needs no CUDA header.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
#endif

namespace fusegen {

// The kernel interface: the runtime lays out the operands with at::TensorIterator
// (broadcasting, type promotion, output allocation and memory format, as eager does) and
// hands an op's kernels data pointers and byte strides, never tensors. Operands come
// outputs first, then inputs, as TensorIterator orders them: the forward's outputs and its
// tensors; the backward's gradients (one per kernel gradient, a null pointer when not
// requested) and the douts (one per output of the op), then the tensors the backward
// reads. scalars: the forward's scalars, or those the backward reads.
//
// CPU: one 1-D run of n elements, the inner loop of TensorIterator::for_each (which splits
// the work over threads with at::parallel_for). strides[k] is operand k's step in bytes.
// random: an op that draws random numbers (OpDef::num_random) gets its state and the run's
// first linear index (fusegen-random.h); nullptr otherwise.
using CpuKernel = void (*)(Dtype dtype, char* const* data, const int64_t* strides, int64_t n,
                           const double* scalars, const Random* random);

// CUDA: the whole iteration space. ndim == 0 when it is contiguous (after TensorIterator
// has coalesced its dimensions); otherwise sizes[ndim] (dimension 0 the fastest) and
// strides[d * num_operands + k], operand k's byte stride along dimension d.
constexpr int kMaxDims = 25;  // at::MAX_DIMS, so no dimension count ATen allows is refused
struct RowSum;  // (a row op's sums over the rows: below)
struct CudaLoop {
  int64_t numel;
  int ndim;
  int num_operands;
  const int64_t* sizes;
  const int64_t* strides;
  char* const* data;
  const Random* random = nullptr;  // an op that draws random numbers: its state
  // A row op's backward (below): the sums over the rows it makes (RowSum; none when
  // num_sums is 0), and on CUDA the blocks that make them, each into a partial row.
  const RowSum* sums = nullptr;
  int num_sums = 0;
  int64_t sum_blocks = 0;
  // A row op's CUDA kernel that splits long rows over blocks (row_split_chunk) asks for
  // `bytes` of device memory for its blocks' partial accumulators: scratch(scratch_owner,
  // bytes), allocated on the launch's stream by the runtime and freed after the launches
  // are queued (the caching allocator's stream order keeps it until they have run).
  void* (*scratch)(void* owner, size_t bytes) = nullptr;
  void* scratch_owner = nullptr;
};
using CudaKernel = void (*)(Dtype dtype, const CudaLoop& loop, const double* scalars, void* stream);

// A row op (its expression reduces over the last dimension: fusegen-rows.h) is laid out by
// rows, not by TensorIterator: its kernels get a CudaLoop of ndim == 2, sizes {row length,
// rows} and strides[k] along a row, strides[num_operands + k] from one row to the next
// (0 for an operand broadcast over that dimension), on the CPU as on CUDA.
//
// A row op's backward may sum over the rows (CudaLoop::sums) the gradient of an input of
// one value per column: a weight's (an output of the kernel, which then writes no row of
// it: its data pointer is null) or a bias's (dout itself, the kernel's input 0). Each
// RowSum adds the operands it names into values of the compute type (float for fp16,
// bf16 and fp32, double for fp64), one per column: on the CPU into one row of them at
// `data` (zeros at first), which the loop adds to in row order; on CUDA (at most
// kMaxRowSums a launch) each of sum_blocks blocks writes the sums of the rows it takes
// into its own row of them (`next` bytes from one block's to the next), which the runtime
// then sums in a fixed order. No atomics: the same bits on every run.
struct RowSum {
  unsigned outputs;  // bit k: output k
  bool dout;         // input 0: the incoming gradient (of an op of one output)
  char* data;
  int64_t next;
};
constexpr int kMaxRowSums = 2;
using RowCpuKernel = void (*)(Dtype dtype, const CudaLoop& loop, const double* scalars);

// The CUDA row kernel's shape (fusegen-cuda-rows.cuh), which the runtime's layout needs
// too: threads per block, and the longest row one warp reduces alone (one row per block
// beyond).
constexpr int kRowBlock = 256;
constexpr int64_t kWarpRowLength = 1024;
constexpr int row_threads(int64_t length) { return length <= kWarpRowLength ? 32 : kRowBlock; }
// Threads per block of a row kernel whose rows take `row_threads` threads each: kRowBlock
// for a warp's rows (several rows a block), the row's own threads beyond (one row a block;
// the CUDA launcher also gives a 16-bit row that a block holds in registers half a block's
// threads, kRowHalfBlock: fusegen-cuda-rows.cuh).
FUSEGEN_HD_CONSTEXPR int row_block(int row_threads) {
  return row_threads == 32 ? kRowBlock : row_threads;
}
// The rows such a block takes at once.
FUSEGEN_HD_CONSTEXPR int row_groups(int row_threads) {
  return row_block(row_threads) / row_threads;
}
// Summing over the rows, a thread keeps the sums of its columns (the same ones on every
// row) in its slots of the block's shared memory: row_sum_columns of them at most, 128
// bytes (32 floats, 16 doubles; a 16-byte vector's elements divide it), 32 KiB a block,
// shared by the launch's sums (two sums: half of it each, so rows half as long),
// with row_sum_blocks_per_sm resident blocks per SM: two for float32 and float64 rows,
// three for 16-bit rows. A row that fits is held in registers (as in the other row
// kernels), row_sum_held_vectors of each of its `inputs` (those read along the row) a
// thread at most; a longer one is read again by each pass. 16-bit rows are held in at
// most kRowSumHeldBytes a thread (RMSNorm's and LayerNorm's backward at 2048 elements:
// three inputs of one vector; residual + RMSNorm's four, with 32 bytes of spill stores;
// more spilled further under three blocks' 80 registers a thread and ran slower than
// reading the row again). 16-bit rows a warp takes (up to kWarpRowLength
// elements) write the gradient whole for ATen to sum, as do longer rows (past 8192
// elements, 4096 in fp64).
FUSEGEN_HD_CONSTEXPR int row_sum_blocks_per_sm(int storage_bytes) {
  return storage_bytes >= 4 ? 2 : 3;
}
// Whether rows a warp takes are summed in the kernel (the launcher builds no 16-bit warp
// summing kernels).
FUSEGEN_HD_CONSTEXPR bool row_sums_in_warps(int storage_bytes) { return storage_bytes >= 4; }
FUSEGEN_HD_CONSTEXPR int row_sum_columns(int acc_bytes, int sums = 1) {
  return 32 * 4 / acc_bytes / sums;
}
constexpr int kRowSumHeldBytes = 64;
FUSEGEN_HD_CONSTEXPR int row_sum_held_vectors(int storage_bytes, int acc_bytes, int inputs) {
  return storage_bytes >= 4 ? row_sum_columns(acc_bytes) * storage_bytes / 16
                            : kRowSumHeldBytes / 16 / (inputs > 0 ? inputs : 1);
}
constexpr bool row_sums_fit(int64_t length, int storage_bytes, int acc_bytes, int sums = 1) {
  return length <= int64_t(row_threads(length)) * row_sum_columns(acc_bytes, sums) &&
         (row_sums_in_warps(storage_bytes) || length > kWarpRowLength);
}
// A long row in few rows is split over blocks (fusegen-cuda-rows.cuh, rows_split_kernel):
// one row per block leaves most SMs idle when there are fewer rows than about
// kRowSplitWaves blocks per SM (16 rows of 256k elements: 16 blocks). Each of a row's
// chunks (at least kRowSplitLeast elements, whole 16-byte vectors of the block's threads)
// is one block's, and each pass over the row is one launch whose blocks write their
// chunk's accumulators; the next launch combines them in chunk order. Returns a chunk's
// elements, or 0 for a row one block takes whole. `vector`: elements per access.
constexpr int kRowSplitWaves = 4;
constexpr int64_t kRowSplitLeast = 8192;
constexpr int64_t row_split_chunk(int64_t length, int64_t rows, int sms, int vector) {
  const int64_t blocks = int64_t(kRowSplitWaves) * sms;
  if (rows <= 0 || rows >= blocks || length < 2 * kRowSplitLeast) return 0;
  const int64_t wanted = (blocks + rows - 1) / rows;  // chunks a row
  const int64_t most = length / kRowSplitLeast;
  const int64_t chunks = wanted < most ? wanted : most;
  const int64_t step = int64_t(kRowBlock) * vector;
  return chunks < 2 ? 0 : ((length + chunks - 1) / chunks + step - 1) / step * step;
}
// A row of 16-byte vectors may be held in registers while the kernel makes its passes over
// it (fusegen-cuda-rows.cuh, RowCache): each thread loads its vectors of every input once,
// and the passes after the first and the outputs read them there, not again from L1 or L2.
// A thread keeps 1, 2, 4 or 8 vectors of each of its `inputs` (those read along the row),
// as many as the row needs, at most row_cache_vectors: 256 bytes in all, 64 registers.
FUSEGEN_HD_CONSTEXPR int row_cache_vectors(int inputs) {
  const int n = 256 / (16 * (inputs > 0 ? inputs : 1));
  return n < 1 ? 1 : (n > 8 ? 8 : n);
}

// A row op's accumulator arrays (F::kRows of them): C++ has no empty arrays, and a
// backward may reduce nothing.
template <typename F>
constexpr int kRowSlots = F::kRows > 0 ? F::kRows : 1;

// Whether every output of F is one value per row (its last dimension 1). Such a result
// reads no element of the row outside its reductions, so the row kernels compute it at
// element 0 alone, not in one more pass over the row (a cross-entropy's loss: two passes
// over the logits, not three).
template <typename F>
FUSEGEN_HD_CONSTEXPR bool all_per_row() {
  for (int k = 0; k < F::kOutputs; ++k) {
    if (!F::per_row(k)) return false;
  }
  return true;
}

#if defined(FUSEGEN_WITH_CUDA) && !defined(__CUDACC_RTC__)
// The NVRTC route (fusegen-rtc.cpp): an op's launchers are compiled by the host compiler
// alone (FUSEGEN_RTC_HOST) and launch each kernel by its name in the op's kernel source,
// which the runtime compiles with NVRTC on the kernel's first launch, for the device's
// architecture, and keeps as a cubin in the op's cache entry. `file`: the source's path in
// the folder of the library that holds `anchor` (any address in the op's library).
struct RtcSource {
  const char* file;
  const void* anchor;
};
struct RtcShape {
  unsigned grid[3];
  int threads;
  size_t shared;
};
// Launches `kernel` (a name expression: "fusegen::contiguous_kernel<float, 4, ...>") with
// params[i] pointing at its i-th parameter's bytes. The runtime keys its kernels by the
// name's address: `kernel` must stay valid and unchanged while the process runs.
void rtc_launch(const RtcSource& source, const char* kernel, const RtcShape& shape,
                cudaStream_t stream, void** params);
int rtc_blocks_per_sm(const RtcSource& source, const char* kernel, int threads);
int rtc_sm_count();

// The bytes of an op's functor F<C> as run_launched passes them: `scalars` members of C,
// then a Random when it draws (its alignment is its uint64_t's). Each op's .h checks its
// functors against it (static_assert), so a layout the launchers do not know fails to
// compile.
template <typename C>
constexpr size_t functor_bytes(int scalars, bool random) {
  const size_t own = size_t(scalars) * sizeof(C);
  if (!random) return own > 0 ? own : 1;  // an empty struct's size is 1
  const size_t at = (own + alignof(Random) - 1) / alignof(Random) * alignof(Random);
  return at + sizeof(Random);
}

// Whether F<float> and F<double> have the layout run_launched passes: `scalars` members,
// then a Random when they draw (an op's .cpp checks its functors with it).
template <template <typename> class F>
constexpr bool launchable(int scalars) {
  return sizeof(F<float>) == functor_bytes<float>(scalars, kRandomOf<F<float>> > 0) &&
         sizeof(F<double>) == functor_bytes<double>(scalars, kRandomOf<F<double>> > 0);
}

// An elementwise op's functor (Forward or Backward in its .h) as the runtime's launchers
// run it on the NVRTC route (fusegen-launch.cpp): an op whose loops have at most
// kMaxLaunchedOperands operands holds no launcher code of its own, only its kernel source.
// Its CUDA entry point calls run_launched, which picks each loop's kernel as the op's own
// launchers would (fusegen-cuda.cuh) and passes the functor as bytes: its scalars in the
// compute type, then its Random (functor_bytes).
struct LaunchDef {
  const RtcSource* source;
  const char* functor;     // "fusegen::op_fma::Forward": the kernels take functor<C>
  int inputs;              // F::kInputs
  int outputs;             // F::kOutputs
  int scalars;             // F's members of the compute type, in order
  int random;              // F::kRandom (0: F has no Random member)
  bool accumulates;        // a backward whose loops may carry accumulators
  bool every_kernel;       // every kernel kind (an op's own), or the plain ones (Kernels)
};
void run_launched(const LaunchDef& def, Dtype dtype, const CudaLoop& loop, const double* scalars,
                  void* stream);

// Whether `def` (written out by an op's descriptor, which is compiled without the op's math
// where its CPU kernels come later: OpDef::cpu_later) has F's own counts and name. The
// op's .cpp checks it wherever the math is compiled too (a static_assert).
constexpr bool same_name(const char* a, const char* b) {
  return *a == *b && (*a == 0 || same_name(a + 1, b + 1));
}
template <template <typename> class F>
constexpr bool launches(const LaunchDef& def) {
  return same_name(def.functor, F<float>::kName) && def.inputs == F<float>::kInputs &&
         def.outputs == F<float>::kOutputs && def.random == kRandomOf<F<float>> &&
         launchable<F>(def.scalars);
}
#endif

// The launched operand counts the runtime instantiates its launchers for: a loop of the
// accumulating kernel has at most kMaxVectorOperands (below).
constexpr int kMaxLaunchedOperands = 32;

// A backward's CUDA kernel that sums gradients of broadcast inputs (fusegen-cuda.cuh,
// accumulating_kernel) moves vectors of this many elements along the loop's dimension 0;
// the runtime sends it only loops whose dimension 0 splits into them.
constexpr int kAccumulatingWidth = 4;
// The vector and accumulating kernels mark each operand's access in one bit of a 32-bit
// mask (64 bits cost the 16-bit vector kernel 19 registers): a loop of more operands (a
// backward of about 16 inputs) takes the strided kernel, and a backward of more sums in ATen.
constexpr int kMaxVectorOperands = 32;

// A gradient that is a function of dout alone, as the eager ops that compute it, applied
// to dout in order: `a - b` gives b the steps {'-'}, `2*x` gives x {'*', 2}. No kernel
// reads the inputs for it.
struct DoutStep {
  char op;       // '-': negate; '*': multiply by value; '/': divide by value
  double value;
};

// Where one input's gradient comes from.
struct GradDef {
  int output;              // the backward kernel's output that holds it (identical gradients
                           // share one), -1: none
  int num_steps;           // >= 0: a function of dout alone, `steps` applied to dout (0: dout
                           // itself, no kernel ever); -1: only the kernel computes it
  const DoutStep* steps;
};

// backward_inputs[i] == kResult - k: the backward reads the forward's output k (kResult:
// an op of one output), saved with save_for_backward (so an in-place change of it before
// backward is caught).
constexpr int kResult = -1;
// result_output(backward_inputs[i]): the output k it names, or -1 for an input's index.
constexpr int result_output(int i) { return i <= kResult ? kResult - i : -1; }

// The layout of OpDef: an op compiled against another layout is refused (register_op).
constexpr int kAbi = 17;

// Outputs of one op at most (fusegen/ir/limits.py, MAX_OUTPUTS).
constexpr int kMaxOutputs = 8;

// One op, described by its generated code, which sets each field by name. Names are
// strings (any user name works); all arrays are static data of the op's translation unit.
// The defaults describe an op with no scalars, no backward and no fused forward mode.
struct OpDef {
  int abi = kAbi;                            // kAbi of the header the op was compiled with
  const char* name = nullptr;                // the op's name: fusegen::<name>
  const char* schema = nullptr;              // "<name>(Tensor a, ..., float s, ...) -> Tensor"
                                             // (several outputs: "-> (Tensor, Tensor)")
  const char* backward_schema = nullptr;     // "<name>_backward(...) -> Tensor[]", or none
  int num_inputs = 0;
  const char* const* input_names = nullptr;  // the user's names (schema, messages)
  int num_outputs = 1;                       // the forward's outputs: the backward's douts
  bool joined = false;                       // two outputs returned as the halves of one tensor
                                             // along its last dimension (torch.cat(..., -1))
  int num_scalars = 0;
  const char* const* scalar_names = nullptr;
  int num_backward_inputs = 0;               // the tensors the backward reads (after the douts)
  const int* backward_inputs = nullptr;      // ... as indices into the inputs, or kResult
  const char* const* backward_input_names = nullptr;  // ... named for messages
  int num_backward_scalars = 0;
  const int* backward_scalars = nullptr;     // indices into the scalars
  int num_kernel_grads = 0;                  // outputs of the backward kernel: distinct gradients
  const GradDef* grads = nullptr;            // per input: where its gradient comes from
  CpuKernel forward_cpu = nullptr;
  CpuKernel backward_cpu = nullptr;          // none without kernel gradients
  // The CPU kernels come later (forward_cpu and backward_cpu unset): in the op built whole,
  // another library, which fusegen's Python side builds and loads on the op's first CPU
  // call (fusegen::__cpu_kernels) and whose register_op hands them to this op. A new op
  // on a GPU machine then compiles its descriptor alone.
  bool cpu_later = false;
  bool rows = false;                         // a row op: the kernels below, by rows
  const bool* per_row = nullptr;             // ... per output: one value per row (shape [..., 1])
  const bool* index_inputs = nullptr;        // ... per input: a gather's index, of one integer
                                             // per row, which the kernels read converted to
                                             // float (double for float64), not in the op's dtype
  RowCpuKernel forward_rows_cpu = nullptr;   // ... its CPU kernels (forward_cpu is unset)
  RowCpuKernel backward_rows_cpu = nullptr;
  CudaKernel forward_cuda = nullptr;         // none in a build without CUDA
  CudaKernel backward_cuda = nullptr;
  bool backward_accumulates = false;         // backward_cuda takes accumulators
                                             // (accumulates_in_kernel), or for a row op sums
                                             // outputs over the rows: not an auxiliary op's
  // A row op whose backward reads row values its forward computes (a cross-entropy's
  // logsumexp and its label's count): the forward's kernels write them as num_saved_rows
  // more outputs after num_outputs, one value per row each, in the compute type (float;
  // double for float64), where asked; saved_backward_* read them as per-row inputs after
  // the backward's own tensors and make fewer passes over the row than backward_*, which
  // compute them again. The Autograd kernel saves them where it calls the kernels itself.
  int num_saved_rows = 0;
  RowCpuKernel saved_backward_rows_cpu = nullptr;
  CudaKernel saved_backward_cuda = nullptr;
  // Forward-mode AD through fusegen::<name>_jvp (built into the same library): its tensor
  // arguments, each an index into the inputs (that input's primal) or num_inputs + i
  // (input i's tangent), and its scalars as indices into the scalars. num_jvp_args: -1 when
  // the op has no fused forward mode (an auxiliary op), 0 when every gradient is zero (so
  // is the tangent; there is no <name>_jvp).
  int num_jvp_args = -1;
  const int* jvp_args = nullptr;
  int num_jvp_scalars = 0;
  const int* jvp_scalars = nullptr;
  // An op that draws random numbers (torch.rand_like, dropout): num_random streams, drawn
  // from the device's default generator on each call, element by element in the linear
  // order of the broadcast shape (fusegen-random.h). The Autograd kernel calls
  // `sampled_schema`, "<name>_sampled(...) -> (Tensor, ..., Tensor rng_state)", which
  // also returns the state drawn with, and the backward (whose last tensor is that state)
  // regenerates the same numbers from it. `probabilities`: the scalars that must lie in
  // [0, 1] (a dropout's p), as indices into the scalars.
  int num_random = 0;
  const char* sampled_schema = nullptr;
  int num_probabilities = 0;
  const int* probabilities = nullptr;
};

// Defines fusegen::<name> (and <name>_backward) and registers the op's CPU, Meta, CUDA and
// Autograd kernels. Called once per op from a static initializer of the op's library.
bool register_op(const OpDef& def);

// ---------------------------------------------------------------------------------------
// Step ops: in-place updates over tensors, or over lists of tensors in one launch per
// (device, dtypes) group, as torch's foreach and fused optimizers run.
//
// A step op's kernel operands are its updated tensors (the kernel's outputs), then the
// tensors it reads; each operand has its own dtype (bf16 parameters beside fp32 state), and
// the kernel computes in float, or in double when an operand is float64.

constexpr int kStepAbi = 2;
constexpr int kStepMaxOperands = 24;
constexpr int kStepMaxScalars = 16;
// Elements per CUDA block (a chunk), as ATen's multi_tensor_apply.
constexpr int64_t kStepChunk = 65536;
// Tensors per launch: their pointers, sizes and first chunks travel in the kernel's
// parameters, beside the scalars, within the 4 KiB every GPU accepts. A launch has as many
// blocks as its tensors have chunks (each block finds its tensor by bisection), so a long
// list runs as a few launches of many waves, not many launches each ending in a tail.
constexpr int step_max_tensors(int num_operands) {
  return (4096 - 512) / (8 * num_operands + 8 + 4);
}

// One launch: `num_tensors` tensors (each one index of the lists), their operands' data
// data[t * num_operands + k], element counts, and first chunks (first_chunk[num_tensors]
// is the launch's block count). A scalar is scalars[s], unless scalar_data[s] is set: a
// 0-d float32 (scalar_is_double[s] false) or float64 tensor on the device, which the
// kernel reads itself.
struct StepLaunch {
  int num_operands;
  int num_tensors;
  char* const* data;
  const int64_t* numel;
  const int* first_chunk;
  const Dtype* dtypes;  // per operand
  int num_scalars;
  const double* scalars;
  const void* const* scalar_data;
  const bool* scalar_is_double;
  bool aligned;  // every operand's data is 16-byte aligned
};

// CPU: one contiguous run of n elements of every operand, data[k] and dtypes[k].
using StepCpuKernel = void (*)(char* const* data, const Dtype* dtypes, int64_t n,
                               const double* scalars);
using StepCudaKernel = void (*)(const StepLaunch& launch, void* stream);

// One step op, described by its generated code (fields set by name, arrays static).
struct StepDef {
  int abi = kStepAbi;
  const char* name = nullptr;            // fusegen::<name>
  const char* schema = nullptr;          // "<name>(Tensor(a!) p, Tensor g, ..., float lr) -> ()"
  const char* foreach_schema = nullptr;  // "<name>_foreach(Tensor(a!)[] p, ..., float[] scalars,
                                         //  Tensor?[] scalar_tensors) -> ()"
  int num_inputs = 0;
  const char* const* input_names = nullptr;
  int num_scalars = 0;
  const char* const* scalar_names = nullptr;
  int num_updated = 0;                   // operands 0 .. num_updated - 1
  const int* updated = nullptr;          // ... as indices into the inputs
  int num_reads = 0;                     // the operands after them
  const int* reads = nullptr;            // ... as indices into the inputs
  const uint32_t* alias_ok = nullptr;    // per updated input: bit j, input j may be the same tensor
  StepCpuKernel cpu = nullptr;
  StepCudaKernel cuda = nullptr;         // none in a build without CUDA
};

// Defines fusegen::<name> and fusegen::<name>_foreach with CPU, Meta, CUDA and Autograd
// kernels. Called once per step op from a static initializer of its library.
bool register_step(const StepDef& def);

}  // namespace fusegen

#endif  // FUSEGEN_RUNTIME_H_
