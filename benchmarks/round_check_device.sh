#!/usr/bin/env bash
# The round's last GPU check (docs/benchmarks.md, "The round's last GPU check"), one call on two GPUs: every GPU test
# (the two-GPU ones included), then the 8B recompute's rate (one GPU a replica with the default fp32 head and with
# a bf16 head, TP 2 with the copy engines), then the LM heads. Run from the tree under test; results under $OUT.
set -u
source "$(dirname "$0")/device_common.sh"
{ nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
say "GPU tests"
timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/model tests/recompute tests/explain \
  tests/cli 2>&1 | tail -15 | tee "$OUT/tests.txt"
say "recompute, 8B shape"
timeout 200 torchrun --nproc-per-node 2 benchmarks/bench_multigpu.py --model qwen3-8b --layouts 1x2,2x1:c4:p \
  --bf16-head-too --rollouts 128 --repeats 2 --out "$OUT/multigpu.json" 2>&1 | grep -v Warn | cut -c1-400 \
  | tee "$OUT/multigpu.log"
say "LM heads"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_lm_head.py --tokens 16384 --shapes 4096x151936 --only \
  pgdiag_triton_bf16_tau1.0 pgdiag_triton_fp32head_tau1.0 pgdiag_triton_fp32head_bf16hidden_tau1.0 \
  --json "$OUT/heads.json" 2>&1 | tail -8 | tee "$OUT/heads.log"
say done
