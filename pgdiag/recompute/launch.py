"""Distributed setup for `pgdiag logprobs`: the rank layout, torchrun start-up, and self-launched local workers.

What: `setup_distributed` turns the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, plus
``MASTER_ADDR``/``MASTER_PORT``) into a process group (NCCL on CUDA, gloo on CPU) and one tensor-parallel
sub-group per data-parallel replica; `ParallelLayout` says which rank does what; `run_workers` starts
``nproc`` local workers through torch's elastic launch API on a free port (what ``--tp N [--dp M]`` does
without torchrun) and returns each worker's result.

Why: recompute is tensor parallel inside a replica (vocab-parallel head, sharded body) and data parallel across
replicas. Ranks are laid out TP-contiguous: replica ``d`` is ranks ``d*tp .. d*tp + tp - 1``. Each replica owns
whole parts of the output, its TP rank 0 writes them, and global rank 0 renders progress and writes the
manifest. pgdiag sets no NCCL environment variables.

How: ``setup = setup_distributed(tp=2, dp=None, device="cpu")`` inside each worker, then pass
``setup.tp_group`` to `pgdiag.recompute_logprobs`; or from a parent process
``results = run_workers(entry, job, nproc=4)`` with a module-level, picklable ``entry``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pgdiag.errors import Code, UsageError

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: global rank, its TP rank within its replica, its DP replica."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_writer(self) -> bool:
        """TP rank 0 of each replica writes that replica's parts."""
        return self.tp_rank == 0

    @property
    def is_main(self) -> bool:
        """Global rank 0 writes the manifest and renders progress."""
        return self.rank == 0


@dataclass(frozen=True)
class DistributedSetup:
    """An initialised process group: the layout, this rank's TP group (None when tp == 1) and its device."""

    layout: ParallelLayout
    tp_group: dist.ProcessGroup | None
    device: torch.device


def single_process_layout() -> ParallelLayout:
    """The layout of a plain, non-distributed run."""
    return ParallelLayout(rank=0, world_size=1, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)


def current_layout(tp_group: dist.ProcessGroup | None) -> ParallelLayout:
    """The layout implied by the default process group and `tp_group` (TP-contiguous ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        if tp_group is not None:
            raise UsageError(
                Code.BAD_PARALLEL_LAUNCH, "a tp_group was given but torch.distributed is not initialised"
            )
        return single_process_layout()
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if world % tp:
        raise UsageError(
            Code.BAD_PARALLEL_LAUNCH, f"TP group size {tp} does not divide the world size {world}"
        )
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    if tp_rank != rank % tp:
        raise UsageError(
            Code.BAD_PARALLEL_LAUNCH,
            "TP groups must be contiguous ranks (replica d = ranks d*tp .. d*tp+tp-1)",
        )
    return ParallelLayout(
        rank=rank, world_size=world, tp_rank=tp_rank, tp_size=tp, dp_rank=rank // tp, dp_size=world // tp
    )


def replica_parts(n_parts: int, dp_rank: int, dp_size: int) -> range:
    """Indices of the plan's parts that replica `dp_rank` of `dp_size` computes: part i goes to replica i mod dp,
    so the replicas share the plan whole, without overlap, and a resume finds each part's owner again."""
    return range(dp_rank, n_parts, dp_size)


def launched_by_torchrun(environ: dict[str, str] | None = None) -> bool:
    """True when this process carries a torchrun/elastic rank environment (RANK and WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def resolve_degrees(world_size: int, tp: int | None, dp: int | None) -> tuple[int, int]:
    """(tp, dp) for `world_size` processes: tp defaults to world / dp (all TP when dp is absent)."""
    if tp is None:
        tp = world_size // (dp or 1)
    if dp is None:
        dp = world_size // tp if tp > 0 else 0
    if tp < 1 or dp < 1 or tp * dp != world_size:
        raise UsageError(
            Code.BAD_PARALLEL_LAUNCH,
            f"--tp {tp} x --dp {dp} does not equal the world size {world_size}",
            hint="tp must divide the number of processes; dp = world / tp",
        )
    return tp, dp


def setup_distributed(*, tp: int | None, dp: int | None, device: str | None) -> DistributedSetup:
    """Initialise the default process group from the torchrun environment and build the TP sub-groups.

    `device` ``"cuda"`` (NCCL, ``cuda:LOCAL_RANK``) or ``"cpu"`` (gloo); None picks CUDA when available.
    Every rank must call this with the same arguments (``new_group`` is collective).
    """
    if not launched_by_torchrun():
        raise UsageError(
            Code.BAD_PARALLEL_LAUNCH, "no RANK/WORLD_SIZE in the environment; start with torchrun or --tp N"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise UsageError(Code.DEVICE_UNAVAILABLE, "--device cuda but CUDA is not available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    tp_size, dp_size = resolve_degrees(world, tp, dp)
    tp_group = None
    for replica in range(dp_size):
        ranks = list(range(replica * tp_size, (replica + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if dist.get_rank() in ranks:
            tp_group = group
    layout = current_layout(tp_group)
    where = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistributedSetup(layout=layout, tp_group=tp_group, device=where)


def teardown_distributed() -> None:
    """Destroy the default process group if this process initialised one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """A barrier over all ranks; nothing in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the launcher binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(entry: Callable[[T], Any], job: T, *, nproc: int) -> dict[int, Any]:
    """Start `nproc` local workers running ``entry(job)`` and return ``{rank: result}``.

    Workers get the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from torch's
    elastic launch API with a c10d rendezvous on a free local port, no restarts, and spawn start method, so
    `entry` must be a module-level function and `job` picklable. Ctrl-C stops every worker. A worker that
    dies (a signal, the OOM killer; `entry` itself must not raise) stops the others and raises UsageError
    E520 naming the worst exit, in one line: torch's own log of the failure (a traceback) is silenced.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise UsageError(Code.BAD_PARALLEL_LAUNCH, f"need at least one worker, got {nproc}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        run_id=f"pgdiag-{os.getpid()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        with _quiet_loggers(_ELASTIC_LOGGERS):
            return dict(elastic_launch(config, entry)(job))
    except SignalException:  # Ctrl-C or SIGTERM: the agent has already stopped the workers
        raise KeyboardInterrupt from None
    except ChildFailedError as failed:
        codes = [int(f.exitcode) for f in failed.failures.values()]
        worst = max(codes, key=abs)
        how = f"signal {signal.Signals(-worst).name}" if worst < 0 and -worst in _SIGNALS else f"exit {worst}"
        raise UsageError(
            Code.WORKER_DIED,
            f"{len(codes)} of {nproc} workers died ({how}); the others were stopped",
            "the parts already written are kept: run the same command again to resume",
        ) from None


_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing.spawn", "torch.distributed.launcher")
_SIGNALS = {s.value for s in signal.Signals}


@contextlib.contextmanager
def _quiet_loggers(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Raise the loggers named by these prefixes, and their children (torch's elastic loggers set their own
    level), to CRITICAL while the block runs: pgdiag reports a failed worker itself."""
    names = [*prefixes, *(n for n in logging.root.manager.loggerDict if n.startswith(prefixes))]
    loggers = [logging.getLogger(name) for name in dict.fromkeys(names)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
