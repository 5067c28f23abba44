"""Recompute across several GPUs through the CLI: synthetic checkpoints on disk, launch layouts, load I/O per rank.

What: subcommands that a device run chains (each writes JSON):
- ``write-ckpt``: a synthetic bf16 checkpoint (`bench_multigpu.synthetic_values`, the numbers the library bench
  uses) as sharded safetensors, one shard per layer, written by several processes at once (one GPU each makes
  the values), each file fsync'ed and dropped from the page cache; ``--seconds`` stops at a time budget and keeps
  the layers written so far (the config says how many), ``--layers`` cuts the model.
- ``make-run``: a run of rollouts with realistic RL lengths (prompt 128-512, response log-normal around 800,
  capped at 3,500) for a vocabulary.
- ``drop-cache``: posix_fadvise(DONTNEED) on every file under a directory (the page cache forgets them).
- ``odirect``: an O_DIRECT read of a directory's files by several processes at once: the disk's rate.
- ``cli``: one or more commands run at once (``--cmd 'ENV=.. pgdiag logprobs ..'`` each), every process of
  each tree watched every 0.2 s: wall time, per-process ``read_bytes``/``rchar`` (``/proc/PID/io``) and peak
  ``RssAnon``/``RssFile``, the RANK of each worker, and each command's ``--json`` object.
- ``same``: compare the log-prob streams of tags of a run: bit-identical or the max |difference|.

How to run (device; see docs/benchmarks.md for the exact chains):
    python benchmarks/bench_multigpu_cli.py write-ckpt --model qwen3-8b --dir /tmp/c8 --workers 4
    python benchmarks/bench_multigpu_cli.py make-run --vocab 151936 --rollouts 64 --steps 4 --dir /tmp/r
    python benchmarks/bench_multigpu_cli.py cli --out a.json --cmd 'CUDA_VISIBLE_DEVICES=0 pgdiag logprobs ...'
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _shards(model: str, layers: int | None) -> tuple[dict, list[tuple[str, list[tuple[str, tuple]]]]]:
    """(config dict, [(file name, [(tensor, shape)])]) for one file per layer plus embed and head files."""
    from bench_multigpu import MODELS

    from pgdiag.model import ModelConfig
    from pgdiag.model.expected_tensors import expected_shapes

    raw = dict(MODELS[model])
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if "mlp_only_layers" in raw:
            raw["mlp_only_layers"] = []
    shapes = expected_shapes(ModelConfig.from_hf_dict(raw, source=model))
    n = raw["num_hidden_layers"]
    files: dict[str, list] = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            file = f"model-layer-{int(name.split('.')[2]):05d}.safetensors"
        elif name == "model.embed_tokens.weight":
            file = "model-embed.safetensors"
        else:
            file = "model-head.safetensors"
        files.setdefault(file, []).append((name, shape))
    order = ["model-embed.safetensors", *(f"model-layer-{i:05d}.safetensors" for i in range(n))]
    order.append("model-head.safetensors")
    return raw, [(f, files[f]) for f in order]


def write_safetensors(path: Path, tensors: list[tuple[str, tuple]], make) -> int:
    """Stream tensors into a safetensors file (8-byte header length, JSON header, raw data): one tensor in
    memory at a time. `make(name, shape)` returns a bf16 CPU tensor. Returns bytes written."""
    import torch

    header, offset = {}, 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in tensors:
            value = make(name, shape)
            assert value.dtype == torch.bfloat16 and tuple(value.shape) == tuple(shape)
            f.write(value.contiguous().view(torch.int16).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    tmp.rename(path)
    return 8 + len(blob) + offset


def _write_worker(args: tuple) -> list[tuple[str, int, float]]:
    """Write every `workers`-th file (from `index`) until the deadline; returns (file, bytes, seconds)."""
    model, layers, directory, index, workers, deadline, use_cuda = args
    import torch
    from bench_multigpu import synthetic_values

    device = torch.device(f"cuda:{index % torch.cuda.device_count()}" if use_cuda else "cpu")
    _, plan = _shards(model, layers)
    done = []
    for n, (file, tensors) in enumerate(plan):
        if n % workers != index:
            continue
        if time.time() > deadline and file.startswith("model-layer"):
            continue  # out of time: the embedding and head files are still written
        t0 = time.perf_counter()
        size = write_safetensors(Path(directory) / file, tensors,
                                 lambda name, shape: synthetic_values(name, shape, None, device).cpu())  # fmt: skip
        done.append((file, size, time.perf_counter() - t0))
    return done


def write_ckpt(args: argparse.Namespace) -> dict:
    import multiprocessing as mp

    import torch

    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.seconds
    t0 = time.perf_counter()
    jobs = [(args.model, args.layers, str(directory), i, args.workers, deadline, torch.cuda.is_available())
            for i in range(args.workers)]  # fmt: skip
    with mp.get_context("spawn").Pool(args.workers) as pool:
        written = [row for rows in pool.map(_write_worker, jobs) for row in rows]
    seconds = time.perf_counter() - t0
    raw, plan = _shards(args.model, args.layers)
    done = {f for f, _, _ in written}
    layers = 0
    while f"model-layer-{layers:05d}.safetensors" in done and layers < raw["num_hidden_layers"]:
        layers += 1
    for extra in directory.glob("model-layer-*.safetensors"):
        if int(extra.stem.split("-")[-1]) >= layers:
            extra.unlink()
    raw, plan = _shards(args.model, layers)
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    weight_map = {name: file for file, tensors in plan for name, _ in tensors}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    total = sum(s for f, s, _ in written if f in {p for p, _ in plan})
    return {"dir": str(directory), "layers": layers, "bytes": total, "seconds": seconds,
            "write_gb_per_s": total / seconds / 1e9, "workers": args.workers, "files": len(plan)}  # fmt: skip


def make_run(args: argparse.Namespace) -> dict:
    import polars as pl

    from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

    rng = np.random.default_rng(args.seed)
    rows = []
    for i in range(args.rollouts):
        prompt = int(rng.integers(128, 513))
        response = int(min(3500, max(16, rng.lognormal(math.log(800), 0.7))))
        n = prompt + response
        rows.append({
            "step": i * args.steps // args.rollouts, "sample_id": f"s{i}", "group_id": f"g{i // 8}",
            "input_ids": rng.integers(0, args.vocab, n).tolist(), "prompt_len": prompt,
            "loss_mask": [t >= prompt for t in range(n)],
            "rollout_logprobs": [-0.5 if t >= prompt else None for t in range(n)],
        })  # fmt: skip
    frame = pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32)})
    write_rollouts(frame, args.dir, label="bench", source=source_meta("synthetic"),
                   streams_meta={"rollout": stream_meta("rollout_logprobs", tempered=False)},
                   sampling={"temperature": 1.0}, overwrite=True)  # fmt: skip
    lengths = [len(r["input_ids"]) for r in rows]
    return {"dir": args.dir, "rollouts": args.rollouts, "steps": args.steps, "positions": sum(lengths)}


def drop_cache(directory: Path) -> int:
    """posix_fadvise(DONTNEED) every file under `directory`; returns the bytes covered."""
    total = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _odirect_worker(args: tuple) -> int:
    files, limit = args
    block = 16 << 20
    buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
    done = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while done < limit:
                n = os.readv(fd, [buf])
                done += n
                if n < block:
                    break
        finally:
            os.close(fd)
        if done >= limit:
            break
    return done


def odirect(args: argparse.Namespace) -> dict:
    import multiprocessing as mp

    files = sorted(str(p) for p in Path(args.dir).glob("*.safetensors"))
    per = [(files[i :: args.workers], args.limit_gb * 1e9 / args.workers) for i in range(args.workers)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        got = sum(pool.map(_odirect_worker, per))
    seconds = time.perf_counter() - t0
    return {"bytes": got, "seconds": seconds, "read_gb_per_s": got / seconds / 1e9, "workers": args.workers}


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "rchar", "write_bytes"):
                out[key] = int(value)
    except OSError:
        pass
    return out


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = {k: v for k, _, v in (e.decode(errors="replace").partition("=") for e in env)}
    return found.get("RANK") if "LOCAL_RANK" in found else None


def _watch(root: subprocess.Popen, seen: dict[int, dict], stop: threading.Event) -> None:
    import psutil

    while not stop.is_set():
        try:
            procs = [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            now = _proc_status(proc.pid)
            if not now:
                continue
            if proc.pid not in seen:
                try:
                    cmd = " ".join(proc.cmdline()[:6])
                except psutil.Error:
                    cmd = ""
                seen[proc.pid] = {"rank": _rank_of(proc.pid), "cmd": cmd}
            entry = seen[proc.pid]
            for key, value in now.items():
                entry[key] = max(entry.get(key, 0), value)
        stop.wait(0.2)


def run_cli(args: argparse.Namespace) -> dict:
    """Start every --cmd at once, watch them, wait; per command: its own wall time (a thread per command waits
    for it), exit code, JSON object, and the processes that read more than 10 MB (the ranks; the parent's
    counts include its reaped children)."""
    started = []
    t0 = time.perf_counter()

    def wait(proc: subprocess.Popen, start: float, done: dict) -> None:
        done["stdout"], _ = proc.communicate(timeout=args.timeout)
        done["wall"] = time.perf_counter() - start

    for n, cmd in enumerate(args.cmd):
        log = open(Path(args.logs) / f"{args.name}-{n}.log", "w") if args.logs else subprocess.DEVNULL  # noqa: SIM115
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, stderr=log, text=True)
        seen: dict[int, dict] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(proc, seen, stop), daemon=True)
        watcher.start()
        done: dict = {}
        waiter = threading.Thread(target=wait, args=(proc, start, done), daemon=True)
        waiter.start()
        started.append((cmd, proc, seen, stop, watcher, waiter, done))
    rows = []
    for cmd, proc, seen, stop, watcher, waiter, done in started:
        waiter.join()
        stop.set()
        watcher.join()
        objects = [json.loads(line) for line in done.get("stdout", "").splitlines() if line.startswith("{")]
        readers = [seen[p] for p in sorted(seen) if seen[p].get("rchar", 0) > 10**7]
        rows.append({
            "cmd": cmd, "exit": proc.returncode, "wall_s": done.get("wall"), "json": objects[-1] if objects else None,
            "readers": readers, "processes": len(seen),
        })  # fmt: skip
    return {"name": args.name, "wall_s": time.perf_counter() - t0, "runs": rows}


def same(args: argparse.Namespace) -> dict:
    """Compare tags' streams with the first: every sample once, bit-identical or the max |difference|."""
    import polars as pl

    def load(tag: str) -> pl.DataFrame:
        parts = sorted((Path(args.run) / "logprobs" / tag).glob("step=*/part-*.parquet"))
        return pl.concat([pl.read_parquet(p) for p in parts]).sort(["step", "sample_id"])

    base = load(args.tags[0])
    out = {"base": args.tags[0], "samples": base.height, "unique": base["sample_id"].n_unique()}
    for tag in args.tags[1:]:
        other = load(tag)
        row = {"samples": other.height, "unique": other["sample_id"].n_unique(),
               "same_keys": other["sample_id"].to_list() == base["sample_id"].to_list()}  # fmt: skip
        if row["same_keys"]:
            row["bit_identical"] = other.select("logprobs", "entropy").equals(
                base.select("logprobs", "entropy")
            )
            a = np.array(base["logprobs"].explode().drop_nulls().to_list())
            b = np.array(other["logprobs"].explode().drop_nulls().to_list())
            row["max_abs"] = float(np.abs(a - b).max()) if len(a) == len(b) and len(a) else None
            row["mean_abs"] = float(np.abs(a - b).mean()) if len(a) == len(b) and len(a) else None
        out[tag] = row
    return out


def share(args: argparse.Namespace) -> dict:
    """Bytes each TP rank must read of a checkpoint: its slices of sharded tensors, replicated ones whole."""
    from pgdiag.model import read_model_config
    from pgdiag.model.tensor_source import open_tensor_source
    from pgdiag.model.tp import shard_slice, tp_layout

    config = read_model_config(args.dir)
    per_rank = []
    with open_tensor_source(Path(args.dir)) as source:
        names = source.names()
        total = sum(2 * math.prod(source.shape(n)) for n in names)
        for rank in range(args.tp):
            layout = tp_layout(config, args.tp, rank)
            size = 0
            for name in names:
                shape = source.shape(name)
                part = shard_slice(name, shape, layout)
                whole = 2 * math.prod(shape)
                size += whole if part is None else whole * (part.stop - part.start) // shape[part.dim]
            per_rank.append(size)
    return {"tp": args.tp, "checkpoint_bytes": total, "share_bytes": per_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write-ckpt")
    w.add_argument("--model", required=True)
    w.add_argument("--dir", required=True)
    w.add_argument("--layers", type=int, default=None)
    w.add_argument("--workers", type=int, default=4)
    w.add_argument("--seconds", type=float, default=1e9)
    r = sub.add_parser("make-run")
    r.add_argument("--dir", required=True)
    r.add_argument("--vocab", type=int, required=True)
    r.add_argument("--rollouts", type=int, default=64)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("drop-cache")
    d.add_argument("--dir", required=True)
    o = sub.add_parser("odirect")
    o.add_argument("--dir", required=True)
    o.add_argument("--workers", type=int, default=4)
    o.add_argument("--limit-gb", type=float, default=40.0)
    c = sub.add_parser("cli")
    c.add_argument("--name", required=True)
    c.add_argument("--cmd", action="append", required=True)
    c.add_argument("--logs", default=None)
    c.add_argument("--timeout", type=float, default=300)
    s = sub.add_parser("same")
    s.add_argument("--run", required=True)
    s.add_argument("--tags", nargs="+", required=True)
    h = sub.add_parser("share")
    h.add_argument("--dir", required=True)
    h.add_argument("--tp", type=int, required=True)
    for p in (w, r, d, o, c, s, h):
        p.add_argument("--out", default=None, help="append the JSON result as one line to this file")
    args = parser.parse_args()
    if args.what == "write-ckpt":
        result = write_ckpt(args)
    elif args.what == "make-run":
        result = make_run(args)
    elif args.what == "drop-cache":
        t0 = time.perf_counter()
        result = {"bytes": drop_cache(Path(args.dir)), "seconds": time.perf_counter() - t0}
    elif args.what == "odirect":
        result = odirect(args)
    elif args.what == "cli":
        result = run_cli(args)
    elif args.what == "share":
        result = share(args)
    else:
        result = same(args)
    result = {"what": args.what, "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), **result}
    line = json.dumps(result)
    print(line[:4000], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
