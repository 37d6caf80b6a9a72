"""Which launch shape of the contiguous kernel reaches the copy rate: the
kernel of templates/fusegen-cuda.cuh rewritten with its block size, unroll (16-byte
vectors per input per thread before any math) and grid cap as parameters, for a 3-input
op (a*b+c) and a 1-input op (silu), fp32 and bf16, n = 2^27, against torch's copy_ of the
same bytes and jiterator. Built with nvcc alone (no torch header: a few seconds) and
called through ctypes on torch's current stream. Medians of CUDA-event times.

    PYTHONPATH=. python3 tests/gpu/kernel_probe.py
"""
import ctypes
import itertools
import pathlib
import statistics
import subprocess
import tempfile

import torch

TEMPLATES = pathlib.Path(__file__).resolve().parents[2] / "templates"
SOURCE = r"""
#include "fusegen-cuda.cuh"
using namespace fusegen;

struct Fma { static constexpr int kInputs = 3, kOutputs = 1;
  __device__ void operator()(const float (&x)[3], float (&y)[1]) const { y[0] = x[0] * x[1] + x[2]; } };
struct Silu { static constexpr int kInputs = 1, kOutputs = 1;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = x[0] / (1.0f + expf(-x[0])); } };

template <typename T, typename F, int kT, int kU>
__global__ void __launch_bounds__(kT) probe_kernel(Pointers<F::kInputs + 1> p, int64_t n, F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kVec = kVecWidth<T>;
  constexpr int64_t kChunk = int64_t(kT) * kU;
  const int64_t n_vec = n / kVec;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + threadIdx.x; base < n_vec; base += int64_t(gridDim.x) * kChunk) {
    Vec<T, kVec> x_v[kU][kIn];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (base + u * kT >= n_vec) continue;
#pragma unroll
      for (int j = 0; j < kIn; ++j) x_v[u][j] = load<kVec>(reinterpret_cast<const T*>(p.p[1 + j]), base + u * kT);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (base + u * kT >= n_vec) continue;
      Vec<T, kVec> y_v[1];
      compute_vector(x_v[u], y_v, f);
      store<kVec>(reinterpret_cast<T*>(p.p[0]), base + u * kT, y_v[0]);
    }
  }
}

template <typename T, typename F, int kT, int kU>
void launch(char** ptrs, int64_t n, int waves, cudaStream_t s) {
  Pointers<F::kInputs + 1> p;
  for (int k = 0; k < F::kInputs + 1; ++k) p.p[k] = ptrs[k];
  auto kernel = probe_kernel<T, F, kT, kU>;
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kT, 0);
  const int64_t blocks = (n / kVecWidth<T> + int64_t(kT) * kU - 1) / (int64_t(kT) * kU);
  const int64_t cap = waves > 0 ? int64_t(sm_count()) * per_sm * waves : blocks;
  kernel<<<unsigned(blocks < cap ? blocks : cap), kT, 0, s>>>(p, n, F{});
}

// variant = dtype(0 fp32, 1 bf16) * 12 + op(0 fma, 1 silu) * 6 + threads(0: 128, 1: 256) * 3 + unroll(1, 2, 4)
extern "C" int probe(int variant, char** ptrs, int64_t n, int waves, void* stream) {
  using L = void (*)(char**, int64_t, int, cudaStream_t);
  static const L table[] = {
#define ROW(T, F) launch<T, F, 128, 1>, launch<T, F, 128, 2>, launch<T, F, 128, 4>, \
                  launch<T, F, 256, 1>, launch<T, F, 256, 2>, launch<T, F, 256, 4>
    ROW(float, Fma), ROW(float, Silu), ROW(BFloat16, Fma), ROW(BFloat16, Silu)
#undef ROW
  };
  table[variant](ptrs, n, waves, static_cast<cudaStream_t>(stream));
  return int(cudaGetLastError());
}
"""


def build() -> ctypes.CDLL:
    out = pathlib.Path(tempfile.mkdtemp()) / "probe.so"
    src = out.with_suffix(".cu")
    src.write_text(SOURCE)
    major, minor = torch.cuda.get_device_capability()
    subprocess.run(["nvcc", "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC", f"-arch=sm_{major}{minor}",
                    "-DFUSEGEN_WITH_CUDA", f"-I{TEMPLATES}", str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.probe.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    return lib


def median_ms(fn, reps=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    lib = build()
    n = 1 << 27
    stream = torch.cuda.current_stream().cuda_stream
    jit = {
        "fma": torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T a, T b, T c) { return a * b + c; }"),
        "silu": torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x / (T(1) + exp(-x)); }"),
    }
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "n =", n)
    for d, (dtype, dname) in enumerate([(torch.float32, "fp32"), (torch.bfloat16, "bf16")]):
        for o, (op, k) in enumerate([("fma", 3), ("silu", 1)]):
            xs = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(k)]
            y = torch.empty(n, device="cuda", dtype=dtype)
            src = torch.randn(n * (k + 1) // 2, device="cuda", dtype=dtype)
            dst = torch.empty_like(src)
            ptrs = (ctypes.c_void_p * (k + 1))(y.data_ptr(), *[x.data_ptr() for x in xs])
            copy = median_ms(lambda: dst.copy_(src))  # the same bytes: (k + 1) n moved
            jt = median_ms(lambda: jit[op](*xs))
            print(f"\n{op} {dname}: copy of the same bytes {copy:.4f} ms, jiterator {jt:.4f} ms ({copy / jt:.0%} of copy)")
            results = []
            for (t, threads), (u, unroll), waves in itertools.product(enumerate([128, 256]), enumerate([1, 2, 4]),
                                                                       [1, 2, 4, 0]):
                variant = d * 12 + o * 6 + t * 3 + u
                ms = median_ms(lambda: lib.probe(variant, ptrs, n, waves, stream))
                assert lib.probe(variant, ptrs, n, waves, stream) == 0
                results.append((ms, threads, unroll, waves))
            ref = xs[0] * xs[1] + xs[2] if op == "fma" else torch.nn.functional.silu(xs[0].float()).to(dtype)
            lib.probe(d * 12 + o * 6 + 4, ptrs, n, 1, stream)
            torch.cuda.synchronize()
            print("  check:", torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2))
            for ms, threads, unroll, waves in sorted(results):
                print(f"  threads {threads:3} unroll {unroll} waves {waves or 'all':>3}: {ms:.4f} ms "
                      f"({copy / ms:.0%} of copy, {jt / ms:.2f}x jiterator)")


if __name__ == "__main__":
    main()
