"""Export a report's per-step scalars to TensorBoard or Weights & Biases, so pgdiag's curves overlay the training
dashboard's (`--to-tensorboard DIR` and `--to-wandb PROJECT` on `metrics` and `drift`, docs/cli.md).

Every per-step row (``breakdown = step``) becomes one scalar: tag = the metric key as the report holds it (so
`--key-style verl` gives verl's own keys), step = the row's step. Rows without a value are left out (TensorBoard
has no null). Written with tensorboard's own event-file writer (the optional extra `tensorboard`); the scalars
are float32 in the event file, as every TensorBoard scalar is. W&B gets the same rows (`step_scalars`) through
`wandb.log` in offline mode unless WANDB_MODE says otherwise (the optional extra `wandb`); its values stay float64.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import polars as pl

from pgdiag.errors import missing_package
from pgdiag.report.report import Report


def step_scalars(report: Report) -> pl.DataFrame:
    """(step, metric, value) of every per-step row with a finite value, in step order."""
    rows = report.summary.filter((pl.col("breakdown") == "step") & pl.col("value").is_not_null())
    rows = rows.with_columns(pl.col("bucket").cast(pl.Int64, strict=False).alias("step"))
    rows = rows.filter(pl.col("step").is_not_null() & pl.col("value").is_finite())
    return rows.select("step", pl.col("metric").cast(pl.String), "value").sort("step", maintain_order=True)


def export_tensorboard(report: Report, logdir: str | Path) -> Path:
    """Write every per-step scalar of `report` as one TensorBoard event file under `logdir`; returns the file."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise missing_package(
            "--to-tensorboard", "tensorboard", "pip install 'pgdiag[tensorboard]'"
        ) from None
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    before = set(logdir.glob("events.out.tfevents.*"))
    writer = EventFileWriter(str(logdir))
    now = time.time()
    scalars = step_scalars(report)
    for (step,), rows in scalars.group_by(["step"], maintain_order=True):
        values = [
            Summary.Value(tag=tag, simple_value=float(v))
            for tag, v in rows.select("metric", "value").iter_rows()
        ]
        writer.add_event(Event(wall_time=now, step=int(step), summary=Summary(value=values)))
    writer.close()
    (written,) = set(logdir.glob("events.out.tfevents.*")) - before
    return written


def export_wandb(report: Report, project: str, directory: str | Path) -> Path:
    """Log every per-step scalar of `report` as one W&B run of `project` under `directory`/wandb/; returns the
    run directory. Offline (no network) unless the environment sets WANDB_MODE."""
    try:
        import wandb
    except ImportError:
        raise missing_package("--to-wandb", "wandb", "pip install 'pgdiag[wandb]'") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        dir=str(directory),
        mode=os.environ.get("WANDB_MODE", "offline"),
        settings=wandb.Settings(silent=True, console="off"),
    )
    try:
        scalars = step_scalars(report)
        for (step,), rows in scalars.group_by(["step"], maintain_order=True):
            run.log({tag: float(v) for tag, v in rows.select("metric", "value").iter_rows()}, step=int(step))
        run_dir = Path(run.dir).parent  # run.dir is the run's files/ folder
    finally:
        run.finish()
        if wandb.run is None:  # no run of the caller's is open: stop W&B's service so its log is flushed now
            wandb.teardown()
    return run_dir
