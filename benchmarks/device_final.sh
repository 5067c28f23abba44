#!/usr/bin/env bash
# One 4 x H200 call behind this session's last GPU figures (docs/benchmarks.md), results under $OUT:
#   GPUs 0,1: the GPU test suite (`pytest -m gpu`: bf16 kernels, kept-set head, TP = 2 over NCCL);
#   GPU 2:    bench_kept_set.py (kept-set head vs plain head, reconstruct) then bench_lm_head.py (fp32-hidden
#             head vs bf16 head, issue 26);
#   GPU 3:    bench_explain.py (the explain matrix on a Qwen3-8B shape);
#   then all four: Qwen3-235B-A22B cut to 16 layers at 1x4 (one GPU a replica) vs 4x1 (TP = 4, experts sharded,
#             routing agreement), and cut to 80 of its 94 layers at TP = 4 (about 100 GB of weights a GPU).
# Usage: bash benchmarks/device_final.sh   (polars from the carried .whl/ folder; NVLink multicast off)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip install -q --no-index --no-deps -t /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
T0=$SECONDS
say() { echo "[$((SECONDS - T0))s] $*"; }
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; echo "commit $COMMIT"; } >"$OUT/env.txt" 2>&1

say "parallel: gpu tests (0,1), kept-set + lm-head bench (2), explain bench (3)"
(CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/gpu_tests.log" 2>&1; echo "rc $?" >>"$OUT/gpu_tests.log") &
(CUDA_VISIBLE_DEVICES=2 timeout 150 python3 benchmarks/bench_kept_set.py --tokens 16384 --json "$OUT/kept_set.json" >/tmp/kept.log 2>&1
 CUDA_VISIBLE_DEVICES=2 timeout 90 python3 benchmarks/bench_lm_head.py --tokens 16384 --shapes 4096x151936 --json "$OUT/lm_head.json" >/tmp/lmhead.log 2>&1) &
(CUDA_VISIBLE_DEVICES=3 timeout 240 python3 benchmarks/bench_explain.py --out "$OUT/explain.json" >/tmp/explain.log 2>&1) &
wait
say "235B cuts"
TR="python3 -m torch.distributed.run --nproc-per-node 4"
timeout 120 $TR benchmarks/bench_multigpu.py --model qwen3-235b-a22b --layers 16 --layouts 1x4,4x1 --rollouts 64 \
  --repeats 2 --commit "$COMMIT" --out "$OUT/moe235_cut16.json" >/tmp/m16.log 2>&1
timeout 150 $TR benchmarks/bench_multigpu.py --model qwen3-235b-a22b --layers 80 --layouts 4x1 --rollouts 64 \
  --repeats 2 --commit "$COMMIT" --out "$OUT/moe235_cut80.json" >/tmp/m80.log 2>&1
say "done"
tail -n 15 /tmp/kept.log /tmp/lmhead.log /tmp/explain.log /tmp/m16.log /tmp/m80.log >"$OUT/logs.txt" 2>&1
