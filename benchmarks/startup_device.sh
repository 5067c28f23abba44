#!/usr/bin/env bash
# Device runs of issue 26's start-up target (docs/benchmarks.md, "Start-up: the warm fixed cost"). One part a call,
# one GPU, run from the tree under test (PYTHONPATH=$PWD); results under $OUT:
#   profile: the phase timeline (benchmarks/startup_timeline.py) of a first and a warm `pgdiag logprobs` on the
#            Qwen3-8B checkpoint, the plain warm wall time, the interpreter/torch/CUDA start alone, -X importtime.
#   measure: this tree against BASE (a checkout of main): first start, warm small and mid-sized runs (the fixed
#            cost is the intercept of wall time against positions), the small run from a dropped page cache,
#            the disk's O_DIRECT rate, and every stream compared with the baseline's.
#   warm:    this tree against BASE after the direct FlashAttention call, Triton's key on a thread and the fast exit:
#            the GPU tests of the direct call, first start, warm small and mid runs twice in alternating order,
#            cold runs, every stream compared with the baseline's (bit for bit), both trees' timelines with the
#            exit's parts, the exit of a bare CUDA process (ordinary and os._exit), the disk's O_DIRECT rate.
set -u
source "$(dirname "$0")/device_common.sh"
W=/tmp/start26  # this script's files, apart from the other device scripts' /tmp/bench
CKPT=$W/c8

environment() {
  { nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv; nproc; free -g; df -h /tmp
    python3 -c 'import sys, torch, triton; print(torch.__version__, triton.__version__, sys.version)'
    env | grep -E '^(PYTHON|TORCH|TRITON|XDG|HOME)' ; } >"$OUT/env.txt" 2>&1
}

checkpoint() {  # the Qwen3-8B shape on disk (16.4 GB, one file a layer) and runs of realistic RL lengths
  say "8B checkpoint"
  python3 $C write-ckpt --model qwen3-8b --dir $CKPT --workers 4 --out "$OUT/cli.jsonl" | cut -c1-200
  for spec in "$@"; do  # NAME:ROLLOUTS:STEPS
    IFS=: read -r name rollouts steps <<<"$spec"
    python3 $C make-run --vocab 151936 --rollouts "$rollouts" --steps "$steps" --seed 1 --dir $W/$name \
      --out "$OUT/cli.jsonl" | cut -c1-200
  done
}

timeline() {  # timeline NAME RUN TAG [TREE]: one CLI run in this process, phases marked (startup_timeline.py),
  # with TREE's pgdiag (default this one) and this tree's script
  say "timeline $1"
  local t0 t1 tree=${4:-$PWD} script=$PWD/benchmarks/startup_timeline.py
  t0=$(date +%s.%N)
  (cd "$tree" && PYTHONPATH=$tree:/tmp/site timeout 100 python3 "$script" --t0 "$t0" --out "$OUT/timeline_$1.json" \
    -- logprobs "$2" --model $CKPT --json -q --tag "$3" >/dev/null 2>/tmp/bench/logs/timeline_$1.err)
  t1=$(date +%s.%N)
  echo "{\"timeline\": \"$1\", \"wall_s\": $(awk "BEGIN{print $t1 - $t0}")}" | tee -a "$OUT/cli.jsonl"
  tail -3 /tmp/bench/logs/timeline_$1.err
}

bare_exit() {  # a process holding 20 GB of GPU memory and 768 MB pinned: its exit, ordinary and os._exit
  for how in "pass" "os._exit(0)"; do
    local t1
    local at
    at=$(python3 -c "import os, sys, time, torch
x = torch.empty(20 << 30, dtype=torch.uint8, device='cuda'); p = torch.empty(768 << 20, dtype=torch.uint8).pin_memory()
torch.cuda.synchronize(); print(time.time()); sys.stdout.flush()
$how")
    t1=$(date +%s.%N)
    echo "{\"bare_exit\": \"$how\", \"exit_s\": $(awk "BEGIN{print $t1 - $at}")}" | tee -a "$OUT/cli.jsonl"
  done
}

warm() {  # this tree ("n") against BASE ("b"), one GPU, one call (docs/benchmarks.md, "the warm fixed cost, again")
  environment
  local base=${BASE:?BASE=a checkout of main}
  (cd "$base" && git log -1 --format='base %H %cI' >>"$OUT/env.txt" 2>&1)
  say "GPU tests of the direct FlashAttention call"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_attention_gpu.py 2>&1 | tail -4 \
    | tee "$OUT/gpu_tests.txt"
  checkpoint small:128:4 mid:192:4
  local n="cd $PWD && python3 -m pgdiag logprobs --model $CKPT --json -q"
  local b="cd $base && python3 -m pgdiag logprobs --model $CKPT --json -q"
  cli base_first 100 "$b $W/small --tag bf"
  cli new_first 80 "$n $W/small --tag nf"
  for i in 1 2; do
    cli base_small$i 60 "$b $W/small --tag bs$i"
    cli new_small$i 60 "$n $W/small --tag ns$i"
  done
  cli new_mid 60 "$n $W/mid --tag nm"
  cli base_mid 60 "$b $W/mid --tag bm"
  cold_pair
  python3 $C same --run $W/small --tags bs1 ns1 ns2 nf nc bs2 bf bc --out "$OUT/cli.jsonl" | cut -c1-400
  python3 $C same --run $W/mid --tags bm nm --out "$OUT/cli.jsonl" | cut -c1-400
  timeline new_warm $W/small t1
  timeline base_warm $W/small t2 "$base"
  bare_exit
  python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" | cut -c1-200
  timeout 30 python3 $C odirect --dir $CKPT --workers 4 --limit-gb 8 --out "$OUT/cli.jsonl" | cut -c1-200
  tail -n 3 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "warm done"
}

micro() {  # the interpreter, torch, CUDA and the compiler's imports alone, with pgdiag's bytecode cache
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}/pgdiag/pycache
  for code in "pass" "import torch" "import torch; torch.cuda.init()" "import torch; torch.zeros(1, device='cuda')" \
    "import torch._dynamo" "import torch, torch._inductor.compile_fx" "import triton" "import polars" \
    "import pgdiag.cli.app" "import pgdiag.recompute.jobs"; do
    local t0 t1
    t0=$(date +%s.%N)
    env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$cache" python3 -c "$code"
    t1=$(date +%s.%N)
    echo "{\"micro\": \"$code\", \"wall_s\": $(awk "BEGIN{print $t1 - $t0}")}" >>"$OUT/micro.txt"
  done
  env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$cache" python3 -X importtime -c \
    'import pgdiag.cli.app, pgdiag.recompute.jobs, pgdiag.model.checkpoint, torch._dynamo' 2>&1 \
    | sort -t'|' -k2 -n | tail -40 >>"$OUT/micro.txt"
}

profile() {
  environment
  checkpoint small:32:2
  timeline first $W/small t1
  timeline warm $W/small t2
  cli plain_warm 100 "python3 -m pgdiag logprobs $W/small --model $CKPT --json -q --tag t3"
  micro
  say "profile done"
}

cold_pair() {  # the small run from a dropped page cache, this tree then BASE (the caller's $n and $b)
  say "cold page cache"
  python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" | cut -c1-200
  cli new_cold 60 "$n $W/small --tag nc"
  python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" | cut -c1-200
  cli base_cold 60 "$b $W/small --tag bc"
}

measure() {  # this tree ("n") against BASE ("b"), one GPU; the steps in order of need, each with its own limit
  environment
  local base=${BASE:?BASE=a checkout of main}
  say "GPU tests of the pointwise kernels"
  timeout 90 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors tests/model/test_pointwise_gpu.py \
    "tests/model/test_model_gpu.py::test_fused_pointwise_equals_eager" 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
  checkpoint small:128:4 mid:192:4
  local n="cd $PWD && python3 -m pgdiag logprobs --model $CKPT --json -q"
  local b="cd $base && python3 -m pgdiag logprobs --model $CKPT --json -q"
  cli base_first 100 "$b $W/small --tag bf"
  cli new_first 80 "$n $W/small --tag nf"
  cli base_small 60 "$b $W/small --tag bs"
  cli new_small 60 "$n $W/small --tag ns"
  cli base_mid 60 "$b $W/mid --tag bm"
  cli new_mid 60 "$n $W/mid --tag nm"
  cold_pair
  python3 $C same --run $W/small --tags ns nf nc bs bf bc --out "$OUT/cli.jsonl" | cut -c1-400
  python3 $C same --run $W/small --tags bs bf bc --out "$OUT/cli.jsonl" | cut -c1-400
  python3 $C same --run $W/mid --tags nm bm --out "$OUT/cli.jsonl" | cut -c1-400
  timeline new_warm $W/small t9
  python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" | cut -c1-200
  timeout 30 python3 $C odirect --dir $CKPT --workers 4 --limit-gb 8 --out "$OUT/cli.jsonl" | cut -c1-200
  tail -n 3 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
  say "measure done"
}

"$@" 2>&1 | tee -a "$OUT/log.txt"
