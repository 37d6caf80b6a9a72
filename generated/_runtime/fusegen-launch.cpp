// fusegen-launch.cpp: the NVRTC route's launchers of elementwise ops (run_launched). The
// launchers of fusegen-cuda.cuh depend on an op's functor only through its operand count
// (a compile-time array size of the kernels' parameters), its output count and random
// draws, its bytes and its name: instantiated here once per operand count, with the
// functor as a Launched (its LaunchDef and bytes), they serve every op whose loops have at
// most kMaxLaunchedOperands operands. Such an op's library then holds its CPU kernels and
// descriptor alone: a new op's build on a GPU machine compiles no launcher (about 0.8 s of
// host compiler per unit, in parallel units, every one of them in the op's critical path).
// The kernels are the op's own, compiled from its .cu by NVRTC on first launch
// (fusegen-rtc.cpp), and the launches are those its own launchers would make: the same
// kernel, grid and parameters for every loop (tests/test_rtc.py compares them).
#ifdef FUSEGEN_WITH_CUDA

// Host code that runs once per launch (layout tests, launch sizes), as an op's own launch
// units: GCC compiles it at -O1, in about two thirds of the time of -O3.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
#endif
#define FUSEGEN_RTC_HOST
#include "fusegen-cuda.cuh"

#include <c10/util/Exception.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace fusegen {

// The loops of one storage type: the launchers of every operand count for T, with F<C>'s
// bytes (C = acc_t<T>) built from the call's scalars. With cores to spare, each storage
// type is a unit of its own (FUSEGEN_LAUNCH_PART, builder.py), about 5 s of the host
// compiler each at -O1, built in parallel with the runtime's other units.
template <typename T>
void launch_as(const LaunchDef& def, const CudaLoop& loop, const double* scalars,
               bool accumulating, cudaStream_t stream);

constexpr int kFewestOperands = 2;  // the fewest operands of a loop: an input and an output

#ifdef FUSEGEN_LAUNCH_PART
#define FUSEGEN_LAUNCH_ALL 0
// Defined by the unit of each storage type.
extern template void launch_as<float>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                      cudaStream_t);
extern template void launch_as<double>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                       cudaStream_t);
extern template void launch_as<Half>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                     cudaStream_t);
extern template void launch_as<BFloat16>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                         cudaStream_t);
#else
#define FUSEGEN_LAUNCH_ALL 1  // one unit: every part
#endif

#if FUSEGEN_LAUNCH_ALL || FUSEGEN_LAUNCH_PART == 0
const KernelRef& launched_kernel(const LaunchDef& def, const void* site,
                                 std::string (*name)(const LaunchDef* def)) {
  static std::mutex mutex;
  static std::map<std::pair<const LaunchDef*, const void*>, std::unique_ptr<KernelRef>> kernels;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<KernelRef>& kernel = kernels[{&def, site}];
  if (!kernel) kernel.reset(new KernelRef{name(&def), def.source});
  return *kernel;  // never removed: the name's address keys the compiled kernel
}

void run_launched(const LaunchDef& def, Dtype dtype, const CudaLoop& loop, const double* scalars,
                  void* stream) {
  const int n = loop.num_operands;
  // The loops the runtime hands an op's CUDA kernel (accumulates_in_kernel): its operands,
  // or with a backward's accumulators, one per gradient and one for dout.
  const bool accumulating = def.accumulates && dtype != Dtype::kFloat64 &&
                            n == def.inputs + 2 * def.outputs + 1 && n <= kMaxVectorOperands;
  TORCH_CHECK((accumulating || n == def.inputs + def.outputs) && n >= kFewestOperands &&
                  n <= kMaxLaunchedOperands,
              "fusegen: ", def.functor, " got a loop of ", n, " operands; its launchers take ",
              def.inputs + def.outputs);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat32: return launch_as<float>(def, loop, scalars, accumulating, s);
    case Dtype::kFloat64: return launch_as<double>(def, loop, scalars, accumulating, s);
    case Dtype::kFloat16: return launch_as<Half>(def, loop, scalars, accumulating, s);
    case Dtype::kBFloat16: return launch_as<BFloat16>(def, loop, scalars, accumulating, s);
  }
}
#endif

namespace {

// One loop of kN operands in storage type T, as run_cuda runs an op's own functor.
template <typename T, int kN>
void launch_loop(const LaunchDef& def, const CudaLoop& loop, const void* bytes, bool accumulating,
                 cudaStream_t stream) {
  const Launched<acc_t<T>, kN> f{&def, bytes};
  if constexpr (sizeof(T) != 8) {
    if (accumulating) return launch_accumulating<T>(loop, f, stream);
  }
  if (def.every_kernel) {
    launch_elementwise<T, Kernels::kEvery>(loop, f, stream);
  } else {
    launch_elementwise<T, Kernels::kPlain>(loop, f, stream);
  }
}

using LoopLauncher = void (*)(const LaunchDef&, const CudaLoop&, const void*, bool, cudaStream_t);

template <typename T, size_t... kCounts>
constexpr std::array<LoopLauncher, sizeof...(kCounts)> launchers_of(
    std::index_sequence<kCounts...>) {
  return {&launch_loop<T, kFewestOperands + int(kCounts)>...};
}

}  // namespace

template <typename T>
void launch_as(const LaunchDef& def, const CudaLoop& loop, const double* scalars,
               bool accumulating, cudaStream_t stream) {
  using C = acc_t<T>;
  static constexpr auto kLaunchers =
      launchers_of<T>(std::make_index_sequence<kMaxLaunchedOperands - kFewestOperands + 1>());
  // F<C>'s bytes (functor_bytes): the scalars converted as an op's own launchers convert
  // them (static_cast<C>), then the Random; a few scalars on the stack, any number on the
  // heap.
  const size_t size = functor_bytes<C>(def.scalars, def.random > 0);
  alignas(alignof(Random)) unsigned char local[256] = {};
  std::unique_ptr<uint64_t[]> heap;
  unsigned char* bytes = local;
  if (size > sizeof(local)) {
    heap.reset(new uint64_t[(size + 7) / 8]());
    bytes = reinterpret_cast<unsigned char*>(heap.get());
  }
  for (int s = 0; s < def.scalars; ++s) {
    const C value = static_cast<C>(scalars[s]);
    std::memcpy(bytes + s * sizeof(C), &value, sizeof(C));
  }
  if (def.random > 0) std::memcpy(bytes + size - sizeof(Random), loop.random, sizeof(Random));
  kLaunchers[loop.num_operands - kFewestOperands](def, loop, bytes, accumulating, stream);
}

#if FUSEGEN_LAUNCH_ALL || FUSEGEN_LAUNCH_PART == 1
template void launch_as<float>(const LaunchDef&, const CudaLoop&, const double*, bool,
                               cudaStream_t);
#endif
#if FUSEGEN_LAUNCH_ALL || FUSEGEN_LAUNCH_PART == 2
template void launch_as<double>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                cudaStream_t);
#endif
#if FUSEGEN_LAUNCH_ALL || FUSEGEN_LAUNCH_PART == 3
template void launch_as<Half>(const LaunchDef&, const CudaLoop&, const double*, bool, cudaStream_t);
#endif
#if FUSEGEN_LAUNCH_ALL || FUSEGEN_LAUNCH_PART == 4
template void launch_as<BFloat16>(const LaunchDef&, const CudaLoop&, const double*, bool,
                                  cudaStream_t);
#endif

}  // namespace fusegen

#endif  // FUSEGEN_WITH_CUDA
