#!/usr/bin/env bash
# Device run of issue 26's TP = 2 >= 1.8x check on the 8B shape (docs/benchmarks.md, "TP 2 across the layer
# boundary"): optionally the two-GPU tests, then bench_multigpu.py's layouts in one process group, then (PROFILE=1)
# one profiled pass at TP 1 (GPU 0) and at TP 2 (kernel groups, gzipped Chrome traces). Run from the tree under test:
#   [TESTS=1] [PROFILE=1] [BASE=<main's tree>] bash benchmarks/tp_layers_device.sh LAYOUTS [BASE_LAYOUTS]
# With BASE, main's tree runs BASE_LAYOUTS first in the same call (its own torchrun), as the baseline.
set -u
source "$(dirname "$0")/device_common.sh"
LAYOUTS=${1:-1x2,2x1:c4:p}
{ nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
if [ -n "${TESTS:-}" ]; then
  say "GPU tests"
  timeout 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_tp_sums_gpu.py 2>&1 | tail -8 \
    | tee "$OUT/tests.txt"
  if ! grep -q " passed" "$OUT/tests.txt" || grep -q "failed\|error" "$OUT/tests.txt"; then
    LAYOUTS=2x1:c4:p:w,1x2  # the sharded form is broken: the replicated one and its baseline only
  fi
fi
bench() {  # bench TREE LAYOUTS NAME
  say "bench $3: $2"
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout "${BENCH_TIMEOUT:-300}" torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py \
    --model qwen3-8b --layouts "$2" --rollouts 128 --repeats 3 --out "$OUT/$3.json" 2>&1 | grep -v Warn \
    | cut -c1-420 | tee "$OUT/$3.log")
}
[ -n "${BASE:-}" ] && bench "$BASE" "${2:-1x2,2x1:c4:p}" base
bench "$PWD" "$LAYOUTS" tree
if [ -n "${PROFILE:-}" ]; then
  say "profile TP 1"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/profile_recompute.py --model qwen3-8b --rollouts 64 \
    --top 30 --out "$OUT/prof_tp1.json" --trace "$OUT/trace_tp1.json.gz" 2>&1 | grep -v "Warn\|USDT"
  say "profile TP 2"
  timeout 120 torchrun --nproc-per-node 2 benchmarks/profile_recompute.py --model qwen3-8b --rollouts 64 --tp 2 \
    --top 30 --out "$OUT/prof_tp2.json" --trace "$OUT/trace_tp2.json.gz" 2>&1 | grep -v "Warn\|USDT"
fi
say done
