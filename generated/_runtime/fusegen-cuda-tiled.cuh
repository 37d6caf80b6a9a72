// fusegen-cuda-tiled.cuh: the kernel of transposed inputs, through shared-memory tiles.
#ifndef FUSEGEN_CUDA_TILED_CUH_
#define FUSEGEN_CUDA_TILED_CUH_

#include "fusegen-cuda-common.cuh"

namespace fusegen {

// An input contiguous along the loop's dimension 1 while the outputs are contiguous along
// dimension 0 (a transposed input: TensorIterator orders the loop by the first input's
// strides, so the others are read across): element by element, a warp would touch 32 rows
// for one load. Tiles instead: such inputs come in through shared memory, a warp reading
// along their rows, and leave it transposed; the other operands are read and written
// directly, a warp along dimension 0. One block per tile: blockIdx.x and .y its place
// along dimensions 0 and 1 (no division: 64-bit ones cost more than the tile's own work),
// blockIdx.z the index over the outer dimensions (2 and up), turned into offsets once per
// block.
//
// A lane moves P elements per access, P * sizeof(T) bytes: P = 1, or for 2-byte types 4
// (8 bytes) or 2 (4 bytes), the widest that launch_tiled finds every access of whole and
// aligned. Narrow accesses leave the kernel issue-bound on its 64-bit address and bounds
// arithmetic (the H200, bf16 a*b+c with two tiled inputs: 70 % of issue slots busy at
// 2.6 TB/s), so an access's address is one 64-bit add to the one before it (each
// operand's accesses are an affine function of the access's number, with byte steps the
// host works out for the operand's layout: TileLoop::step_*), and a tile inside the loop
// (all but those at its ends) loads with no bounds checks: a branch per block to the
// checked copy of the loads. That path takes about 45 SASS instructions per element for
// fp32, 31 for pairs and 20 for fours (sm_90; fours: 80 registers for a*b+c, 3 blocks of
// 256 threads per SM, and capped at 64 registers it spills).
// A tile is 32 * P elements along dimension 0 (a warp of accesses) by kTileWidth along 1,
// 8 accesses per thread and operand: fp32 32 x 64, pairs 64 x 64, fours 128 x 64 (8.1, 8.1
// and 16.3 KiB of shared memory per tiled input: three tiled inputs of fours take pairs).
// FUSEGEN_TILE_COLS (32 or 64) only to compare the two for P = 1 on a GPU
// (tests/gpu/h200_run.sh); a tile of 2-byte types in pairs or fours is 64 wide, one
// 128-byte line of a tiled input's row (the bank analysis below is for that width).
#ifndef FUSEGEN_TILE_COLS
#define FUSEGEN_TILE_COLS 64
#endif
constexpr int kTile = 32;                     // along dimension 0: a warp, in accesses
constexpr int kTileCols = FUSEGEN_TILE_COLS;  // along dimension 1, for P = 1
constexpr int kTileRows = kThreads / kTile;   // the warps of a block
template <typename T>
constexpr int kPack = sizeof(T) == 2 ? 4 : 1;  // the widest P of T (fp64 never comes here)
template <int P> constexpr int kTileHeight = kTile * P;  // along dimension 0, in elements
template <int P> constexpr int kTileWidth = P == 1 ? kTileCols : 64;
template <int P>
constexpr int kTilePer = kTileWidth<P> / kTileRows;  // accesses per thread and operand
// A tiled input's loads: kTileLanes lanes along one of its rows (the tile's width in
// accesses, a warp at most), kTileGroup rows a warp access, kTileSpan warp accesses a row.
template <int P> constexpr int kTileLanes = kTileWidth<P> / P < kTile ? kTileWidth<P> / P : kTile;
template <int P> constexpr int kTileGroup = kTile / kTileLanes<P>;
template <int P> constexpr int kTileSpan = kTileWidth<P> / (P * kTileLanes<P>);
// Shared memory per tiled input: 32 rows of kTileStride units, a unit one access (P
// elements of T): the tile's width and one spare 4-byte word or one spare unit, whichever
// is larger, so that a row is an odd number of words, or of units (no bank conflicts,
// below). kTileBanks units fill the 32 banks once.
template <typename T, int P> constexpr int kTileUnit = P * int(sizeof(T));
template <typename T, int P>
constexpr int kTileStride = kTileWidth<P> + (kTileUnit<T, P> < 4 ? 4 / kTileUnit<T, P> : 1);
template <typename T, int P> constexpr int kTileBanks = 128 / kTileUnit<T, P>;

// An access of P elements in registers and in shared memory. A pair or a four is 32-bit
// words (element 0 in the low half of word 0, as in memory) until the math, so that nvcc
// keeps a loaded access in whole registers: as a Vec of two 16-bit values, it split each
// pair right at its load, a use that waits for the data (and 95 registers instead of 46
// for a*b+c).
template <int kWords>
struct alignas(4 * kWords) Words {
  uint32_t w[kWords];
};
template <typename T, int P>
using TileAccess = std::conditional_t<P == 1, Vec<T, 1>, Words<P * int(sizeof(T)) / 4>>;

#if FUSEGEN_DEVICE_CODE
template <typename T, int P>
__device__ __forceinline__ Vec<T, P> unpack(const TileAccess<T, P>& a) {
  static_assert(sizeof(TileAccess<T, P>) == sizeof(Vec<T, P>), "an access is P elements");
  Vec<T, P> v;
  memcpy(&v, &a, sizeof v);
  return v;
}

// One access at `a`, or (`repeated`, P > 1) the one element there in the low half of
// word 0, copied to the others after every load is issued: a select of two loads, no branch.
template <typename T, int P>
__device__ __forceinline__ TileAccess<T, P> load_access(const char* a, bool repeated) {
  if constexpr (P == 1) {
    return *reinterpret_cast<const TileAccess<T, P>*>(a);
  } else {
    TileAccess<T, P> x;
    if (repeated) {
      x.w[0] = *reinterpret_cast<const uint16_t*>(a);
    } else {
      x = *reinterpret_cast<const TileAccess<T, P>*>(a);
    }
    return x;
  }
}
#endif  // FUSEGEN_DEVICE_CODE

constexpr int8_t kDirect = -1;
constexpr int8_t kRepeated = -2;

template <int kN>
struct TileLoop {
  int64_t size0, size1;
  int64_t stride0[kN], stride1[kN];
  // The byte steps of operand k's accesses e = P * (S * m + n) + q along m, n and q
  // (tiled_place, direct_place): launch_tiles works them out for its P.
  int64_t step_m[kN], step_n[kN], step_q[kN];
  // The shared-memory tile of input k, or how it is read directly: kDirect, or kRepeated
  // (a step of 0 along dimension 0: with P > 1, one element loaded per access).
  int8_t slot[kN];
  OffsetCalculator<kN, uint64_t> outer;
};

// Where access e (< kTilePer) of thread (lane, row) = (threadIdx.x % 32, threadIdx.x / 32)
// lies: its first element, along dimensions 0 and 1 from the tile's first. With
// R = kTileRows (8), L = kTileLanes, G = kTileGroup, S = kTileSpan and e = P * (S * m + n) + q
// (q < P, n < S):
// - direct (a direct input, an output, and the read of a shared tile): the P elements
//   (P * lane + c, row + R * e), c < P: a warp along dimension 0 (a repeated input: its
//   element (P * lane, ...) once, copied to the others after the loads);
// - tiled (a tiled input's loads): the P elements (P * (lane / L + G * (row + R * m)) + q,
//   P * (lane % L + L * n) + c), c < P: L lanes along a row of the input, G rows a warp
//   access. Accesses P * b to P * b + P - 1 (block b = S * m + n) are P x P elements, P
//   consecutive rows of P.
// Both are affine in lane / L, lane % L, row, m, n and q, so that an operand's accesses
// are its first one and byte steps along m, n and q (TileLoop::step_*).
struct TilePlace {
  int d0, d1;
};

template <int P>
FUSEGEN_HD_CONSTEXPR TilePlace direct_place(int lane, int row, int e) {
  return {P * lane, row + kTileRows * e};
}

template <int P>
FUSEGEN_HD_CONSTEXPR TilePlace tiled_place(int lane, int row, int e) {
  constexpr int L = kTileLanes<P>;
  constexpr int S = kTileSpan<P>;
  const int b = e / P;
  return {P * (lane / L + kTileGroup<P> * (row + kTileRows * (b / S))) + e % P,
          P * (lane % L + L * (b % S))};
}

// Shared memory, per tiled input: unit [w][x] (w < 32, x < kTileWidth) holds the P
// elements (P * w + q, x), q < P, along dimensions 0 and 1 from the tile's first, as the
// direct access of lane w does: a block, transposed in registers, is units [w][x + c]
// (c < P, (P * w, x) = tiled_place(block's first access)), and the thread's direct access
// r afterwards is unit [lane][row + R * r]. Unit [w][x] is stored at column x ^ h(x),
// h(x) = x / kTileBanks % P (a swizzle of the columns within a block's P: P = 1 none).
// No bank conflicts (a warp's 4-byte units are one wavefront of the 32 banks, 8-byte
// ones two, half a warp each, the 16 8-byte bank pairs once):
// - a column read (unit [lane][x], x one for the warp, so is h(x)): a row is an odd number
//   of words or units (kTileStride), so 32 (or 16) lanes on consecutive rows hit distinct
//   banks;
// - a row write (a block's column c: unit [w][P * v + c], v = lane % L, w one for each L
//   lanes): P = 1 consecutive units (2-byte ones two lanes to a word); pairs (L = 32) put
//   lane v's column c at 2 * v + (c ^ v / 16): the lower half-warp on even banks and the
//   upper one on odd ones (or the other way); fours (L = 16, two rows a warp, one per
//   half-warp) at 4 * v + (c ^ v / 4 % 4): the 16 bank pairs of 4 * (v % 4) + 0..3 once.
#if FUSEGEN_DEVICE_CODE
template <typename T, int P, typename F>
__global__ void __launch_bounds__(kThreads)
    tiled_kernel(Pointers<F::kInputs + F::kOutputs> p, TileLoop<F::kInputs + F::kOutputs> loop,
                 F f) {
  constexpr int kIn = F::kInputs;
  constexpr int kOut = F::kOutputs;
  constexpr int kPer = kTilePer<P>;
  constexpr int S = kTileSpan<P>;
  constexpr int kBanks = kTileBanks<T, P>;
  using A = TileAccess<T, P>;  // values stay in the storage type until the math
  extern __shared__ __align__(16) unsigned char tile_bytes[];
  auto tile = reinterpret_cast<A(*)[kTile][kTileStride<T, P>]>(tile_bytes);
  const int64_t first0 = int64_t(blockIdx.x) * kTileHeight<P>;
  const int64_t first1 = int64_t(blockIdx.y) * kTileWidth<P>;
  // The extent of the tile inside the loop: all of it but at the loop's ends.
  const int rows0 = static_cast<int>(min(loop.size0 - first0, int64_t(kTileHeight<P>)));
  const int rows1 = static_cast<int>(min(loop.size1 - first1, int64_t(kTileWidth<P>)));
  const auto inside = [&](TilePlace at) { return at.d0 < rows0 && at.d1 < rows1; };
  int64_t base[kIn + kOut];
  loop.outer.template offsets<true>(blockIdx.z, base);
  const int lane = threadIdx.x % kTile;
  const int row = threadIdx.x / kTile;
  // Operand k's access e of this thread, in one of the two places.
  const auto place = [&](bool tiled, int e) {
    return tiled ? tiled_place<P>(lane, row, e) : direct_place<P>(lane, row, e);
  };
  const auto first = [&](int k, bool tiled) {
    const TilePlace at = place(tiled, 0);
    return p.p[k] + base[k] + (first0 + at.d0) * loop.stride0[k] +
           (first1 + at.d1) * loop.stride1[k];
  };
  const auto step = [&](int k, int e) {
    return e / (P * S) * loop.step_m[k] + e / P % S * loop.step_n[k] + e % P * loop.step_q[k];
  };
  // Every load first, into registers, with no branch between them (but the bounds of a
  // tile at the edges), so that all of them are in flight at once (with a branch per
  // operand, nvcc waited for each load before the next: 28 registers, half the copy rate);
  // the places above. Then the tiled inputs go through shared memory, which transposes them.
  A x[kPer][kIn > 0 ? kIn : 1];
  const auto load = [&](auto edge) {
#pragma unroll
    for (int j = 0; j < kIn; ++j) {
      const int k = kOut + j;
      const bool tiled = loop.slot[k] >= 0;
      const char* at = first(k, tiled);
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        if (decltype(edge)::value && !inside(place(tiled, e))) {
          x[e][j] = A{};  // never stored: a value for the transpose
        } else {
          x[e][j] = load_access<T, P>(at + step(k, e), loop.slot[k] == kRepeated);
        }
      }
    }
  };
  if (rows0 == kTileHeight<P> && rows1 == kTileWidth<P>) {
    load(std::false_type{});
  } else {
    load(std::true_type{});
  }
#pragma unroll
  for (int j = 0; j < kIn; ++j) {
    const int s = loop.slot[kOut + j];
    if (s < 0) continue;
#pragma unroll
    for (int b = 0; b < kPer / P; ++b) {
      A column[P];  // column[c]: the block's column c, P elements along dimension 0
      if constexpr (P == 1) {
        column[0] = x[b][j];
      } else {  // word i of a column: its rows 2 * i and 2 * i + 1
#pragma unroll
        for (int c = 0; c < P; ++c) {
#pragma unroll
          for (int i = 0; i < P / 2; ++i) {
            column[c].w[i] = __byte_perm(x[P * b + 2 * i][j].w[c / 2],
                                         x[P * b + 2 * i + 1][j].w[c / 2], c % 2 ? 0x7632 : 0x5410);
          }
        }
      }
      const TilePlace at = tiled_place<P>(lane, row, P * b);
      const int h =
          at.d1 / kBanks % P;  // the same for the block's P columns (kBanks is a multiple of P)
#pragma unroll
      for (int c = 0; c < P; ++c) tile[s][at.d0 / P][at.d1 + (c ^ h)] = column[c];
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kIn; ++j) {
    const int s = loop.slot[kOut + j];
    if (s >= 0) {
      // Column x = row + R * r at x ^ h(x) = R * r + (row ^ h(R * r)): row < R, and R
      // divides kBanks.
#pragma unroll
      for (int r = 0; r < kPer; ++r)
        x[r][j] = tile[s][lane][kTileRows * r + (row ^ (kTileRows * r / kBanks % P))];
    } else if constexpr (P > 1) {
      if (s == kRepeated) {
#pragma unroll
        for (int r = 0; r < kPer; ++r) {
#pragma unroll
          for (int i = 0; i < P / 2; ++i)
            x[r][j].w[i] = __byte_perm(x[r][j].w[0], 0, 0x1010);  // the low half twice
        }
      }
    }
  }
  char* out[kOut];
  bool wanted[kOut];
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    out[k] = first(k, false);
    wanted[k] = p.p[k] != nullptr;
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    if (inside(direct_place<P>(lane, row, r))) {
      Vec<T, P> in[kIn > 0 ? kIn : 1];
      Vec<T, P> y[kOut];
#pragma unroll
      for (int j = 0; j < kIn; ++j) in[j] = unpack<T, P>(x[r][j]);
      compute_vector(in, y, f);
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        if (wanted[k]) *reinterpret_cast<Vec<T, P>*>(out[k]) = y[k];
      }
    }
#pragma unroll
    for (int k = 0; k < kOut; ++k)
      out[k] += loop.step_q[k];  // a direct place: access e at e * step_q
  }
}
#endif  // FUSEGEN_DEVICE_CODE

#ifdef FUSEGEN_RTC_HOST
template <typename T, int P, typename F>
const KernelRef& tiled_kernel_ref(const F& f) {
  struct Name {
    static std::string get([[maybe_unused]] const LaunchDef* def) {
      return kernel_name("fusegen::tiled_kernel", TypeName<T>::get(), P, functor_name<F>(def));
    }
  };
  return kernel_ref<Name>(f);
}
#endif

}  // namespace fusegen

#endif  // FUSEGEN_CUDA_TILED_CUH_
