// Runs fusegen-cuda.cuh's launch_tiled on the CPU (cuda_runtime.h here stands in for CUDA)
// for a*b+c over hand-made loops, bf16 and fp32, and checks every output element against
// the same math element by element, that nothing else in the output's memory changed, and
// which P the launch chose (from its shared memory per tiled input). Prints one line per
// case; exits 1 if any failed. Built and run by tests/test_tiled_emulated.py.
#include <random>

#include "fusegen-cuda.cuh"
#include "fma.h"

using namespace fusegen;

// An operand's element steps along dimensions 0, 1 and 2 (the outer one), and its first
// element's offset from an allocation's start (which is 64-byte aligned).
struct Operand {
  int64_t s0, s1, s2, offset;
};

struct Case {
  const char* name;
  int64_t n0, n1, n2;
  Operand out, a, b, c;
  int pack;  // the P that 2-byte types must take (fp32: always 1)
  bool null_out;
};

constexpr Operand kOut136{1, 136, 0, 0};  // the output of a 136 x 100 loop
constexpr Operand kDirect136{1, 136, 0, 0};
constexpr Operand kTiled100{100, 1, 0, 0};

// Shared memory of one tiled input in the kernel of P (kTileUnit * 32 * kTileStride).
template <typename T, int P>
constexpr size_t kTileBytesOf = sizeof(TileAccess<T, P>) * kTile * kTileStride<T, P>;

template <typename T>
int pack_of(size_t shared_per_tile) {
  if (shared_per_tile == kTileBytesOf<T, 1>) return 1;
  if constexpr (kPack<T> >= 2) {
    if (shared_per_tile == kTileBytesOf<T, 2>) return 2;
    if (shared_per_tile == kTileBytesOf<T, 4>) return 4;
  }
  return -1;
}

template <typename T>
bool run(const Case& c) {
  constexpr int kN = 4;
  const Operand ops[kN] = {c.out, c.a, c.b, c.c};
  std::mt19937 rng(7);
  std::vector<std::vector<T>> memory(kN);
  char* data[kN];
  for (int k = 0; k < kN; ++k) {
    const Operand& o = ops[k];
    memory[k].resize(o.offset + (c.n0 - 1) * o.s0 + (c.n1 - 1) * o.s1 + (c.n2 - 1) * o.s2 + 1);  // no slack: ASan
    for (T& v : memory[k]) v = from_acc<T>(float(int(rng() % 17) - 8));  // small integers: exact math
    data[k] = reinterpret_cast<char*>(memory[k].data() + o.offset);
  }
  if (c.null_out) data[0] = nullptr;
  const std::vector<T> before = memory[0];
  const int64_t sizes[3] = {c.n0, c.n1, c.n2};
  int64_t strides[3 * kN];
  int tiled = 0;
  for (int k = 0; k < kN; ++k) {
    strides[0 * kN + k] = ops[k].s0 * int64_t(sizeof(T));
    strides[1 * kN + k] = ops[k].s1 * int64_t(sizeof(T));
    strides[2 * kN + k] = ops[k].s2 * int64_t(sizeof(T));
    tiled += k > 0 && ops[k].s1 == 1 && ops[k].s0 != 1 && ops[k].s0 != 0;
  }
  const CudaLoop loop{c.n0 * c.n1 * c.n2, c.n2 > 1 ? 3 : 2, kN, sizes, strides, data};
  launches.clear();
  const bool took = launch_tiled<T>(loop, pointers_of<kN>(loop), op_fma::Forward<float>{}, nullptr);
  const int pack = took ? pack_of<T>(launches.back().shared / tiled) : 0;
  const int want = sizeof(T) == 2 ? c.pack : 1;
  int64_t wrong = 0;
  std::vector<bool> owned(memory[0].size());
  for (int64_t i2 = 0; i2 < c.n2; ++i2) {
    for (int64_t i1 = 0; i1 < c.n1; ++i1) {
      for (int64_t i0 = 0; i0 < c.n0; ++i0) {
        float x[3];
        for (int j = 0; j < 3; ++j) {
          const Operand& o = ops[j + 1];
          x[j] = to_acc(memory[j + 1][o.offset + i0 * o.s0 + i1 * o.s1 + i2 * o.s2]);
        }
        const int64_t at = c.out.offset + i0 * c.out.s0 + i1 * c.out.s1 + i2 * c.out.s2;
        owned[at] = true;
        const float expected = c.null_out ? to_acc(before[at]) : x[0] * x[1] + x[2];
        wrong += to_acc(memory[0][at]) != expected;
      }
    }
  }
  int64_t outside = 0;  // elements written that are not the output's
  for (size_t i = 0; i < owned.size(); ++i) outside += !owned[i] && memcmp(&memory[0][i], &before[i], sizeof(T)) != 0;
  const bool ok = took && pack == want && wrong == 0 && outside == 0;
  printf("%s %s, %s: tiled kernel %s, P %d (expected %d), %ld wrong, %ld written outside\n", ok ? "ok" : "FAIL",
         sizeof(T) == 2 ? "bf16" : "fp32", c.name, took ? "ran" : "did not run", pack, want, wrong, outside);
  return ok;
}

// The loop's dimension 0 is the outputs' fastest; a tiled input steps by one element along
// dimension 1, a repeated one by none along 0. 136 x 100 is a partial tile at both ends for
// fours (128 x 64 tiles).
const Case kCases[] = {
    {"fours, edge tiles, two tiled", 136, 100, 1, kOut136, kDirect136, kTiled100, kTiled100, 4, false},
    {"fours, full and edge tiles, outer dims", 300, 260, 2, {1, 300, 78000, 0}, {1, 300, 78000, 0}, {260, 1, 78000, 0},
     {0, 1, 260, 0}, 4, false},
    {"fours, one partial tile", 24, 20, 1, {1, 24, 0, 0}, {1, 24, 0, 0}, {20, 1, 0, 0}, {20, 1, 0, 0}, 4, false},
    {"fours, a row broadcast along dimension 1", 256, 128, 1, {1, 256, 0, 0}, {1, 256, 0, 0}, {128, 1, 0, 0},
     {1, 0, 0, 0}, 4, false},
    {"fours, repeated rows at any alignment", 136, 100, 1, kOut136, kDirect136, kTiled100, {0, 1, 0, 1}, 4, false},
    {"fours, outer dims", 40, 64, 3, {1, 40, 2560, 0}, {1, 40, 2560, 0}, {64, 1, 4096, 0}, {0, 1, 64, 0}, 4, false},
    {"fours, no output wanted", 136, 100, 1, kOut136, kDirect136, kTiled100, kTiled100, 4, true},
    {"pairs: rows of 2 mod 4", 136, 102, 1, kOut136, kDirect136, {102, 1, 0, 0}, {102, 1, 0, 0}, 2, false},
    {"pairs: dimension 0 of 2 mod 4", 50, 40, 3, {1, 50, 2000, 0}, {1, 50, 2000, 0}, {40, 1, 2000, 0}, {0, 1, 0, 0}, 2,
     false},
    {"pairs: a pitch of 2 mod 4", 136, 100, 1, kOut136, {1, 138, 0, 0}, kTiled100, kTiled100, 2, false},
    {"pairs: a 4-byte aligned pointer", 136, 100, 1, kOut136, {1, 136, 0, 2}, kTiled100, kTiled100, 2, false},
    {"pairs: three tiled inputs (fours would take 49 KiB)", 136, 100, 1, kOut136, kTiled100, kTiled100,
     {104, 1, 0, 0}, 2, false},
    {"one: a 2-byte aligned pointer", 136, 100, 1, kOut136, {1, 136, 0, 1}, kTiled100, kTiled100, 1, false},
    {"one: odd rows", 70, 45, 1, {1, 70, 0, 0}, {1, 70, 0, 0}, {45, 1, 0, 0}, {45, 1, 0, 0}, 1, false},
    {"one: a direct input sliced along dimension 0", 136, 100, 1, kOut136, {2, 272, 0, 0}, kTiled100, kTiled100, 1,
     false},
};

int main() {
  int failed = 0;
  for (const Case& c : kCases) failed += !run<BFloat16>(c) + !run<float>(c);
  printf("%d failed\n", failed);
  return failed != 0;
}
