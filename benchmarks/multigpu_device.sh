#!/usr/bin/env bash
# The four-GPU device runs behind docs/benchmarks.md ("Several GPUs"): `bash benchmarks/multigpu_device.sh part1`
# then `... part2`, each under 10 minutes on a 4 x H200 machine, results under $OUT (at most 8 files come back).
# part1: Qwen3-8B layouts (1x4, 2x2, 4x1), MoE layouts, then the CLI on an 8B checkpoint on disk: one GPU cold
#        and warm (two run sizes: the slope is the steady rate, the intercept the fixed cost), --tp 2, --dp 2
#        (pgdiag's launcher) beside a warm one-GPU run, launcher vs torchrun, one node of four vs two nodes of two.
# part2: Llama-3-70B layouts (4x1, 2x2 = TP 2 on two GPUs) with an fp32-body reference at TP 4 and the peak of a
#        64k-token batch, while the 70B checkpoint is written to disk; then page cache dropped, O_DIRECT read of
#        the files (disk reference), and `pgdiag logprobs --tp 4` loading it, per-rank /proc/PID/io watched.
# part3: the CLI on one GPU (4 at once, cold then warm) vs --dp 2 through pgdiag's launcher and torchrun, each
#        pair swapped between GPU pairs, two run sizes: steady rate (slope) and fixed cost (intercept).
# NVLink multicast stays off (the device machines require it). Needs polars (wheels in .whl, see the device notes).
set -u
source "$(dirname "$0")/device_common.sh"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
B=benchmarks/bench_multigpu.py
left() { echo $((${BUDGET:-540} - (SECONDS - T0))); }
PG="python3 -m pgdiag logprobs"
TR="python3 -m torch.distributed.run"

environment() {
  { nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv; nvidia-smi topo -m; df -h / /tmp
    free -g; nproc; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'
    echo "commit $COMMIT"; } >"$OUT/env.txt" 2>&1
}

part1() {
  environment
  say "8B layouts"
  timeout 200 $TR --nproc-per-node 4 $B --model qwen3-8b --layouts 1x4,2x2,4x1 --bf16-head-too --rollouts 128 \
    --repeats 3 --commit "$COMMIT" --out "$OUT/l8b.json" 2>&1 | grep -v '^W1'
  say "MoE layouts"
  timeout 200 $TR --nproc-per-node 4 $B --model qwen3-30b-a3b --layouts 1x4,2x2,4x1 --rollouts 128 --repeats 2 \
    --commit "$COMMIT" --out "$OUT/moe.json" 2>&1 | grep -v '^W1'
  say "8B checkpoint and runs"
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 4 --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C make-run --vocab 151936 --rollouts 384 --steps 8 --dir /tmp/bench/big --out "$OUT/cli.jsonl"
  python3 $C make-run --vocab 151936 --rollouts 128 --steps 4 --seed 1 --dir /tmp/bench/small --out "$OUT/cli.jsonl"
  local one="$PG --model /tmp/bench/c8 --json -q"
  cli cold 150 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/big --tag one_cold" \
    "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/small --tag one_cold" \
    "CUDA_VISIBLE_DEVICES=2,3 $one /tmp/bench/big --tag tp2 --tp 2"
  cli warm 120 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/big --tag one" \
    "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/small --tag one" \
    "CUDA_VISIBLE_DEVICES=2,3 $one /tmp/bench/big --tag dp2 --dp 2"
  [ "$(left)" -gt 100 ] && cli launcher_vs_torchrun 100 \
    "CUDA_VISIBLE_DEVICES=0,1 $TR --nproc-per-node 2 -m pgdiag logprobs /tmp/bench/big --model /tmp/bench/c8 --json -q --tag dp2_torchrun --dp 2" \
    "CUDA_VISIBLE_DEVICES=2,3 $one /tmp/bench/big --tag dp2_launcher --dp 2"
  [ "$(left)" -gt 80 ] && cli one_node 80 "$one /tmp/bench/small --tag node1 --tp 2 --dp 2"
  local rdzv="--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29511"
  local args="-m pgdiag logprobs /tmp/bench/small --model /tmp/bench/c8 --json -q --tag nodes2 --tp 2"
  [ "$(left)" -gt 60 ] && cli two_nodes 80 "CUDA_VISIBLE_DEVICES=0,1 $TR $rdzv --node-rank 0 $args" \
    "CUDA_VISIBLE_DEVICES=2,3 $TR $rdzv --node-rank 1 $args"
  python3 $C same --run /tmp/bench/big --tags one one_cold dp2 dp2_torchrun dp2_launcher tp2 --out "$OUT/cli.jsonl" | cut -c1-600
  python3 $C same --run /tmp/bench/small --tags node1 nodes2 one one_cold --out "$OUT/cli.jsonl" | cut -c1-600
  tail -n 5 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "part1 done"
}

part2() {
  environment
  say "70B checkpoint writer in the background (GPU-light), 70B layouts in the foreground"
  python3 $C write-ckpt --model llama3-70b --dir /tmp/bench/c70 --workers 4 --seconds "${WRITE_S:-170}" \
    --out "$OUT/load70.jsonl" >/tmp/bench/logs/write70.log 2>&1 &
  local writer=$!
  timeout 260 $TR --nproc-per-node 4 $B --model llama3-70b --layouts 4x1,2x2 --rollouts 48 --repeats 2 --keep 8 \
    --fp32-ref 4 --fp32-rollouts 8 --peak-batch 65536 --commit "$COMMIT" --out "$OUT/l70b.json" 2>&1 | grep -v '^W1'
  say "waiting for the writer"
  wait $writer
  cat /tmp/bench/logs/write70.log | cut -c1-400
  python3 $C make-run --vocab 128256 --rollouts 32 --steps 2 --dir /tmp/bench/r70 --out "$OUT/load70.jsonl"
  python3 $C share --dir /tmp/bench/c70 --tp 4 --out "$OUT/load70.jsonl"
  sync
  python3 $C drop-cache --dir /tmp/bench/c70 --out "$OUT/load70.jsonl"
  say "O_DIRECT reference"
  timeout 90 python3 $C odirect --dir /tmp/bench/c70 --workers 4 --limit-gb "${ODIRECT_GB:-40}" --out "$OUT/load70.jsonl"
  python3 $C drop-cache --dir /tmp/bench/c70 --out "$OUT/load70.jsonl"
  say "CLI --tp 4 from a cold page cache"
  local limit=$(($(left) - 20))
  timeout $((limit + 10)) python3 $C cli --name load70 --timeout $limit --logs /tmp/bench/logs \
    --cmd "$PG /tmp/bench/r70 --model /tmp/bench/c70 --json -q --tag tp4 --tp 4" --out "$OUT/load70.jsonl" | cut -c1-300
  tail -n 8 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "part2 done"
}

part3() {  # one GPU vs --dp 2, launcher vs torchrun: two run sizes each (slope = steady rate), symmetric phases
  environment
  timeout 120 $TR --nproc-per-node 4 $B --model qwen3-8b --layouts 1x4 --rollouts 128 --repeats 3 \
    --commit "$COMMIT" --out "$OUT/l8b.json" 2>&1 | grep '^{'
  python3 $C write-ckpt --model qwen3-8b --dir /tmp/bench/c8 --workers 4 --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C make-run --vocab 151936 --rollouts 384 --steps 8 --dir /tmp/bench/big --out "$OUT/cli.jsonl"
  python3 $C make-run --vocab 151936 --rollouts 128 --steps 4 --seed 1 --dir /tmp/bench/small --out "$OUT/cli.jsonl"
  local one="$PG --model /tmp/bench/c8 --json -q"
  local tr="--nproc-per-node 2 -m pgdiag logprobs --model /tmp/bench/c8 --json -q"
  cli cold 150 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/small --tag c0" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/big --tag c1" \
    "CUDA_VISIBLE_DEVICES=2 $one /tmp/bench/small --tag c2" "CUDA_VISIBLE_DEVICES=3 $one /tmp/bench/big --tag c3"
  cli one_warm 100 "CUDA_VISIBLE_DEVICES=0 $one /tmp/bench/big --tag w0" "CUDA_VISIBLE_DEVICES=1 $one /tmp/bench/small --tag w1" \
    "CUDA_VISIBLE_DEVICES=2 $one /tmp/bench/big --tag w2" "CUDA_VISIBLE_DEVICES=3 $one /tmp/bench/small --tag w3"
  cli dp_big_a 100 "CUDA_VISIBLE_DEVICES=0,1 $one /tmp/bench/big --tag la --dp 2" \
    "CUDA_VISIBLE_DEVICES=2,3 $TR --master-port 29512 $tr /tmp/bench/big --tag ta --dp 2"
  cli dp_big_b 100 "CUDA_VISIBLE_DEVICES=0,1 $TR --master-port 29513 $tr /tmp/bench/big --tag tb --dp 2" \
    "CUDA_VISIBLE_DEVICES=2,3 $one /tmp/bench/big --tag lb --dp 2"
  [ "$(left)" -gt 70 ] && cli dp_small 80 "CUDA_VISIBLE_DEVICES=0,1 $one /tmp/bench/small --tag ls --dp 2" \
    "CUDA_VISIBLE_DEVICES=2,3 $TR --master-port 29514 $tr /tmp/bench/small --tag ts --dp 2"
  python3 $C same --run /tmp/bench/big --tags w0 c1 c3 w2 la ta tb lb --out "$OUT/cli.jsonl" | cut -c1-300
  python3 $C same --run /tmp/bench/small --tags w1 c0 c2 w3 ls ts --out "$OUT/cli.jsonl" | cut -c1-300
  tail -n 5 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "part3 done"
}

"$@" 2>&1 | tee -a "$OUT/log.txt"
