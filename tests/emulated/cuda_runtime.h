// A host stand-in for the CUDA pieces templates/fusegen-cuda.cuh uses, so that its kernels
// run on the CPU (tests/test_tiled_emulated.py): a launch runs one block at a time, its
// threads as std::threads that meet at a std::barrier for __syncthreads; the block's shared
// memory is one global array. Warp collectives and atomics (the accumulating kernel's) are
// not emulated: they abort.
#pragma once
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)
#define __launch_bounds__(...)

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local uint3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;
using cudaStream_t = void*;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount };
inline int cudaGetDevice(int* device) {
  *device = 0;
  return 0;
}
inline int cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = 132;
  return 0;
}
template <class K>
int cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, K, int, size_t) {
  *blocks = 4;
  return 0;
}

inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline uint64_t __umul64hi(uint64_t a, uint64_t b) { return static_cast<uint64_t>((unsigned __int128)a * b >> 64); }
// Byte i of the result is byte (s >> 4i) & 7 of b:a (a bytes 0-3, b bytes 4-7).
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = uint64_t(b) << 32 | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned(v >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(x); }
template <class T>
T min(T a, T b) {
  return a < b ? a : b;
}

[[noreturn]] inline void emulator_lacks(const char* what) {
  fprintf(stderr, "not emulated: %s\n", what);
  abort();
}
inline float atomicAdd(float*, float) { emulator_lacks("atomicAdd"); }
inline unsigned __ballot_sync(unsigned, bool) { emulator_lacks("__ballot_sync"); }
template <class T>
T __shfl_down_sync(unsigned, T, int) {
  emulator_lacks("__shfl_down_sync");
}
template <class T>
T __shfl_up_sync(unsigned, T, int) {
  emulator_lacks("__shfl_up_sync");
}

inline std::barrier<>* block_barrier;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
alignas(16) inline unsigned char tile_bytes[48 * 1024];  // the tiled kernel's shared memory
inline float column_sums[1];                            // the accumulating kernel's (not run)

// Each launch's grid and dynamic shared memory, for the test to read back.
struct Launch {
  dim3 grid;
  size_t shared;
};
inline std::vector<Launch> launches;

// kernel<<<grid, threads, shared, stream>>>(args...), as the test rewrites it.
template <class K, class... Args>
void emulate_launch(K kernel, dim3 grid, int threads, size_t shared, cudaStream_t, const Args&... args) {
  launches.push_back({grid, shared});
  gridDim = grid;
  blockDim = dim3(threads);
  std::barrier<> barrier(threads);
  block_barrier = &barrier;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        memset(tile_bytes, 0xcd, sizeof tile_bytes);  // what a block left is not the next one's
        std::vector<std::thread> block;
        for (int t = 0; t < threads; ++t) {
          block.emplace_back([&, t] {
            threadIdx = {unsigned(t), 0, 0};
            blockIdx = {x, y, z};
            kernel(args...);
          });
        }
        for (std::thread& thread : block) thread.join();
      }
    }
  }
}
