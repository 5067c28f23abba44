"""Capture Fast-LLM's training documents from its Redis stream, for ``pgdiag import --preset fast-llm``.

Fast-LLM (7d61a1ba) reads documents from Redis stream ``fast_llm_streaming`` through consumer group
``fast_llm_group`` with ``noack=True`` and writes none to disk. `capture` reads the same stream with plain
``XREAD`` from its first entry: it never joins the group, acknowledges or trims, so the trainer receives every
message as before. Start it before the trainer.

Each message becomes one JSON line, in stream order: ``{"id": entry id, "tokens": B64,
"old_log_probabilities": B64, "model_version": B64, "data": the JSON string as sent}``, absent fields omitted,
B64 being standard padded base64 of the raw bytes (int64, float32, int64 little-endian, one per token).
Messages carry no step: with ``docs_per_step`` N, message k (0-based) goes to
``capture_<first_step + k // N>.jsonl``, written as ``.partial`` and renamed into place when its N messages are
in; the last incomplete block stays ``.partial`` (the importer skips it). Without N every message goes to
``capture_<first_step>.jsonl``, renamed into place when the capture stops. Needs the optional ``redis``
package (``pip install 'pgdiag[redis]'``).
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pgdiag.errors import Code, UsageError, missing_package

STREAM = "fast_llm_streaming"
_BYTE_FIELDS = ("tokens", "old_log_probabilities", "model_version")


@dataclass(frozen=True)
class CaptureSettings:
    """How messages are cut into step files and when the capture stops (default: never, until Ctrl-C)."""

    docs_per_step: int | None = None  # documents the trainer consumes per optimizer step
    first_step: int = 1
    max_messages: int | None = None
    idle_timeout_s: float | None = None  # stop after this long without a message
    block_ms: int = 1000  # XREAD blocking time per call
    batch: int = 256  # messages per XREAD call

    def check(self) -> None:
        if self.docs_per_step is not None and self.docs_per_step < 1:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--docs-per-step {self.docs_per_step}: expected >= 1")
        if self.first_step < 0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--first-step {self.first_step}: steps are >= 0")


@dataclass
class CaptureResult:
    """What a capture wrote: complete step files, the last incomplete block (if any), the message count."""

    n_messages: int = 0
    complete_files: list[Path] = field(default_factory=list)
    partial_file: Path | None = None
    interrupted: bool = False


def message_line(entry_id: bytes | str, fields: dict[bytes, bytes]) -> str:
    """The JSON line recording one stream entry (keys and values as Redis returns them, bytes)."""
    record: dict[str, Any] = {"id": entry_id.decode() if isinstance(entry_id, bytes) else entry_id}
    for key, value in fields.items():
        name = key.decode() if isinstance(key, bytes) else key
        raw = value if isinstance(value, bytes) else str(value).encode()
        if name in _BYTE_FIELDS:
            record[name] = base64.b64encode(raw).decode("ascii")
        elif name == "data":
            record["data"] = raw.decode("utf-8")
    return json.dumps(record, separators=(",", ":")) + "\n"


class _StepFiles:
    """Writes message lines into capture_<S>.jsonl.partial and renames each block into place when full."""

    def __init__(
        self, out: Path, settings: CaptureSettings, result: CaptureResult, progress: Callable[[str], None]
    ):
        self.out = out
        self.settings = settings
        self.result = result
        self.progress = progress
        self.handle: IO[str] | None = None
        self.step: int | None = None
        self.in_block = 0

    def _partial(self, step: int) -> Path:
        return self.out / f"capture_{step}.jsonl.partial"

    def write(self, line: str) -> None:
        k = self.result.n_messages
        per = self.settings.docs_per_step
        step = self.settings.first_step + (k // per if per else 0)
        if self.handle is None:
            self.step = step
            self.handle = open(self._partial(step), "w", encoding="utf-8")  # noqa: SIM115 - kept open across calls
            self.in_block = 0
        self.handle.write(line)
        self.in_block += 1
        self.result.n_messages += 1
        if per and self.in_block == per:
            self.finish()

    def finish(self) -> None:
        """Close the open block and rename it into place."""
        if self.handle is None or self.step is None:
            return
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None
        final = self.out / f"capture_{self.step}.jsonl"
        os.replace(self._partial(self.step), final)
        self.result.complete_files.append(final)
        self.progress(f"{final.name}: {self.in_block} documents")

    def stop(self) -> None:
        """At the end: without docs_per_step the one file is complete; otherwise an open block stays partial."""
        if self.handle is None:
            return
        if self.settings.docs_per_step is None:
            self.finish()
            return
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None
        self.result.partial_file = self._partial(self.step or 0)


def capture(
    redis_url: str,
    out_dir: str | Path,
    settings: CaptureSettings = CaptureSettings(),
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> CaptureResult:
    """Record stream ``fast_llm_streaming`` at `redis_url` into `out_dir` until a limit or Ctrl-C."""
    settings.check()
    try:
        import redis
    except ImportError as exc:
        raise missing_package("the Fast-LLM capture", "redis", "pip install 'pgdiag[redis]'") from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.glob("capture_*.jsonl*"))
    if existing:
        raise UsageError(
            Code.OUTPUT_EXISTS, f"{out}: holds capture files already ({existing[0]})", "use an empty folder"
        )
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        raise UsageError(Code.INPUT_NOT_FOUND, f"{redis_url}: cannot reach Redis ({exc})") from exc
    result = CaptureResult()
    files = _StepFiles(out, settings, result, progress)
    last_id = "0-0"
    last_message = time.monotonic()
    try:
        while settings.max_messages is None or result.n_messages < settings.max_messages:
            reply = client.xread({STREAM: last_id}, count=settings.batch, block=settings.block_ms)
            if not reply:
                if (
                    settings.idle_timeout_s is not None
                    and time.monotonic() - last_message > settings.idle_timeout_s
                ):
                    break
                continue
            last_message = time.monotonic()
            for _, entries in reply:
                for entry_id, fields in entries:
                    files.write(message_line(entry_id, fields))
                    last_id = entry_id
                    if settings.max_messages is not None and result.n_messages >= settings.max_messages:
                        break
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        files.stop()
    return result
