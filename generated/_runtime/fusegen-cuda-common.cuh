// fusegen-cuda-common.cuh: what every CUDA kernel of fusegen shares: the 16-bit storage
// types' conversions, 16-byte vectors, dtype dispatch, launch sizes, the operands'
// pointers, the offset calculator and F applied to one vector. No torch header: a .cu
// that includes none compiles in seconds, not half a minute.
#ifndef FUSEGEN_CUDA_COMMON_CUH_
#define FUSEGEN_CUDA_COMMON_CUH_

// Every kernel header keys its code on where it is compiled (fusegen-math.h): the kernels
// and device functions under FUSEGEN_DEVICE_CODE (nvcc, and NVRTC at run time), the
// launchers under FUSEGEN_HOST_CODE (nvcc, and the host compiler alone for the NVRTC
// route, FUSEGEN_RTC_HOST, where the launchers launch each kernel by its name).
#include "fusegen-math.h"

#if FUSEGEN_HOST_CODE && !defined(FUSEGEN_RTC_HOST)
#include <cuda_runtime.h>
#endif
#ifndef __CUDACC_RTC__
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#endif

#include "fusegen-half.h"
#include "fusegen-runtime.h"

namespace fusegen {

// fp16 and bf16 are stored narrow and computed in float, as PyTorch's opmath does. The
// storage types are fusegen-half.h's 16-bit Half and BFloat16, converted with the very
// instructions cuda_fp16.h and cuda_bf16.h use (cvt.f32.f16, cvt.rn.f16.f32, a 16-bit shift,
// cvt.rn.bf16.f32), so results are bit-identical to __half2float, __float2half_rn,
// __bfloat162float and __float2bfloat16_rn. Those two headers are not included: they cost
// about 2 s of every op's nvcc run.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <typename T> using acc_t = typename AccType<T>::type;

#if FUSEGEN_DEVICE_CODE
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(Half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.x));
  return f;
}
__device__ __forceinline__ float to_acc(BFloat16 x) {
  return __uint_as_float(static_cast<unsigned>(x.x) << 16);
}

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x) { return x; }
template <> __device__ __forceinline__ Half from_acc<Half>(float x) {
  Half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(x));
  return h;
}
template <> __device__ __forceinline__ BFloat16 from_acc<BFloat16>(float x) {
  BFloat16 b;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.x) : "f"(x));
#else
  // cuda_bf16.hpp's path before sm_80: round to nearest even, NaN to the canonical 0x7fff.
  const unsigned u = __float_as_uint(x);
  b.x = (u & 0x7fffffffu) > 0x7f800000u
            ? 0x7fff
            : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
  return b;
}
// Asks for the line at p in L2, holding no register for it (a row kernel's input that only
// its outputs read, after the passes: fusegen-cuda-rows.cuh).
__device__ __forceinline__ void prefetch_l2([[maybe_unused]] const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.L2 [%0];" ::"l"(p));
#endif
}
#endif  // FUSEGEN_DEVICE_CODE

// kVec elements moved as one 16-byte access (float4 for fp32, 8 x fp16/bf16, 2 x fp64).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};
template <typename T> constexpr int kVecWidth = 16 / sizeof(T);

#if FUSEGEN_DEVICE_CODE
template <int kVec, typename T>
__device__ __forceinline__ Vec<T, kVec> load(const T* __restrict__ base, int64_t index) {
  return reinterpret_cast<const Vec<T, kVec>*>(base)[index];
}

template <int kVec, typename T>
__device__ __forceinline__ void store(T* __restrict__ base, int64_t index,
                                      const Vec<T, kVec>& value) {
  reinterpret_cast<Vec<T, kVec>*>(base)[index] = value;
}
#endif  // FUSEGEN_DEVICE_CODE

constexpr int kThreads = 256;

// CUDA's limits for gridDim.y and .z (x goes to 2^31 - 1), and the dynamic shared memory a
// launch may ask for without opting in.
constexpr int64_t kMaxGridY = 65535;
constexpr size_t kMaxSharedBytes = 48 * 1024;

#if FUSEGEN_HOST_CODE
template <typename T> struct TypeTag { using type = T; };

// The dtypes in groups, each compiled in nvcc units of its own when a build has cores to
// spare (op_kernels.cu.j2): fp32 with fp64 (whose kernels are few: contiguous and
// strided), fp16, and bf16. The kernels of four dtypes are most of a new op's nvcc time.
enum class DtypeGroup { kWide, kHalf, kBFloat16 };

// Calls f(TypeTag<storage type>{}) for the runtime dtype, one of kGroup's: the one choice
// among dtypes.
template <DtypeGroup kGroup, typename F>
void dispatch_dtype(Dtype dtype, F&& f) {
  if constexpr (kGroup == DtypeGroup::kHalf) {
    f(TypeTag<Half>{});
  } else if constexpr (kGroup == DtypeGroup::kBFloat16) {
    f(TypeTag<BFloat16>{});
  } else if (dtype == Dtype::kFloat64) {
    f(TypeTag<double>{});
  } else {
    f(TypeTag<float>{});
  }
}

// One block per kThreads * kUnroll vectors (or elements), as many blocks as that takes:
// no cap at one wave of resident blocks. Measured on the H200 at n = 2^27
// (tests/gpu/kernel_probe.py): capping the contiguous kernel's grid at one wave and
// striding over the rest costs 5 % (a*b+c fp32) to 16 % (silu bf16) against the uncapped
// grid, which reaches the copy rate of the same bytes; the block scheduler refills an SM
// the moment a block ends, while a grid-stride loop waits for its slowest thread. The
// grid-stride loops stay, for more blocks than a grid may have.
inline unsigned grid_size(int64_t items) {
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  return static_cast<unsigned>(items < 1 ? 1 : items < kMaxBlocks ? items : kMaxBlocks);
}

// A launch's grid.
struct Grid {
  unsigned x;
  unsigned y = 1;
  unsigned z = 1;
};

#if FUSEGEN_HOST_CODE
// Whether F is a launched functor (Launched, the NVRTC route's runtime launchers).
template <typename F> struct IsLaunched : std::false_type {};
template <typename F> constexpr bool kLaunched = IsLaunched<F>::value;
#endif

#ifdef FUSEGEN_RTC_HOST
// The NVRTC route. A kernel is its name expression in the op's kernel source (the op's .cu),
// compiled for the device on its first launch by the runtime (fusegen-rtc.cpp), which
// caches the cubin on disk; each launch passes the bytes of its arguments, which are the
// kernel's parameter types exactly (the nvcc route checks that).
// FUSEGEN_KERNEL(f, kernel, template arguments) is the kernel; every kernel header defines
// `<kernel>_ref(f)`, its name from the template arguments, built once per instantiation and
// op (the runtime keys its kernels by that name's address: no string work per launch).
struct KernelRef {
  std::string name;
  const RtcSource* source;
};
#define FUSEGEN_KERNEL(f, kernel, ...) kernel##_ref<__VA_ARGS__>(f)

// An op's functor as the runtime's launchers run it (fusegen-launch.cpp, LaunchDef): the
// operand count of its loops, kN, at compile time, the rest at run time; its bytes are
// those of F<C>, the op's functor in the compute type C (its scalars, then its Random),
// which a launch passes as the kernel's last parameter. The launchers below take it where
// they take an op's own F: one instantiation per operand count serves every op.
template <typename C, int kN>
struct Launched {
  using Compute = C;
  static constexpr int kOperands = kN;
  const LaunchDef* def;
  const void* bytes;
};
template <typename C, int kN> struct IsLaunched<Launched<C, kN>> : std::true_type {};

// The kernels the runtime's launchers asked for, per op and per place in the launchers
// (`site`: one per instantiation), each built once (fusegen-launch.cpp).
const KernelRef& launched_kernel(const LaunchDef& def, const void* site,
                                 std::string (*name)(const LaunchDef* def));

// C++ spellings of the kernels' template arguments, as the kernel source declares them: the
// storage types, the index types, ints and bools, and an op's functors (F::kName<T>).
template <typename T> struct TypeName;
template <> struct TypeName<float> { static std::string get() { return "float"; } };
template <> struct TypeName<double> { static std::string get() { return "double"; } };
template <> struct TypeName<Half> { static std::string get() { return "fusegen::Half"; } };
template <> struct TypeName<BFloat16> { static std::string get() { return "fusegen::BFloat16"; } };
template <> struct TypeName<uint32_t> { static std::string get() { return "uint32_t"; } };
template <> struct TypeName<uint64_t> { static std::string get() { return "uint64_t"; } };
template <template <typename> class F, typename T>
struct TypeName<F<T>> {
  static std::string get() { return std::string(F<T>::kName) + "<" + TypeName<T>::get() + ">"; }
};

// The functor's spelling in a kernel's name: F<T>'s, or a launched op's F<C>.
template <typename F>
std::string functor_name([[maybe_unused]] const LaunchDef* def) {
  if constexpr (kLaunched<F>) {
    return std::string(def->functor) + "<" + TypeName<typename F::Compute>::get() + ">";
  } else {
    return TypeName<F>::get();
  }
}

inline std::string template_argument(const std::string& type) { return type; }
inline std::string template_argument(bool value) { return value ? "true" : "false"; }
inline std::string template_argument(int value) { return std::to_string(value); }

// `kernel<arguments...>`.
template <typename... Arguments>
std::string kernel_name(const char* kernel, const Arguments&... arguments) {
  std::string name = kernel;
  const char* separator = "<";
  for (const std::string& a : {template_argument(arguments)...}) {
    name += separator + a;
    separator = ", ";
  }
  return name + ">";
}

// The kernel `Name::get(def)` names, for F: built once per instantiation for an op's own F
// (Name is a type of the calling *_ref instantiation), once per op for a launched one.
template <typename Name, typename F>
const KernelRef& kernel_ref(const F& f) {
  if constexpr (kLaunched<F>) {
    static const char site = 0;
    return launched_kernel(*f.def, &site, &Name::get);
  } else {
    (void)f;
    static const KernelRef ref{Name::get(nullptr), &F::source()};
    return ref;
  }
}

// A launch's parameter: its bytes; a launched functor's are those it points at.
template <typename A>
const void* parameter(const A& arg) {
  return &arg;
}
template <typename C, int kN>
const void* parameter(const Launched<C, kN>& f) {
  return f.bytes;
}

template <typename... Args>
void launch(const KernelRef& kernel, Grid grid, int threads, size_t shared, cudaStream_t stream,
            const Args&... args) {
  void* params[] = {const_cast<void*>(parameter(args))...};
  const RtcShape shape{{grid.x, grid.y, grid.z}, threads, shared};
  rtc_launch(*kernel.source, kernel.name.c_str(), shape, stream, params);
}

inline int sm_count() { return rtc_sm_count(); }

// Blocks of the kernel resident on one SM at once (the runtime asks once per kernel).
inline int blocks_per_sm(const KernelRef& kernel) {
  return rtc_blocks_per_sm(*kernel.source, kernel.name.c_str(), kThreads);
}
#define FUSEGEN_BLOCKS_PER_SM(f, kernel, ...) blocks_per_sm(kernel##_ref<__VA_ARGS__>(f))
#else
#define FUSEGEN_KERNEL(f, kernel, ...) &kernel<__VA_ARGS__>

// The kernel with arguments of its parameters' types exactly, which the NVRTC route passes
// as bytes: a launch that converts an argument fails to compile here.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Grid grid, int threads, size_t shared, cudaStream_t stream,
            const Args&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args) &&
                    (std::is_same_v<std::remove_cv_t<Params>, Args> && ...),
                "a launch passes every kernel parameter in its own type");
  kernel<<<dim3(grid.x, grid.y, grid.z), threads, shared, stream>>>(args...);
}

constexpr int kMaxDevices = 64;

// Multiprocessor count of the current device, asked once per device.
inline int sm_count() {
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) device = 0;
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    count = count > 0 ? count : 1;
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Blocks of `kernel` resident on one SM at once (registers decide: a backward with many
// operands keeps fewer), asked once per kernel; the kernels are compiled for the one
// architecture of the machine that builds them, so one answer holds for its devices.
template <auto kKernel>
int blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kKernel, kThreads, 0);
    return b > 0 ? b : 1;
  }();
  return blocks;
}
#define FUSEGEN_BLOCKS_PER_SM(f, kernel, ...) blocks_per_sm<&kernel<__VA_ARGS__>>()
#endif  // FUSEGEN_RTC_HOST

// The strided kernel is the exception: its software pipeline (below) needs several
// elements per thread, and on the H200 an uncapped grid made it 10-40 % slower (a sliced
// input, fp32 and bf16), so its grid is capped at one full wave of resident blocks.
inline unsigned wave_grid_size(int64_t items, int blocks_per_sm) {
  const int64_t cap = int64_t(sm_count()) * blocks_per_sm;
  return grid_size(items < cap ? items : cap);
}
#endif  // FUSEGEN_HOST_CODE

// The data pointers of a kernel's operands, by value: outputs first (null: not wanted),
// then inputs, as the runtime's CudaLoop orders them.
template <int kN>
struct Pointers {
  char* p[kN];
};

#if FUSEGEN_HOST_CODE
template <int kN>
Pointers<kN> pointers_of(const CudaLoop& loop) {
  Pointers<kN> p;
  for (int k = 0; k < kN; ++k) p.p[k] = loop.data[k];
  return p;
}
#endif

// Division by a fixed divisor as a multiply and a shift (Granlund and Montgomery, as
// PyTorch's IntDivider): q = (umulhi(n, magic) + n) >> shift. Two widths: 32-bit, exact for
// n < 2^31 and divisor in [1, 2^31] (one mul.hi: the strided kernel's index math is most of
// its work, and a 64-bit umulhi is several instructions), and 64-bit, exact for n < 2^63
// and divisor in [1, 2^63).
template <typename U>
struct IntDivider {
  U divisor;
  U magic;
  unsigned shift;

  IntDivider() = default;
#if FUSEGEN_HOST_CODE
  explicit IntDivider(U d) : divisor(d), shift(0) {
    constexpr unsigned kBits = sizeof(U) * 8;
    while (shift < kBits - 1 && (U(1) << shift) < d) ++shift;
    __extension__ typedef unsigned __int128 Wide;  // a GCC and Clang type: no -Wpedantic warning
    const Wide one = 1;
    magic = static_cast<U>(((one << kBits) * ((one << shift) - d)) / d + 1);
  }
#endif
#if FUSEGEN_DEVICE_CODE
  __device__ __forceinline__ U div(U n) const {
    if constexpr (sizeof(U) == 4) {
      return (__umulhi(n, magic) + n) >> shift;
    } else {
      return (__umul64hi(n, magic) + n) >> shift;
    }
  }
#endif
};

// A linear element index -> the byte offset of each operand, for any layout TensorIterator
// produces (broadcast: stride 0; transposed; sliced; channels_last): sizes with dimension
// 0 the fastest, as the runtime passes them. Index is uint32_t when the element count and
// every operand's byte span fit in 31 bits (fits_32bit), else uint64_t, so more than 2^31
// elements work.
template <int kN, typename Index>
struct OffsetCalculator {
  using Offset = std::make_signed_t<Index>;
  int ndim;
  IntDivider<Index> sizes[kMaxDims];
  Offset strides[kMaxDims][kN];

  // Unrolled over kMaxDims (every size and stride an operand of the instructions, no
  // loads): the strided kernel's per-element path. Rolled (`rolled`: sizes and strides
  // read from the kernel's parameters at run time): a third of the code, for the kernels
  // that call it once per vector or per block, where a new op's nvcc time matters more
  // (the vector and tiled kernels cost +1 s per nvcc unit unrolled, +0.1 s rolled).
#if FUSEGEN_DEVICE_CODE
  template <bool kRolled = false>
  __device__ __forceinline__ void offsets(Index linear, Offset (&out)[kN]) const {
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = 0;
    Index rest = linear;
    if constexpr (kRolled) {
#pragma unroll 1
      for (int d = 0; d < ndim; ++d) step(d, rest, out);
    } else {
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        step(d, rest, out);
      }
    }
  }

  __device__ __forceinline__ void step(int d, Index& rest, Offset (&out)[kN]) const {
    const Index q = sizes[d].div(rest);
    const Offset index = static_cast<Offset>(rest - q * sizes[d].divisor);
    rest = q;
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] += index * strides[d][k];
  }
#endif
};

// The one elementwise kernel shape, for any F (Forward, Backward, or any later function of
// F::kInputs inputs and F::kOutputs outputs, fusegen-runtime.h): F runs in the compute type
// on values loaded as T.
//
// Bytes in flight: a grid-stride loop that loads one 16-byte vector per input, computes,
// stores and only then loads the next keeps one access per tensor in flight per thread.
// The contiguous kernel loads kUnroll vectors per input before any math (each one more
// copy of F's math in the kernel: compile time, a new op's nvcc run, grows with it, hence
// 2); the strided kernel keeps the next element's inputs in flight while it computes one
// (a software pipeline, so its offset calculator, the larger part of its code, has one
// call site).
constexpr int kUnroll = 2;
constexpr int kDepth = 2;

#if FUSEGEN_DEVICE_CODE
// F over the kVec elements of a vector of each input; `visit(e, x, y)` sees element e's
// inputs and outputs in the compute type, before the outputs are rounded to T (the
// accumulating kernel sums them unrounded).
struct NoVisit {
  template <typename A>
  __device__ __forceinline__ void operator()(int, const A*, const A*) const {}
};

// Element e of a vector in the compute type. A bf16 pair is read from its 32-bit word (a
// shift or a mask: bf16 is a float's upper half), so that the vector stays in words: read
// element by element, nvcc splits each word into two 16-bit registers (a byte permute
// each) and merges the loaded and repeated forms of an operand per element (48 byte
// permutes per bf16 vector of three inputs in the vector kernel, 24 in the contiguous one).
template <typename T, int kVec>
__device__ __forceinline__ acc_t<T> element(const Vec<T, kVec>& v, int e) {
  if constexpr (std::is_same_v<T, BFloat16> && kVec % 2 == 0) {
    uint32_t word;
    memcpy(&word, &v.v[e & ~1], sizeof word);
    return __uint_as_float(e % 2 ? word & 0xffff0000u : word << 16);
  } else {
    return to_acc(v.v[e]);
  }
}

// `first`: the linear index of the vector's element 0, for a functor that draws random
// numbers (fusegen-random.h): one Philox block per stream and four (coarse: eight) elements.
template <typename T, int kVec, typename F, typename Visit = NoVisit>
__device__ __forceinline__ void compute_vector(
    const Vec<T, kVec> (&x_v)[F::kInputs > 0 ? F::kInputs : 1], Vec<T, kVec> (&y_v)[F::kOutputs],
    const F& f, Visit visit = {}, uint64_t first = 0) {
  constexpr int kStreams = kRandomOf<F> > 0 ? kRandomOf<F> : 1;
  acc_t<T> u[kVec][kStreams];
  if constexpr (kRandomOf<F> > 0) uniforms<kStreams, kVec, kVec, kCoarseOf<F>>(f.random, first, u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    acc_t<T> x[F::kInputs > 0 ? F::kInputs : 1];
    acc_t<T> y[F::kOutputs];
#pragma unroll
    for (int j = 0; j < F::kInputs; ++j) x[j] = element(x_v[j], e);
    if constexpr (kRandomOf<F> > 0) {
      f(x, u[e], y);
    } else {
      (void)u;
      f(x, y);
    }
    visit(e, x, y);
#pragma unroll
    for (int k = 0; k < F::kOutputs; ++k) y_v[k].v[e] = from_acc<T>(y[k]);
  }
}
#endif  // FUSEGEN_DEVICE_CODE

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_COMMON_CUH_
