# Shared by the device scripts (issue26_device.sh, multigpu_device.sh): sourced, not run. The environment every
# device run needs (NVLink multicast off, polars from /tmp/site), $OUT, the timer and the CLI runner.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/bench/logs
T0=$SECONDS
C=benchmarks/bench_multigpu_cli.py
say() { echo "[$((SECONDS - T0))s] $*"; }

cli() {  # cli NAME TIMEOUT CMD... : the commands at once, watched; one JSON line appended to $OUT/cli.jsonl
  local name=$1 limit=$2; shift 2
  local args=()
  for c in "$@"; do args+=(--cmd "$c"); done
  say "cli $name"
  timeout $((limit + 15)) python3 $C cli --name "$name" --timeout "$limit" --logs /tmp/bench/logs "${args[@]}" \
    --out "$OUT/cli.jsonl" | cut -c1-300
}
