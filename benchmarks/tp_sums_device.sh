#!/usr/bin/env bash
# Device run of the TP = 2 sums (docs/benchmarks.md, "TP 2: partials summed by the copy engines"): the two-GPU
# test of `PeerCopySums`, a probe of the copy engines' and NCCL's rates between the two GPUs, then
# bench_multigpu.py's layouts (TP 2 against one GPU a replica, in one process group). Run from the tree under test:
#   [NO_PROBE=1] bash benchmarks/tp_sums_device.sh LAYOUTS    (results under $OUT; NVLink multicast stays off)
set -u
source "$(dirname "$0")/device_common.sh"
LAYOUTS=${1:-2x1:c4,1x2,2x1:c4:p}
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
say "GPU tests"
timeout 75 python3 -m pytest -q -x -p no:cacheprovider tests/model/test_tp_sums_gpu.py 2>&1 | tail -15 \
  | tee "$OUT/tests.txt"
if ! grep -q " passed" "$OUT/tests.txt" || grep -q "failed\|error" "$OUT/tests.txt"; then
  LAYOUTS=$(echo "$LAYOUTS" | tr , '\n' | grep -v ':p' | paste -sd,)  # the copy-engine sums are broken: skip them
fi
if [ -z "${NO_PROBE:-}" ]; then
  say "probe"
  timeout 90 torchrun --nproc-per-node 2 benchmarks/probe_peer_copy.py 2>&1 | grep -v Warn | tee "$OUT/probe.txt"
fi
say "bench $LAYOUTS"
timeout 480 torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py --model qwen3-8b --layouts "$LAYOUTS" \
  --rollouts 128 --repeats 3 --out "$OUT/tp.json" 2>&1 | grep -v Warn | cut -c1-700 | tee "$OUT/bench.log"
say done
