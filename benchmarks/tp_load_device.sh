#!/usr/bin/env bash
# Device run: a TP = 2 load from disk, the weight stream with column slices (this tree) against BASE (a checkout of
# main: column slices through mmap), same call, two GPUs (docs/benchmarks.md, "TP 2 loads: column slices streamed").
# The Qwen3-8B checkpoint (16.4 GB, one file a layer) is written, then each tree runs `pgdiag logprobs --tp 2` on a
# small run from a dropped page cache and warm; every worker's /proc/PID/io is watched (read_bytes per rank), the
# disk's O_DIRECT rate is read last, and the streams are compared. Run from this tree: BASE=... bash THIS
set -u
source "$(dirname "$0")/device_common.sh"
W=/tmp/tpload
CKPT=$W/c8
base=${BASE:?BASE=a checkout of main}
n="cd $PWD && PYTHONPATH=$PWD:/tmp/site python3 -m pgdiag logprobs $W/run --model $CKPT --tp 2 --json -q"
b="cd $base && PYTHONPATH=$base:/tmp/site python3 -m pgdiag logprobs $W/run --model $CKPT --tp 2 --json -q"
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nproc; free -g; df -h /tmp
  python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
say "8B checkpoint"
python3 $C write-ckpt --model qwen3-8b --dir $CKPT --workers 4 --out "$OUT/cli.jsonl" | cut -c1-200
python3 $C make-run --vocab 151936 --rollouts 32 --steps 2 --seed 1 --dir $W/run --out "$OUT/cli.jsonl" | cut -c1-200
python3 $C share --dir $CKPT --tp 2 --out "$OUT/cli.jsonl" | cut -c1-300
cold() {  # cold NAME CMD TAG
  python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" >/dev/null
  cli "$1" 120 "$2 --tag $3"
}
cold base_cold "$b" bc
cold new_cold "$n" nc
cli new_warm 90 "$n --tag nw"
cli base_warm 90 "$b --tag bw"
cold new_cold2 "$n" nc2
python3 $C same --run $W/run --tags bc nc nw bw nc2 --out "$OUT/cli.jsonl" | cut -c1-400
python3 $C drop-cache --dir $CKPT --out "$OUT/cli.jsonl" >/dev/null
timeout 40 python3 $C odirect --dir $CKPT --workers 4 --limit-gb 16.5 --out "$OUT/cli.jsonl" | cut -c1-200
tail -n 3 /tmp/bench/logs/*.log >"$OUT/clilogs.txt" 2>&1
say "done"
