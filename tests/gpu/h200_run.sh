#!/usr/bin/env bash
# GPU facts, the seed check, the CUDA tests, the benchmarks. Logs to $OUT.
#   run from the repo root on the GPU machine:  bash tests/gpu/h200_run.sh [check|rtc|tests|bench|gp|build|optim|rope|rows|rows_profile|row_half|row_split|row_ab|dropout|block|compile|narrow|tiles|accumulating|random_width|row_unroll|vector|all]
# One mode is one device call of 1-7 minutes (H200: rtc 2.5 min, bench about 3, build 1.5,
# rows 3.5); `all` is more than the 10 minutes a call may run and brings back more than the
# 8 files a call returns, so split it over calls. The whole CUDA suite is `rtc`, `tests` and
# `rows` (on a fresh H100 the suite in one pytest ran past 380 s at 825 of its 1039 tests).
set -uo pipefail
what=${1:-all}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FUSEGEN_CACHE_DIR=${FUSEGEN_CACHE_DIR:-/tmp/fusegen-cache}
OUT=${OUT:-/tmp/fusegen-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
status=0
if [[ $what == check || $what == all ]]; then
  python3 tests/gpu/seed_check.py 2>&1 | tee "$OUT/seed_check.log"; status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == rtc || $what == all ]]; then  # the NVRTC route first, alone: its tests stop at the first failure
  python3 -m pytest -q -x -m cuda tests/gpu/test_rtc_cuda.py 2>&1 | tee "$OUT/pytest_rtc.log"; status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == tests || $what == all ]]; then
  # --maxfail: a runtime that does not build fails every test, each after its own build attempt.
  # (the NVRTC route's and the row ops' tests: modes rtc and rows)
  python3 -m pytest -q -m cuda --maxfail=5 tests/gpu --ignore=tests/gpu/test_rtc_cuda.py \
    --ignore=tests/gpu/test_rows_cuda.py --ignore=tests/gpu/test_gather_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m fusegen.bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
  status=$((status | ${PIPESTATUS[0]}))
  python3 -m fusegen.bench ffn --dtypes bf16,fp32 --json "$OUT/bench_ffn.json" 2>&1 | tee "$OUT/bench_ffn.log"
  status=$((status | ${PIPESTATUS[0]}))
  python3 -m fusegen.bench layouts --json "$OUT/bench_layouts.json" 2>&1 | tee "$OUT/bench_layouts.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == gp || $what == bench || $what == all ]]; then
  python3 -m fusegen.bench gp --dtypes float32,bfloat16 --json "$OUT/bench_gp.json" 2>&1 | tee "$OUT/bench_gp.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == build || $what == all ]]; then
  python3 -m fusegen.bench build --no-compile --json "$OUT/bench_build.json" 2>&1 | tee "$OUT/bench_build.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == optim || $what == all ]]; then
  python3 -m pytest -q -m cuda tests/gpu/test_step_cuda.py tests/gpu/test_optim_cuda.py 2>&1 | tee "$OUT/pytest_optim.log"
  status=$((status | ${PIPESTATUS[0]}))
  for setup in bf16 fp32; do  # one setup a run: each compile row compiles a 201-tensor step
    python3 -m fusegen.bench optim --setups $setup --json "$OUT/bench_optim_$setup.json" 2>&1 | tee "$OUT/bench_optim_$setup.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if [[ $what == rope || $what == all ]]; then
  python3 -m fusegen.bench rope --json "$OUT/bench_rope.json" 2>&1 | tee "$OUT/bench_rope.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
# The row ops (norms, softmax, cross-entropy): their CUDA tests, then `fusegen bench rows` (default shapes).
# The GPU image has no Liger Kernel: a wheel installed with pip --target is found through
# PYTHONPATH, which this script extends rather than replaces.
if [[ $what == rows || $what == all ]]; then
  python3 -m pytest -q -m cuda tests/gpu/test_rows_cuda.py tests/gpu/test_gather_cuda.py 2>&1 | tee "$OUT/pytest_rows.log"; status=$((status | ${PIPESTATUS[0]}))
  python3 -m fusegen.bench rows --json "$OUT/bench_rows.json" 2>&1 | tee "$OUT/bench_rows.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
# The row ops' kernels under torch.profiler beside Liger's, at 16384 rows in bf16
# (tests/gpu/rows_profile.py): which pass takes the time where fusegen trails a peer.
if [[ $what == rows_profile ]]; then
  python3 tests/gpu/rows_profile.py --ops layernorm,softmax,resnorm --dtypes bf16 --shapes 16384x4096,16384x8192 \
    --impls fusegen,liger 2>&1 | tee "$OUT/rows_profile.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
# Random numbers in the kernels (dropout): their CUDA tests, then `fusegen bench dropout`.
if [[ $what == dropout || $what == all ]]; then
  python3 -m pytest -q -m cuda tests/gpu/test_random_cuda.py 2>&1 | tee "$OUT/pytest_random.log"; status=$((status | ${PIPESTATUS[0]}))
  python3 -m fusegen.bench dropout --json "$OUT/bench_dropout.json" 2>&1 | tee "$OUT/bench_dropout.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
# A Llama-style decoder's training step, five variants (`fusegen bench block`, default model);
# its two torch.compile variants, a whole step each, are most of its minutes.
if [[ $what == block || $what == all ]]; then
  python3 -m fusegen.bench block --json "$OUT/bench_block.json" 2>&1 | tee "$OUT/bench_block.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if [[ $what == compile || $what == all ]]; then
  python3 -m fusegen.bench.compile --json "$OUT/bench_compile.json" 2>&1 | tee "$OUT/bench_compile.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
# A command with extra nvcc flags (NVCC_APPEND_FLAGS is part of the cache key), its build in a
# cache of its own, so that each variant's build starts cold; on the nvcc route, the one
# that reads them.
with_flags() {  # cache-name flags command...
  local cache=$1 flags=$2
  shift 2
  FUSEGEN_CACHE_DIR=/tmp/fusegen-$cache FUSEGEN_CUDA_COMPILER=nvcc NVCC_APPEND_FLAGS="$flags" "$@"
}
# `fusegen bench layouts` once per value of a kernel's compile-time macro.
compare_macro() {  # name macro value...
  local name=$1 macro=$2 value
  shift 2
  for value in "$@"; do
    with_flags "$name-$value" "-D$macro=$value" python3 -m fusegen.bench layouts --json "$OUT/layouts_${name}_$value.json" \
      2>&1 | tee "$OUT/${name}_$value.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
}
# The tiled kernel's tile width (templates/fusegen-cuda.cuh, FUSEGEN_TILE_COLS): the default
# 64 against 32 (fp32 only: a tile of fp16/bf16 pairs or fours is 64 wide either way).
if [[ $what == tiles ]]; then compare_macro tiles FUSEGEN_TILE_COLS 64 32; fi
# The accumulating kernel's register cap (FUSEGEN_ACCUMULATING_BLOCKS): the default 4 blocks
# per SM against nvcc's choice (1).
if [[ $what == accumulating ]]; then compare_macro acc FUSEGEN_ACCUMULATING_BLOCKS 4 1; fi
# The step kernel's 16-byte path for launches whose operands are all 16-bit
# (FUSEGEN_STEP_NARROW): on (1, the default) against off (0), bf16 setup, no compile rows.
if [[ $what == narrow ]]; then
  for value in 1 0; do
    with_flags "narrow-$value" "-DFUSEGEN_STEP_NARROW=$value" python3 -m fusegen.bench optim --setups bf16 \
      --impls fusegen,fusegen-narrow,torch-fused --json "$OUT/optim_narrow_$value.json" 2>&1 | tee "$OUT/optim_narrow_$value.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
# The accumulating backward of a 16-bit op that draws random numbers
# (FUSEGEN_RANDOM_ACCUMULATING_WIDE): eight elements per vector (1, the default) against
# four (0), with the random CUDA tests under 0 first.
if [[ $what == random_width ]]; then
  with_flags random-wide-0 "-DFUSEGEN_RANDOM_ACCUMULATING_WIDE=0" python3 -m pytest -q -m cuda \
    tests/gpu/test_random_cuda.py 2>&1 | tee "$OUT/pytest_random_narrow.log"
  status=$((status | ${PIPESTATUS[0]}))
  for value in 0 1 0 1; do
    with_flags "random-wide-$value" "-DFUSEGEN_RANDOM_ACCUMULATING_WIDE=$value" python3 -m fusegen.bench dropout \
      --json "$OUT/dropout_wide_$value.json" 2>&1 | tee -a "$OUT/dropout_wide_$value.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
# The unrolled passes over rows not held in registers (FUSEGEN_ROW_UNROLL): 4, the default,
# against 1, fusegen's own times for the cross-entropy, and softmax and LayerNorm at hidden
# 8192 (fp32 LayerNorm's backward reads three inputs: its rows are not held); the gather
# tests under 1 first.
if [[ $what == row_unroll ]]; then
  with_flags row-unroll-1 "-DFUSEGEN_ROW_UNROLL=1" python3 -m pytest -q -m cuda tests/gpu/test_gather_cuda.py \
    2>&1 | tee "$OUT/pytest_row_unroll_1.log"
  status=$((status | ${PIPESTATUS[0]}))
  for value in 4 1; do
    for ops in crossentropy "softmax,layernorm --hidden 8192"; do
      echo "== FUSEGEN_ROW_UNROLL=$value: $ops" | tee -a "$OUT/rows_unroll.log"
      # (word splitting of $ops: the options after the op names)
      # shellcheck disable=SC2086
      with_flags "row-unroll-$value" "-DFUSEGEN_ROW_UNROLL=$value" python3 -m fusegen.bench rows --ops $ops \
        --impls fusegen 2>&1 | tee -a "$OUT/rows_unroll.log"
      status=$((status | ${PIPESTATUS[0]}))
    done
  done
fi
# The 16-bit rows that half a block's threads take in a forward
# (FUSEGEN_ROW_HALF_FORWARD_VECTORS): 4, the default (rows of up to 4096 elements), against
# 2 (up to 2048, as a backward's) and 0 (none), fusegen's own times.
if [[ $what == row_half ]]; then
  for value in 4 2 0; do
    echo "== FUSEGEN_ROW_HALF_FORWARD_VECTORS=$value" | tee -a "$OUT/row_half.log"
    with_flags "row-half-$value" "-DFUSEGEN_ROW_HALF_FORWARD_VECTORS=$value" python3 -m fusegen.bench rows \
      --ops softmax,layernorm,rmsnorm --dtypes bf16 --rows 16384 --hidden 2048,4096 --impls fusegen 2>&1 | tee -a "$OUT/row_half.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
# Long rows in few rows split over blocks (FUSEGEN_ROW_SPLIT, row_split_chunk): 1, the
# default, against 0 (one block a row), fusegen beside eager and Liger on the default build.
if [[ $what == row_split ]]; then
  for value in 1 0; do
    impls=fusegen; [[ $value == 1 ]] && impls=fusegen,eager,liger
    echo "== FUSEGEN_ROW_SPLIT=$value" | tee -a "$OUT/row_split.log"
    with_flags "row-split-$value" "-DFUSEGEN_ROW_SPLIT=$value" python3 -m fusegen.bench rows \
      --ops softmax,layernorm,crossentropy --dtypes bf16,fp32 --rows 16,64 --hidden 65536,262144 \
      --impls $impls --json "$OUT/row_split_$value.json" 2>&1 | tee -a "$OUT/row_split.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
# The row kernels' approximate exp and division for fp16/bf16 (fusegen-math.h) and holding
# only the inputs a pass reads (fusegen-cuda-rows.cuh, row_holds): the default build against
# one without either (FUSEGEN_APPROX_MATH=0, FUSEGEN_ROW_HOLD_ALL=1), both on the nvcc route.
if [[ $what == row_ab ]]; then
  for flags in "" "-DFUSEGEN_APPROX_MATH=0 -DFUSEGEN_ROW_HOLD_ALL=1"; do
    echo "== NVCC_APPEND_FLAGS=$flags" | tee -a "$OUT/row_ab.log"
    with_flags "row-ab-$(echo "$flags" | md5sum | cut -c1-8)" "$flags" python3 -m fusegen.bench rows \
      --ops softmax,layernorm,resnorm,crossentropy --dtypes bf16,fp32 --rows 16384 \
      --impls fusegen 2>&1 | tee -a "$OUT/row_ab.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
# The vector and accumulating kernels' launch shapes (FUSEGEN_VECTOR_UNROLL, _VECTOR_BLOCKS,
# _ACCUMULATING_UNROLL, _ACCUMULATING_BLOCKS): fusegen's own times and kernels on the
# layout cases, one build per shape (tests/gpu/vector_probe.py).
if [[ $what == vector ]]; then
  for flags in "" "-DFUSEGEN_VECTOR_UNROLL=2" "-DFUSEGEN_ACCUMULATING_BLOCKS=5"; do
    with_flags "vector-$(echo "$flags" | md5sum | cut -c1-8)" "$flags" python3 tests/gpu/vector_probe.py 2>&1 |
      tee -a "$OUT/vector_probe.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
exit $status
