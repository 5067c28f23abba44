"""Weights read ahead: this rank's tensors streamed from safetensors files to the device in background threads.

What: `start_weight_stream(path, device=, tp_rank=, tp_size=, dtype=, head_dtype=)` plans the reads the loader
will make (every tensor whole, or its slice under tensor parallelism: the same `shard_slice` plan) and starts
reading them at once: one thread asks the kernel to read the byte ranges ahead (``posix_fadvise(WILLNEED)``,
so the disk works from the first millisecond), a feeder thread initialises CUDA, allocates each tensor on the device
and hands 64 MB pieces to reader threads, which ``preadv`` a piece into a pinned staging buffer and copy it to the
device asynchronously on their own CUDA stream. `WeightStream.take(name, part)` (called by the loader,
`pgdiag.model.checkpoint.load_from_source`) waits for that tensor and returns it on the device in its stored
dtype, or None when the stream does not hold it; the loader then reads it the ordinary way
(`pgdiag.model.tensor_source`), so the stream changes no value and no error: a damaged file, a missing shard or
integer storage simply falls back to that path and its error codes. A column slice (row-parallel o_proj/down_proj
under TP) is a run of bytes per row: the readers ask only for this rank's runs, and the read-ahead asks the kernel
for the rows' whole span, so that the disk reads it in large requests (ranks on one node share the page cache: the
disk still reads each byte once; see docs/recompute.md).

Why: a recompute's start was the sum of reading the run, CUDA initialisation, the fused kernels' compile and
the weight copy (safetensors through ``mmap`` into pageable memory, then a synchronous copy: about 5 GB/s from the
page cache). Streaming overlaps the disk (or page cache) with all of those, and pinned buffers with several
readers bring the copy near PCIe speed (docs/benchmarks.md, "Start-up and TP 2 again").

How the pieces are kept apart: each reader owns two pinned buffers and waits for a buffer's previous copy (a CUDA
event) before refilling it; `take` makes the caller's stream wait for the copies of that tensor (events), so no
host synchronisation is needed. `close` stops the threads (a recompute that finds nothing to do, or fails, calls
it) and frees what was not taken. On a CPU device the same code runs with ordinary buffers and plain copies (the
tests use that).
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pgdiag.model.config import read_model_config
from pgdiag.model.tensor_source import head_storage_dtype
from pgdiag.model.tp import EXPERTS, TensorSlice, shard_kind, shard_slice, tp_layout

PIECE_BYTES = 64 << 20  # one read and one copy; two pinned buffers of this size per reader
AHEAD_BYTES = 8 << 30  # read-ahead asked of the kernel beyond what the readers have copied (page cache bound)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DONE = object()


@dataclass(frozen=True)
class ByteRange:
    """Tensor `name` (or its slice `part`) as `runs` equal runs of bytes of a safetensors file, run i at
    ``offset + i * stride``: one run for a whole tensor or a row slice, one run a row for a column slice."""

    name: str
    part: TensorSlice | None
    file: Path
    offset: int  # absolute byte offset in `file` of the first run
    nbytes: int  # all runs together: the slice's bytes
    shape: tuple[int, ...]  # of the slice
    dtype: torch.dtype  # as stored
    runs: int = 1
    stride: int = 0  # bytes from one run's start to the next's (a row of the whole tensor)

    @property
    def run_bytes(self) -> int:
        return self.nbytes // self.runs

    @property
    def span(self) -> int:
        """Bytes of the file from the first run's start to the last run's end."""
        return (self.runs - 1) * self.stride + self.run_bytes


def safetensors_header(file: Path) -> tuple[dict, int]:
    """(the header's tensor entries, the byte offset where the data starts) of a safetensors file."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def plan_ranges(files: dict[str, Path], wanted: list[tuple[str, TensorSlice | None]]) -> list[ByteRange]:
    """The byte ranges of the `wanted` (name, part) reads of float tensors: whole tensors, row slices (one run)
    and column slices of matrices (a run a row); the rest (other slices, integer or quantized storage, rows
    longer than a piece) is left to the ordinary reader."""
    headers = {file: safetensors_header(file) for file in sorted(set(files.values()))}
    ranges = []
    for name, part in wanted:
        file = files.get(name)
        entry, data_start = headers[file] if file else ({}, 0)
        info = entry.get(name)
        if info is None or info["dtype"] not in _DTYPES:
            continue
        shape, dtype = tuple(info["shape"]), _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:  # a damaged header: the loader reports it
            continue
        base = data_start + begin
        if part is not None and part.dim == 1 and len(shape) == 2:
            item = dtype.itemsize
            run = (part.stop - part.start) * item
            if shape[0] > 0 and 0 < run <= PIECE_BYTES:  # an empty matrix: nothing to stream
                rows = shape[0]
                ranges.append(
                    ByteRange(
                        name,
                        part,
                        file,
                        base + part.start * item,
                        rows * run,
                        (rows, part.stop - part.start),
                        dtype,
                        runs=rows,
                        stride=shape[1] * item,
                    )
                )
            continue
        if part is not None and (part.dim != 0 or not shape):
            continue
        row_bytes = (end - begin) // shape[0] if shape else end - begin
        start, stop = (0, shape[0] if shape else 1) if part is None else (part.start, part.stop)
        sliced = ((stop - start), *shape[1:]) if shape else ()
        ranges.append(
            ByteRange(name, part, file, base + start * row_bytes, (stop - start) * row_bytes, sliced, dtype)
        )
    return ranges


def planned_reads(config, layout, *, body: torch.dtype, head: torch.dtype, stored_head: torch.dtype):
    """The (name, part) reads `load_from_source` makes outside the experts, in its order: the body tensors, then
    the LM head's vocab rows (unless a tied head at TP = 1 shares the embedding)."""
    from pgdiag.model.expected_tensors import expected_shapes

    shapes = expected_shapes(config)
    reads = [
        (name, shard_slice(name, shape, layout))
        for name, shape in shapes.items()
        if name != "lm_head.weight" and shard_kind(name) != EXPERTS
    ]
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head_store = head_storage_dtype(head, stored_head == torch.float32, stored_head)
    if not (config.tie_word_embeddings and layout.tp_size == 1 and head_store == body):
        reads.append((head_name, TensorSlice(0, layout.vocab_start, layout.vocab_end)))
    return reads


class WeightStream:
    """Background reads of `ranges` onto `device`; `take` hands each tensor over once."""

    def __init__(self, ranges: list[ByteRange], device: torch.device, readers: int = 4) -> None:
        self.device = device
        self._ranges = {(r.name, r.part): r for r in ranges}
        self._order = list(ranges)
        self.taken = 0  # tensors handed to the loader
        self._copied = 0  # bytes the readers have copied (or given up on)
        self._ready: dict[tuple[str, TensorSlice | None], tuple[Tensor, list] | None] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pieces: queue.Queue = queue.Queue(maxsize=4 * readers)
        self._fds: dict[Path, int] = {}
        self._threads = [threading.Thread(target=self._advise, daemon=True, name="pgdiag-advise")]
        self._threads.append(
            threading.Thread(target=self._feed, args=(readers,), daemon=True, name="pgdiag-feed")
        )
        self._threads += [
            threading.Thread(target=self._read, daemon=True, name=f"pgdiag-read-{i}") for i in range(readers)
        ]
        for file in {r.file for r in ranges}:
            self._fds[file] = os.open(file, os.O_RDONLY)
        for thread in self._threads:
            thread.start()

    # the loader's side
    def take(self, name: str, part: TensorSlice | None) -> Tensor | None:
        """Tensor `name` (`part` of it) on the device in its stored dtype, or None when the stream lacks it."""
        key = (name, part)
        if key not in self._ranges:
            return None
        with self._cond:
            while key not in self._ready:
                self._cond.wait()
            entry = self._ready.pop(key)
            del self._ranges[key]
        if entry is None:
            return None
        tensor, events = entry
        self.taken += 1
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for event in events:
                stream.wait_event(event)
        return tensor

    def close(self) -> None:
        """Stop the threads, drop what was not taken, close the files."""
        self._stop.set()
        for thread in self._threads:
            while thread.is_alive():
                self._drain()
                thread.join(timeout=0.05)
        self._ready.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the threads
    def _drain(self) -> None:
        try:
            while True:
                self._pieces.get_nowait()
        except queue.Empty:
            pass

    def _advise(self) -> None:
        """Ask the kernel to read the ranges ahead, in load order, at most `AHEAD_BYTES` beyond what the readers
        have copied (so a checkpoint larger than the page cache is not evicted before it is read); a hint: errors
        are ignored."""
        advised = 0
        for r in self._order:
            while advised - self._copied > AHEAD_BYTES and not self._stop.wait(0.01):
                pass
            if self._stop.is_set():
                return
            advised += r.nbytes
            try:  # a column slice: the rows' whole span, one large request instead of a small one a row
                os.posix_fadvise(self._fds[r.file], r.offset, r.span, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                return

    def _on_device(self) -> None:
        """Make this thread's current CUDA device the stream's (the current device is per thread)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _feed(self, readers: int) -> None:
        """Allocate each tensor on the device and queue its pieces; a tensor whose pieces all arrive is ready.
        Whatever is not queued (stopped, out of memory) is marked absent, so `take` never waits for it."""
        try:
            self._on_device()
        except Exception:
            self._stop.set()
        for r in self._order:
            target = None
            if not self._stop.is_set():
                try:
                    target = torch.empty(r.nbytes, dtype=torch.uint8, device=self.device)
                except Exception:  # out of memory or no device: the loader reads it the ordinary way
                    target = None
            if target is None:
                self._finish((r.name, r.part), None)
                continue
            size = PIECE_BYTES if r.runs == 1 else PIECE_BYTES // r.run_bytes * r.run_bytes  # whole runs
            pieces = max(1, -(-r.nbytes // size))
            state = _Tensor(r, target, pieces)
            for i in range(pieces):
                start = i * size
                stop = min(r.nbytes, start + size)
                if not self._put((state, start, stop)):
                    self._piece_done(state, None, stop - start, failed=True)
        for _ in range(readers):
            self._put(_DONE)

    def _put(self, item: object) -> bool:
        """Queue `item`; False when the stream was stopped first."""
        while not self._stop.is_set():
            try:
                self._pieces.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        cuda = self.device.type == "cuda"
        try:
            self._on_device()
            buffers = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            events = [None, None]
            copy_stream = torch.cuda.Stream(self.device) if cuda else None
        except Exception:
            buffers = None
        turn = 0
        while True:
            try:
                item = self._pieces.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is _DONE:
                return
            state, start, stop = item
            if buffers is None:
                self._piece_done(state, None, stop - start, failed=True)
                continue
            buffer = buffers[turn]
            try:
                if events[turn] is not None:
                    events[turn].synchronize()  # the buffer's previous copy has finished
                _read_piece(self._fds[state.range.file], buffer[: stop - start], state.range, start)
                if cuda:
                    with torch.cuda.stream(copy_stream):
                        state.target[start:stop].copy_(buffer[: stop - start], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(copy_stream)
                    events[turn] = event
                else:
                    state.target[start:stop].copy_(buffer[: stop - start])
                    event = None
            except Exception:  # a short file or an I/O error: the loader reads it the ordinary way
                self._piece_done(state, None, stop - start, failed=True)
                continue
            self._piece_done(state, event, stop - start)
            turn = 1 - turn

    def _piece_done(self, state: _Tensor, event, size: int, failed: bool = False) -> None:
        with self._cond:
            state.left -= 1
            state.failed |= failed
            self._copied += size
            if event is not None:
                state.events.append(event)
            if state.left == 0:
                r = state.range
                value = None if state.failed else (state.target.view(r.dtype).view(r.shape), state.events)
                self._ready[(r.name, r.part)] = value
                self._cond.notify_all()

    def _finish(self, key: tuple[str, TensorSlice | None], value: tuple[Tensor, list] | None) -> None:
        with self._cond:
            self._ready[key] = value
            self._cond.notify_all()


class _Tensor:
    """One tensor being streamed: its range, its device bytes, pieces still out, their copy events."""

    def __init__(self, byte_range: ByteRange, target: Tensor, pieces: int) -> None:
        self.range = byte_range
        self.target = target  # (nbytes,) uint8 on the device
        self.left = pieces
        self.failed = False
        self.events: list = []


def _read_piece(fd: int, buffer: Tensor, r: ByteRange, start: int) -> None:
    """Fill `buffer` (uint8, CPU) with bytes [start, start + len) of range `r`'s slice: one read for a single
    run, a read a run otherwise (`start` and the length are whole runs); OSError when the file is shorter."""
    view = memoryview(buffer.numpy()).cast("B")
    if r.runs == 1:
        _pread_into(fd, view, r.offset + start)
        return
    run, first = r.run_bytes, start // r.run_bytes
    for i in range(len(view) // run):
        _pread_into(fd, view[i * run : (i + 1) * run], r.offset + (first + i) * r.stride)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset`; OSError when the file is shorter."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += n


def start_weight_stream(
    path: str | Path,
    *,
    device: torch.device,
    tp_rank: int,
    tp_size: int,
    dtype: torch.dtype,
    head_dtype: torch.dtype,
) -> WeightStream | None:
    """Start streaming the weights of checkpoint directory `path` that this TP rank will load; None when the
    checkpoint cannot be planned (a missing or damaged file, an unknown config: the loader reports it later)."""
    try:
        path = Path(path)
        config = read_model_config(path)
        layout = tp_layout(config, tp_size, tp_rank)
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.is_file():
            files = {n: path / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = dict.fromkeys(safetensors_header(single)[0], single)
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        entry = safetensors_header(files[head_name])[0][head_name]
        stored_head = _DTYPES.get(entry["dtype"], torch.float32)
        wanted = planned_reads(config, layout, body=dtype, head=head_dtype, stored_head=stored_head)
        ranges = plan_ranges(files, wanted)
    except Exception:  # the loader raises the documented error (E603, E604, E610, ...) for the same cause
        return None
    readers = max(1, min(6, (os.cpu_count() or 2) // 2))
    return WeightStream(ranges, device, readers) if ranges else None
