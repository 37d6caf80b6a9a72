// fusegen-random.h: the random numbers of an op that draws them (torch.rand_like, dropout),
// host and device. No torch headers: the kernels include it.
//
// Counter-based Philox4x32-10, as torch's CUDA generator feeds curand: the key is the
// generator's seed, and element i of stream s (the op's s-th rand_like) takes word i % 4 of
// the block at counter {i / 4, offset + s}, where `offset` is the generator's offset for
// this call. A coarse stream (a dropout's, whose value is only compared with a
// probability) draws 16 bits per element: element i takes half i % 2 of word (i % 8) / 2
// of the block at counter {i / 8, offset + s}, half the Philox work. A value is a function
// of (seed, offset, i, s) alone, so every kernel kind, the CPU loop and the backward (which
// regenerates a mask instead of saving it) draw the same numbers for the same element,
// whatever their launch shape; neighbouring elements share one Philox block, which the
// vectorized kernels compute once.
#ifndef FUSEGEN_RANDOM_H_
#define FUSEGEN_RANDOM_H_

#include "fusegen-math.h"

namespace fusegen {

// The state a call draws with. On the CPU and for an eager CUDA call the runtime sets
// seed and offset; under CUDA graph capture (and in a backward, from the state its forward
// saved) the kernel reads them from device memory at seed_at and offset_at (plus
// offset_add), so that a replayed graph draws fresh numbers, as torch's own kernels do with
// at::cuda::philox::unpack. `save`: where the kernel writes {seed, offset} as it used them
// (the element of linear index 0 does), the state a backward regenerates from. `first`:
// the CPU loop's linear index of its run's first element.
struct Random {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_at = nullptr;
  const int64_t* offset_at = nullptr;
  uint64_t offset_add = 0;
  int64_t* save = nullptr;
  int64_t first = 0;
};

// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
struct PhiloxBlock {
  uint32_t word[4];
};

FUSEGEN_HD PhiloxBlock philox(uint64_t seed, uint64_t group, uint64_t stream) {
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    // Each round multiplies two words into 64-bit products. On the device the high and low
    // halves come from __umulhi and a 32-bit multiply: written as one 64-bit product, nvcc
    // carried the whole block in 64-bit registers (64-bit multiplies, xors and masks, about
    // three times the instructions).
#if defined(__CUDA_ARCH__)
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
#else
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
#endif
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c1 = lo1;
    c3 = lo0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// A 32-bit word as a float in [0, 1): its top 24 bits times 2^-24, exact in float, never 1,
// so `u < 1 - p` keeps every element at p = 0 and none at p = 1.
template <typename A>
FUSEGEN_HD A uniform_of(uint32_t bits) {
  return static_cast<A>(static_cast<float>(bits >> 8) * 5.9604644775390625e-08f);
}

// 16 bits as a float in [0, 1): times 2^-16, so a comparison with 1 - p keeps an element
// with probability 1 - p rounded up to a multiple of 2^-16 (p = 0 and p = 1 stay exact).
template <typename A>
FUSEGEN_HD A coarse_uniform_of(uint32_t bits16) {
  return static_cast<A>(static_cast<float>(bits16) * 1.52587890625e-05f);
}

// The seed and offset the call draws with (device memory first), and the state saved for
// the backward by the element of index 0.
FUSEGEN_HD void random_state(const Random& r, uint64_t first, uint64_t& seed,
                                    uint64_t& offset) {
  if (r.seed_at != nullptr) {
    seed = static_cast<uint64_t>(*r.seed_at);
    offset = static_cast<uint64_t>(*r.offset_at) + r.offset_add;
  } else {
    seed = r.seed;
    offset = r.offset;
  }
  if (r.save != nullptr && first == 0) {
    r.save[0] = static_cast<int64_t>(seed);
    r.save[1] = static_cast<int64_t>(offset);
  }
}

// Word k of a block, chosen by compares rather than an index: a block indexed at run time
// (the CPU loop's runs, a 4-element vector of a coarse stream) would live in local memory.
FUSEGEN_HD uint32_t word_at(const PhiloxBlock& b, int k) {
  return k < 2 ? (k == 0 ? b.word[0] : b.word[1]) : (k == 2 ? b.word[2] : b.word[3]);
}

// kStreams uniforms for each of the kCount elements from linear index `first` on: one
// Philox block per stream and four elements (eight for a coarse stream, bit s of kCoarse).
// kAlign: `first` and kCount are multiples of it (a vector kernel's width; 1 for any run),
// so the blocks of an aligned vector fall at fixed places.
template <int kStreams, int kCount, int kAlign, uint32_t kCoarse, typename A>
FUSEGEN_HD void uniforms(const Random& r, uint64_t first, A (&u)[kCount][kStreams]) {
  uint64_t seed, offset;
  random_state(r, first, seed, offset);
  PhiloxBlock block[kStreams];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int e = 0; e < kCount; ++e) {
    const uint64_t i = first + static_cast<uint64_t>(e);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int s = 0; s < kStreams; ++s) {
      const bool coarse = (kCoarse >> s) & 1u;
      const int per = coarse ? 8 : 4;  // elements per block
      // The element's place in its block: a constant where vectors are aligned to blocks.
      const int at = kAlign % per == 0 ? e % per : static_cast<int>(i % per);
      if (kAlign % per == 0 ? at == 0 : (e == 0 || at == 0))
        block[s] = philox(seed, i / per, offset + s);
      const uint32_t word = word_at(block[s], coarse ? at / 2 : at);
      u[e][s] = coarse ? coarse_uniform_of<A>(at % 2 ? word >> 16 : word & 0xffffu)
                       : uniform_of<A>(word);
    }
  }
}

// How many random streams a functor draws (F::kRandom; 0 for a functor without one), and
// which of them are coarse (F::kCoarse, a bit per stream).
template <typename F>
constexpr auto random_streams(int) -> decltype(int(F::kRandom)) {
  return F::kRandom;
}
template <typename F>
constexpr int random_streams(long) {
  return 0;
}
template <typename F>
constexpr int kRandomOf = random_streams<F>(0);
template <typename F>
constexpr auto coarse_streams(int) -> decltype(uint32_t(F::kCoarse)) {
  return F::kCoarse;
}
template <typename F>
constexpr uint32_t coarse_streams(long) {
  return 0;
}
template <typename F>
constexpr uint32_t kCoarseOf = coarse_streams<F>(0);

// F on one element of linear index i: a functor that draws takes its uniforms, f(x, u, y).
template <typename F, typename A>
FUSEGEN_HD void call(const F& f, const A* x, A* y, uint64_t i) {
  if constexpr (kRandomOf<F> > 0) {
    A u[1][kRandomOf<F>];
    uniforms<kRandomOf<F>, 1, 1, kCoarseOf<F>>(f.random, i, u);
    f(x, u[0], y);
  } else {
    (void)i;
    f(x, y);
  }
}

}  // namespace fusegen

#endif  // FUSEGEN_RANDOM_H_
