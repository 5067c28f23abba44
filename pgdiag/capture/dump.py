"""What every hook shares: the guard that keeps a hook's errors out of training, CPU copies, atomic files.

A hook records by calling `HookGuard.record(fn, *args)`: `fn` runs only while the hook is enabled; any
exception it raises is logged once (with its traceback) on the ``pgdiag.capture`` logger and disables the hook
for the rest of the run. The training call itself is never inside the guard, so its own errors propagate
unchanged. Files are written by `write_hookdump` through `pgdiag.atomic_files.atomic_write`: ``torch.save`` to a
temporary name in `out_dir`, fsync, ``os.replace``, so a reader never sees half a file. Nothing here draws from
a seeded random generator (the temporary name's random part comes from the OS, `secrets`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Self

import torch

from pgdiag.atomic_files import atomic_write

HOOKDUMP_FORMAT = "pgdiag.hookdump/v1"
LOGGER_NAME = "pgdiag.capture"


@dataclass
class HookGuard:
    """The on/off switch of one installed hook; `failed` holds the first error's text once it has fired."""

    framework: str
    enabled: bool = True
    failed: str | None = None

    def record(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` if enabled; on any exception log it once and disable the hook."""
        if not self.enabled:
            return
        try:
            fn(*args)
        except Exception as exc:
            self.enabled = False
            self.failed = f"{type(exc).__name__}: {exc}"
            logging.getLogger(LOGGER_NAME).error(
                "pgdiag %s hook disabled after an error; training continues without it: %s",
                self.framework,
                self.failed,
                exc_info=True,
            )

    def after(self, method: Callable[..., Any], record: Callable[[Any], None]) -> Callable[..., Any]:
        """`method`, wrapped so that its result goes to `record` (guarded, as `record` here) before it is
        returned; the call itself is never guarded."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.record(record, result)
            return result

        return wrapped


class HookRecorder:
    """What every framework's recorder holds: the trainer, the output folder, the stride `every` and its guard."""

    def __init__(self, trainer: Any, out_dir: Path, every: int, framework: str) -> None:
        self.trainer = trainer
        self.out_dir = out_dir
        self.every = every
        self.guard = HookGuard(framework)

    @classmethod
    def for_install(cls, trainer: Any, out_dir: str | Path, every: int) -> Self:
        """A recorder of this framework for `trainer`; ValueError unless `every` >= 1 and `trainer` has no pgdiag
        hook installed yet."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if getattr(trainer, "_pgdiag_hook", None) is not None:
            raise ValueError("a pgdiag hook is already installed on this trainer")
        return cls(trainer, Path(out_dir), every)  # each subclass names its framework


def framework_version(distribution: str) -> str:
    """The installed version of `distribution`, or "unknown"."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def cpu_copy(value: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (own storage); bf16/fp16/fp64 widened or narrowed to float32, bools kept."""
    out = value.detach().to("cpu", copy=True)
    if out.is_floating_point() and out.dtype != torch.float32:
        out = out.to(torch.float32)
    return out.contiguous()


def hookdump_name(step: int, rank: int, world_size: int) -> str:
    """``step_<S>.pt``, or ``step_<S>.rank<R>.pt`` when several processes write."""
    return f"step_{step}.pt" if world_size <= 1 else f"step_{step}.rank{rank}.pt"


def write_hookdump(
    out_dir: Path,
    *,
    framework: str,
    version: str,
    step: int,
    rank: int,
    world_size: int,
    tensors: Mapping[str, torch.Tensor],
    lists: Mapping[str, list[Any]],
    meta: Mapping[str, Any],
) -> Path:
    """Write one ``pgdiag.hookdump/v1`` file atomically and return its path."""
    payload = {
        "format": HOOKDUMP_FORMAT,
        "framework": framework,
        "framework_version": version,
        "step": int(step),
        "rank": int(rank),
        "world_size": int(world_size),
        "tensors": dict(tensors),
        "lists": {name: list(values) for name, values in lists.items()},
        "meta": dict(meta),
    }
    return atomic_write(out_dir / hookdump_name(step, rank, world_size), lambda tmp: torch.save(payload, tmp))


def plain(value: Any) -> Any:
    """`value` as a str/int/float/bool/None that ``weights_only`` loading accepts; anything else as str."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)
