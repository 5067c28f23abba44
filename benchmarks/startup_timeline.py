"""Where a `pgdiag logprobs` start goes: a phase timeline of one CLI run, in this process, with wall-clock marks.

What: runs ``pgdiag <args>`` in-process (as `pgdiag.cli.main` does: one malloc arena, the bytecode cache) after
wrapping the recompute's steps with timers, and writes one JSON object: seconds since the process was started
(``--t0``, the shell's ``date +%s.%N`` just before ``python3``) for the imports (torch, triton, polars, the CLI),
CUDA initialisation (whichever thread does it), the weight stream's start, reading the run (`plan_recompute`),
the compile warm-up (`warm_pointwise_ops`), each compiled pointwise op's first calls, the load's waits on the
stream, the first forwards and head calls (each followed by a device synchronisation, so its kernels' load and
launch are counted in it), the part writes, the end; `torch._dynamo`'s compile times and cache counters; and a
sampled wall-time profile of the main thread (every 5 ms, inclusive seconds per function, per phase).

The exit: each ``atexit`` handler registered after the start is timed, and the last one to run (registered first)
writes ``<out>.exit.json`` (the handlers' seconds and the time it ran); the shell's wall time less that is the
teardown after the handlers (the interpreter freeing the modules, C++ destructors, the kernel ending the process).
The process ends as the CLI's does (`pgdiag.cli.exit_now` where the tree under test has it, else ``sys.exit``).

Why: the issue's start-up target is a fixed cost in seconds; cProfile distorts it and misses time spent waiting on
other threads, a sampler in wall time does not. A benchmark, not a library feature: the library stays unchanged.

    T0=$(date +%s.%N); python3 benchmarks/startup_timeline.py --t0 $T0 --out t.json -- logprobs RUN --model CKPT
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path


class Timeline:
    """Marks (name, thread, start, end) in seconds since t0, and a main-thread sampler."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.marks: list[dict] = []
        self.phase = "imports"
        self.samples: dict[str, Counter] = {}  # phase -> function -> inclusive seconds
        self.own: dict[str, Counter] = {}  # phase -> innermost function -> seconds
        self.main = threading.main_thread().ident
        self._stop = threading.Event()

    def now(self) -> float:
        return time.time() - self.t0

    def mark(self, name: str, start: float, end: float | None = None, **extra: object) -> None:
        self.marks.append({
            "name": name, "thread": threading.current_thread().name, "start": round(start, 4),
            "end": None if end is None else round(end, 4), **extra,
        })  # fmt: skip

    def wrap(self, owner: object, attr: str, name: str, *, first: int = 10**9, sync: bool = False) -> None:
        """Replace `owner.attr` by a timed version (the first `first` calls marked; `sync`: device sync after)."""
        original = getattr(owner, attr)
        calls = [0]
        timeline = self

        @functools.wraps(original)
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] > first:
                return original(*args, **kwargs)
            previous, timeline.phase = timeline.phase, name
            start = timeline.now()
            try:
                result = original(*args, **kwargs)
                if sync:
                    import torch

                    if torch.cuda.is_initialized():
                        torch.cuda.synchronize()
                return result
            finally:
                timeline.mark(name, start, timeline.now(), call=calls[0])
                timeline.phase = previous

        setattr(owner, attr, timed)

    def sample(self, every: float = 0.005) -> None:
        def run() -> None:
            last = time.perf_counter()
            while not self._stop.wait(every):
                now = time.perf_counter()
                weight, last = now - last, now  # the wait may run long while the main thread holds the GIL
                frame = sys._current_frames().get(self.main)
                if frame is None:
                    continue
                seen = set()
                top = None
                while frame is not None:
                    code = frame.f_code
                    key = f"{Path(code.co_filename).name}:{code.co_name}"
                    top = top or key
                    if not code.co_filename.startswith("<frozen"):
                        seen.add(key)
                    frame = frame.f_back
                counts = self.samples.setdefault(self.phase, Counter())
                for key in seen:
                    counts[key] += weight
                self.own.setdefault(self.phase, Counter())[top] += weight

        threading.Thread(target=run, daemon=True, name="sampler").start()

    def stop(self) -> None:
        self._stop.set()


def time_exit(tl: Timeline, out: Path) -> None:
    """Time each atexit handler registered from now on; the first registered (so the last to run) writes them."""
    import atexit

    handlers: list[dict] = []
    register = atexit.register

    def report() -> None:
        at = tl.now()
        out.write_text(json.dumps({"handlers": handlers, "last_handler_end": round(at, 4)}, indent=1))

    register(report)

    def timed_register(func, *args, **kwargs):  # type: ignore[no-untyped-def]
        def timed() -> None:
            start = tl.now()
            try:
                func(*args, **kwargs)
            finally:
                name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
                handlers.append({"name": name, "start": round(start, 4), "s": round(tl.now() - start, 4)})

        register(timed)
        return func

    atexit.register = timed_register


def instrument(tl: Timeline) -> None:
    """Wrap the recompute's steps (imported here, after the import marks)."""
    import torch

    import pgdiag.model.checkpoint as checkpoint
    import pgdiag.model.transformer as transformer
    import pgdiag.recompute.forward as forward
    import pgdiag.recompute.logprobs as logprobs
    import pgdiag.recompute.model_spec as model_spec
    from pgdiag.recompute import jobs

    original_init = torch.cuda._lazy_init

    def lazy_init() -> None:
        if torch.cuda.is_initialized():
            return original_init()
        start = tl.now()
        original_init()
        tl.mark("cuda_lazy_init", start, tl.now())

    torch.cuda._lazy_init = lazy_init
    tl.wrap(jobs, "recompute_rank", "recompute_rank")
    tl.wrap(logprobs, "start_stream", "start_stream")
    tl.wrap(logprobs, "plan_recompute", "plan_recompute")
    tl.wrap(logprobs, "inspect_output", "inspect_output")
    tl.wrap(logprobs, "check_finite_weights", "check_finite_weights", sync=True)
    tl.wrap(logprobs, "compute_parts", "compute_parts")
    tl.wrap(model_spec.ModelSpec, "load", "load")
    tl.wrap(checkpoint, "warm_pointwise_ops", "warm_pointwise_ops", sync=True)
    if hasattr(checkpoint, "warm_library_kernels"):  # trees with it
        tl.wrap(checkpoint, "warm_library_kernels", "warm_library_kernels", sync=True)
    tl.wrap(checkpoint, "_read", "load_read", first=3)
    tl.wrap(checkpoint, "CausalLM", "build_model_meta")
    tl.wrap(transformer.CausalLM, "forward_packed", "forward", first=3, sync=True)
    tl.wrap(forward, "lm_head_logprobs", "lm_head", first=3, sync=True)
    tl.wrap(forward, "write_part", "write_part", first=2)
    tl.wrap(forward, "pack_samples", "pack_samples", first=2)
    original_ops = transformer.pointwise_ops

    def pointwise_ops(fused: bool):  # type: ignore[no-untyped-def]
        ops = original_ops(fused)
        holder = type("Ops", (), {})()
        for field in ("rms_norm", "rms_norm_fp32_weight", "rope", "swiglu"):
            setattr(holder, field, getattr(ops, field))
            tl.wrap(holder, field, f"op_{field}", first=3, sync=True)
        return type(ops)(
            holder.rms_norm, holder.rms_norm_fp32_weight, holder.rope, holder.swiglu, ops.moe_combine
        )

    transformer.pointwise_ops = pointwise_ops
    # the stream's waits: how long the loader blocks on each tensor, summed
    import pgdiag.model.weight_stream as weight_stream

    original_take = weight_stream.WeightStream.take
    waited = [0.0, 0]

    def take(self, name, part):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return original_take(self, name, part)
        finally:
            waited[0] += time.perf_counter() - start
            waited[1] += 1

    weight_stream.WeightStream.take = take
    tl.stream_wait = waited  # type: ignore[attr-defined]
    try:  # the thread computing Triton's installation key (trees that have it)
        import pgdiag.model.warmup as warmup

        compute = warmup._compute_triton_key

        def compute_marked() -> None:  # marked, the sampler's phase (the main thread's) left alone
            start = tl.now()
            compute()
            tl.mark("triton_key_thread", start, tl.now())

        warmup._compute_triton_key = compute_marked
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--t0", type=float, required=True, help="the shell's date +%%s.%%N before python3 started"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-sample", action="store_true")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    tl = Timeline(opts.t0)
    tl.mark("python_main", tl.now())
    time_exit(tl, Path(opts.out).with_suffix(".exit.json"))
    if not opts.no_sample:
        tl.sample()
    from pgdiag.cli import bytecode_cache, one_malloc_arena

    one_malloc_arena(os.environ)
    bytecode_cache(os.environ)
    for module in (
        "torch",
        "triton",
        "polars",
        "numpy",
        "pyarrow",
        "typer",
        "rich",
        "pgdiag.cli.app",
        "pgdiag.recompute.jobs",
        "pgdiag.model.checkpoint",
        "pgdiag.kernels.lm_head_logprobs_triton",
    ):
        tl.phase = f"import {module}"
        start = tl.now()
        try:
            __import__(module)
        except ImportError as error:
            tl.mark(f"import {module} FAILED {error}", start, tl.now())
            continue
        tl.mark(f"import {module}", start, tl.now())
    tl.phase = "cli"
    instrument(tl)
    from pgdiag.cli import run

    start = tl.now()
    code = run(args)
    tl.mark("cli_run", start, tl.now(), exit=code)
    tl.stop()
    import torch

    result: dict = {"marks": sorted(tl.marks, key=lambda m: m["start"]), "exit": code}
    result["stream_wait_s"], result["stream_takes"] = tl.stream_wait  # type: ignore[attr-defined]
    heavy = ("torch._dynamo", "torch._inductor", "torch._inductor.compile_fx", "pandas", "sympy")
    result["imported"] = {name: name in sys.modules for name in heavy}  # before the query below imports any
    if result["imported"]["torch._dynamo"]:
        from torch._dynamo.utils import compile_times, counters

        result["dynamo_compile_times"] = compile_times(repr="str", aggregate=True)
        result["counters"] = {k: dict(v) for k, v in counters.items() if v}
    result["torch"] = torch.__version__
    result["sampled_inclusive_s"] = {
        phase: [(k, round(v, 3)) for k, v in counts.most_common(60)] for phase, counts in tl.samples.items()
    }
    result["sampled_own_s"] = {
        phase: [(k, round(v, 3)) for k, v in counts.most_common(15)] for phase, counts in tl.own.items()
    }
    result["end"] = tl.now()
    Path(opts.out).write_text(json.dumps(result, indent=1))
    import pgdiag.cli

    exit_now = getattr(pgdiag.cli, "exit_now", None)  # the CLI's own exit, where this tree has one
    exit_now(code) if exit_now is not None else sys.exit(code)


if __name__ == "__main__":
    main()
