#!/usr/bin/env bash
# Device runs of issue 26's last speed gaps (docs/benchmarks.md, "Issue 26: the last gaps"). One part per call:
#   profile: fp32-head sweep + ncu of the head kernels, MoE and 8B profiles, the CLI's start-up under cProfile.
#   tp:      (2 GPUs) TP = 1 vs TP = 2 on the 8B shape, overlapped and not; DP vs one warm GPU through the CLI.
#   gaps:    (2 GPUs) TP = 2 sequence parallel and with NCCL's CTAs capped, against TP = 1; the CLI's start-up with
#            the weight stream (this tree) against BASE (a checkout without it), warm and from a dropped page cache.
#            Run from the tree under test; BASE=/path/of/baseline/checkout.
# Results under $OUT (at most 8 files come back). NVLink multicast stays off.
set -u
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source "$(dirname "$0")/device_common.sh"

environment() {
  { nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv; df -h / /tmp; free -g; nproc
    python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
}

startup() {  # the CLI on one GPU, an 8B checkpoint on disk: cold compile cache then warm, under cProfile
  say "8B checkpoint"
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 2 --out "$OUT/startup.jsonl" | cut -c1-300
  python3 $C make-run --vocab 151936 --rollouts 32 --steps 2 --dir /tmp/bench/small --out "$OUT/startup.jsonl"
  for tag in cold warm; do
    say "CLI $tag"
    local t=$SECONDS
    timeout 200 python3 -m cProfile -o /tmp/bench/$tag.prof -m pgdiag logprobs /tmp/bench/small \
      --model /tmp/bench/c8 --json -q --tag $tag >>"$OUT/startup.jsonl" 2>/tmp/bench/logs/$tag.err
    echo "{\"cli\": \"$tag\", \"wall_s\": $((SECONDS - t))}" >>"$OUT/startup.jsonl"
    tail -3 /tmp/bench/logs/$tag.err
    python3 - "$tag" <<'PY' >>"$OUT/startup_prof.txt"
import pstats, sys
tag = sys.argv[1]
print(f"===== {tag}: cumulative top 45")
pstats.Stats(f"/tmp/bench/{tag}.prof").sort_stats("cumulative").print_stats(45)
print(f"===== {tag}: tottime top 20")
pstats.Stats(f"/tmp/bench/{tag}.prof").sort_stats("tottime").print_stats(20)
PY
  done
  python3 -X importtime -c 'import pgdiag.cli.main' 2>&1 | sort -t'|' -k2 -n | tail -15 >>"$OUT/startup_prof.txt"
}

profile() {
  environment
  say "fp32 head sweep"
  timeout 200 python3 benchmarks/bench_lm_head.py --tokens 16384 --shapes 4096x151936 --sweep-fp32 \
    --only pgdiag_triton_bf16_tau1.0 pgdiag_triton_fp32head_tau1.0 pgdiag_triton_fp32head_bf16hidden_tau1.0 \
    --json "$OUT/lm_head.json" 2>&1 | grep -v Warning
  say "ncu of the head kernels"
  timeout 120 ncu --kernel-name regex:'_head_partials_kernel' --launch-count 6 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy python3 benchmarks/ncu_head.py >"$OUT/ncu.txt" 2>&1
  grep -E "partials_kernel|Duration|Throughput|Registers|Shared Memory Config|Stall|Issue Slot|Pipe" "$OUT/ncu.txt" | head -60
  say "MoE profile"
  timeout 240 python3 benchmarks/profile_recompute.py --model qwen3-30b-a3b --rollouts 64 --out "$OUT/moe_prof.json" 2>&1 | grep -v Warning
  say "8B profile"
  timeout 150 python3 benchmarks/profile_recompute.py --model qwen3-8b --rollouts 48 --top 12 --out "$OUT/d8_prof.json" 2>&1 | grep -v Warning
  startup
  say "profile done"
}

tp() {  # two GPUs: 8B TP 2 with and without the overlapped all-reduces against one GPU a replica; then the CLI
  environment
  { env | grep -i -E '^PYTHON|^PIP'; python3 -c 'import sys, torch; print("dont_write_bytecode", sys.flags.dont_write_bytecode, sys.pycache_prefix); print(torch.__file__)'
    ls /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ 2>&1 | head -3; touch /opt/torch/.venv/lib/python3.12/site-packages/torch/.w 2>&1 && echo writable; } >>"$OUT/env.txt" 2>&1
  say "8B layouts"
  timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_multigpu.py --model qwen3-8b \
    --layouts 1x2,2x1:c1,2x1:c4 --rollouts 128 --repeats 3 --out "$OUT/tp8b.json" 2>&1 | grep '^{' | cut -c1-400
  say "8B checkpoint and runs"
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 2 --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C make-run --vocab 151936 --rollouts 768 --steps 8 --dir /tmp/bench/big --out "$OUT/cli.jsonl"
  python3 $C make-run --vocab 151936 --rollouts 128 --steps 4 --seed 1 --dir /tmp/bench/small --out "$OUT/cli.jsonl"
  local one="python3 -m pgdiag logprobs --model /tmp/bench/c8 --json -q"
  cli cold 120 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/small --tag c0" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/small --tag c1"
  cli warm_small 100 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/small --tag w0" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/small --tag w1"
  cli warm_big 120 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/big --tag b0" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/big --tag b1"
  cli dp_big 100 "$one /tmp/bench/big --tag db --dp 2"
  cli dp_small 80 "$one /tmp/bench/small --tag ds --dp 2"
  export PYTHONPYCACHEPREFIX=/tmp/pyc; unset PYTHONDONTWRITEBYTECODE  # the image sets it and ships torch without bytecode
  cli pyc_fill 100 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/small --tag p0"
  cli pyc_warm 100 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/small --tag p1" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/big --tag p2"
  unset PYTHONPYCACHEPREFIX; export PYTHONDONTWRITEBYTECODE=1
  python3 $C same --run /tmp/bench/big --tags b0 b1 db p2 --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C same --run /tmp/bench/small --tags w0 c0 c1 w1 ds p0 p1 --out "$OUT/cli.jsonl" | cut -c1-300
  tail -n 3 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "tp done"
}

final() {  # one GPU: MoE combine before/after, the head, the CLI's start-up as the image runs it, GPU tests
  environment
  say "MoE, combine compiled (before) and Triton (now)"
  timeout 150 python3 benchmarks/profile_recompute.py --model qwen3-30b-a3b --rollouts 64 --top 8 --combine compiled \
    --out "$OUT/moe_before.json" 2>&1 | grep -v -i warn
  timeout 150 python3 benchmarks/profile_recompute.py --model qwen3-30b-a3b --rollouts 64 --top 8 \
    --out "$OUT/moe_after.json" 2>&1 | grep -v -i warn
  say "LM head"
  timeout 120 python3 benchmarks/bench_lm_head.py --tokens 16384 --shapes 4096x151936 \
    --only pgdiag_triton_bf16_tau1.0 pgdiag_triton_fp32head_tau1.0 pgdiag_triton_fp32head_bf16hidden_tau1.0 \
    --json "$OUT/lm_head.json" 2>&1 | grep '^|'
  say "CLI start-up (the image's PYTHONDONTWRITEBYTECODE=1 as it is)"
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 1 --out "$OUT/cli.jsonl" | cut -c1-200
  python3 $C make-run --vocab 151936 --rollouts 768 --steps 8 --dir /tmp/bench/big --out "$OUT/cli.jsonl"
  python3 $C make-run --vocab 151936 --rollouts 128 --steps 4 --seed 1 --dir /tmp/bench/small --out "$OUT/cli.jsonl"
  local one="python3 -m pgdiag logprobs --model /tmp/bench/c8 --json -q"
  cli first 120 "$one /tmp/bench/small --tag f0"
  cli warm_small 100 "$one /tmp/bench/small --tag w0"
  cli warm_big 120 "$one /tmp/bench/big --tag b0"
  cli warm_small2 100 "$one /tmp/bench/small --tag w1"
  python3 $C same --run /tmp/bench/small --tags w0 f0 w1 --out "$OUT/cli.jsonl" | cut -c1-200
  say "GPU tests"
  timeout 200 python3 -m pytest -q -m gpu --continue-on-collection-errors -p no:cacheprovider tests/kernels \
    tests/model tests/recompute 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
  say "final done"
}

gaps() {  # two GPUs: TP 2 layouts, then the CLI's start-up, this tree ("n") against BASE ("b")
  environment
  local base=${BASE:?BASE=checkout without the weight stream}
  say "8B TP layouts"
  timeout 220 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_multigpu.py --model qwen3-8b \
    --layouts 1x2,2x1:c4:n,2x1:c4:s,2x1:c4:n:m8,2x1:c4:s:m8 --rollouts 128 --repeats 3 --out "$OUT/tp8b.json" 2>&1 \
    | grep -E '^\{|NCCL max|Error' | cut -c1-420
  say "8B checkpoint and runs"
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 2 --out "$OUT/cli.jsonl" | cut -c1-200
  python3 $C make-run --vocab 151936 --rollouts 768 --steps 8 --dir /tmp/bench/big --out "$OUT/cli.jsonl" | cut -c1-200
  python3 $C make-run --vocab 151936 --rollouts 128 --steps 4 --seed 1 --dir /tmp/bench/small --out "$OUT/cli.jsonl" | cut -c1-200
  local n="cd $PWD && python3 -m pgdiag logprobs --model /tmp/bench/c8 --json -q"
  local b="cd $base && python3 -m pgdiag logprobs --model /tmp/bench/c8 --json -q"
  cli fill 150 "CUDA_VISIBLE_DEVICES=0 $b /tmp/bench/small --tag bf" "CUDA_VISIBLE_DEVICES=1 $n /tmp/bench/small --tag nf"
  cli warm_small 100 "CUDA_VISIBLE_DEVICES=0 $b /tmp/bench/small --tag bs" "CUDA_VISIBLE_DEVICES=1 $n /tmp/bench/small --tag ns"
  cli warm_big 120 "CUDA_VISIBLE_DEVICES=0 $b /tmp/bench/big --tag bb" "CUDA_VISIBLE_DEVICES=1 $n /tmp/bench/big --tag nb"
  cli warm_small2 100 "CUDA_VISIBLE_DEVICES=1 $b /tmp/bench/small --tag bs2" "CUDA_VISIBLE_DEVICES=0 $n /tmp/bench/small --tag ns2"
  say "cold page cache"
  python3 $C drop-cache --dir /tmp/bench/c8 --out "$OUT/cli.jsonl" | cut -c1-200
  python3 $C odirect --dir /tmp/bench/c8 --workers 4 --limit-gb 17 --out "$OUT/cli.jsonl" | cut -c1-200
  python3 $C drop-cache --dir /tmp/bench/c8 --out "$OUT/cli.jsonl" | cut -c1-200
  cli cold_new 100 "CUDA_VISIBLE_DEVICES=0 $n /tmp/bench/small --tag nc"
  python3 $C drop-cache --dir /tmp/bench/c8 --out "$OUT/cli.jsonl" | cut -c1-200
  cli cold_base 100 "CUDA_VISIBLE_DEVICES=0 $b /tmp/bench/small --tag bc"
  python3 $C same --run /tmp/bench/small --tags bs nf ns bs2 ns2 nc bc bf --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C same --run /tmp/bench/big --tags bb nb --out "$OUT/cli.jsonl" | cut -c1-300
  tail -n 3 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "GPU test of the stream"
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_weight_stream.py 2>&1 | tail -3
  say "gaps done"
}

"$@" 2>&1 | tee -a "$OUT/log.txt"
