// fusegen-random.h: the random numbers of an op that draws them (torch.rand_like, dropout),
// host and device. No torch headers: the kernels include it.
//
// Counter-based Philox4x32-10, as torch's CUDA generator feeds curand: the key is the
// generator's seed, and element i of stream s (the op's s-th rand_like) takes word i % 4 of
// the block at counter {i / 4, offset + s}, where `offset` is the generator's offset for
// this call. A coarse stream (a dropout's, whose value is only compared with a
// probability) draws 16 bits per element: element i takes half i % 2 of word (i % 8) / 2
// of the block at counter {i / 8, offset + s}, half the Philox work. A value is a function
// of (seed, offset, i, s) alone, so every kernel kind, the CPU loop and the backward draw
// the same numbers for the same element, whatever their launch shape; neighbouring elements
// share one Philox block, which the vectorized kernels compute once. A coarse stream's
// comparison (F::kept) is all its backward needs: the forward that returns its state
// (`<name>_sampled`) also saves one bit per element of each coarse stream, and the backward
// reads the bit instead of drawing again (Random::kept_from).
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
// The kept bits of the coarse streams (save_kept): `kept`, where a forward that saves its
// state ORs them in (zeroed first); `kept_from`, where a backward reads them in place of
// the coarse streams' draws. Coarse stream c (the c-th set bit of F::kCoarse) has
// kept_words 32-bit words from word c * kept_words on; element i is bit i % 32 of its
// word i / 32.
struct Random {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_at = nullptr;
  const int64_t* offset_at = nullptr;
  uint64_t offset_add = 0;
  int64_t* save = nullptr;
  int64_t first = 0;
  uint32_t* kept = nullptr;
  const uint32_t* kept_from = nullptr;
  uint64_t kept_words = 0;
};

// The 32-bit words of one coarse stream's kept bits for n elements: a whole number of
// 64-bit words, so that every coarse stream's bits fill whole int64 elements of the state
// tensor after its {seed, offset}.
FUSEGEN_HD constexpr uint64_t kept_words_of(uint64_t n) { return (n + 63) / 64 * 2; }

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

// The place of stream s among the coarse streams of kCoarse (its kept bits' block).
FUSEGEN_HD constexpr uint64_t coarse_index(uint32_t coarse, int s) {
  uint64_t c = 0;
  for (int t = 0; t < s; ++t) c += (coarse >> t) & 1u;
  return c;
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
// A coarse stream whose kept bits are given (Random::kept_from) takes 0 for a kept element
// and 1 for a dropped one instead of its draw: its dropout's comparison, u < 1 - p, then
// keeps the same elements (a kept element had 1 - p > u >= 0; 1 < 1 - p never holds).
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
      if (coarse && r.kept_from != nullptr) {
        const uint32_t* words = r.kept_from + coarse_index(kCoarse, s) * r.kept_words;
        u[e][s] = static_cast<A>((words[i / 32] >> (i % 32)) & 1u ? 0 : 1);
        continue;
      }
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

// Whether F reports which elements its coarse streams keep (F::kKeeps: a forward's functor
// has kept(u), bit s for stream s), so that a forward can save them for its backward.
template <typename F>
constexpr auto keeps(int) -> decltype(bool(F::kKeeps)) {
  return F::kKeeps;
}
template <typename F>
constexpr bool keeps(long) {
  return false;
}
template <typename F>
constexpr bool kKeepsOf = keeps<F>(0);

// ORs `bits` into the word at `at`. The writers of one word are neighbouring elements of a
// run or of a warp's vectors: on the device the lanes of a warp that share the word
// combine their bits first, one atomic per word instead of one per lane.
FUSEGEN_HD void or_bits(uint32_t* at, uint32_t bits) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  const unsigned same =
      __match_any_sync(__activemask(), reinterpret_cast<unsigned long long>(at));
  bits = __reduce_or_sync(same, bits);
  if ((threadIdx.x & 31u) != static_cast<unsigned>(__ffs(same) - 1)) return;
#endif
  if (bits != 0) atomicOr(at, bits);
#else
  if (bits != 0) __atomic_fetch_or(at, bits, __ATOMIC_RELAXED);
#endif
}

// Saves the kept bits of elements first .. first + count - 1 (count <= kCount), whose
// uniforms are u, into Random::kept, when F reports them and the call saves its state.
template <typename F, int kCount, int kStreams, typename A>
FUSEGEN_HD void save_kept(const F& f, uint64_t first, const A (&u)[kCount][kStreams],
                          int count = kCount) {
  if constexpr (kKeepsOf<F>) {
    if (f.random.kept == nullptr) return;
    uint32_t kept[kCount];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int e = 0; e < kCount; ++e) kept[e] = e < count ? f.kept(u[e]) : 0u;
    uint64_t c = 0;
    for (int s = 0; s < kStreams; ++s) {
      if (!((kCoarseOf<F> >> s) & 1u)) continue;
      uint32_t* words = f.random.kept + c++ * f.random.kept_words;
      uint64_t word = first / 32;
      uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int e = 0; e < kCount; ++e) {
        if (e >= count) break;
        const uint64_t i = first + static_cast<uint64_t>(e);
        if (i / 32 != word) {
          or_bits(words + word, bits);
          word = i / 32;
          bits = 0;
        }
        bits |= ((kept[e] >> s) & 1u) << (i % 32);
      }
      or_bits(words + word, bits);
    }
  } else {
    (void)f;
    (void)first;
    (void)u;
    (void)count;
  }
}

// F on one element of linear index i: a functor that draws takes its uniforms, f(x, u, y).
template <typename F, typename A>
FUSEGEN_HD void call(const F& f, const A* x, A* y, uint64_t i) {
  if constexpr (kRandomOf<F> > 0) {
    A u[1][kRandomOf<F>];
    uniforms<kRandomOf<F>, 1, 1, kCoarseOf<F>>(f.random, i, u);
    save_kept(f, i, u);
    f(x, u[0], y);
  } else {
    (void)i;
    f(x, y);
  }
}

}  // namespace fusegen

#endif  // FUSEGEN_RANDOM_H_
