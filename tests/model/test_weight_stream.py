"""The weight stream (`pgdiag.model.weight_stream`): the loader given a stream builds the same model bit for bit as
without one, at TP = 1 and on every rank of TP = 2 and 3 (row slices one read, column slices a read a row),
for a single file and a sharded index, fp32 and bf16; a damaged file gives the loader's own error; byte ranges are
hand-checked. The threads and pieces run on the CPU here (plain buffers, plain copies); the CUDA path (pinned
buffers, copy streams, events) is the same code with the copies asynchronous."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from hf_tiny import save_hf_model
from safetensors.torch import save_file

from pgdiag.errors import UsageError
from pgdiag.model import checkpoint, load_model
from pgdiag.model import weight_stream as ws
from pgdiag.model.tp import TensorSlice

CPU = torch.device("cpu")


def stream_for(path: Path, tp_size: int = 1, rank: int = 0, dtype=torch.float32, head=torch.float32):
    return ws.start_weight_stream(
        path, device=CPU, tp_rank=rank, tp_size=tp_size, dtype=dtype, head_dtype=head
    )


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        assert value.dtype == pb[name].dtype and value.shape == pb[name].shape, name
        assert torch.equal(value, pb[name]), name


@pytest.mark.parametrize("shard_kb", [None, 12])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_load_equals_plain_load(
    tmp_path: Path, monkeypatch, shard_kb: int | None, dtype: str
) -> None:
    monkeypatch.setattr(ws, "PIECE_BYTES", 256)  # many pieces a tensor, several readers at once
    save_hf_model(tmp_path, "Qwen3ForCausalLM", shard_kb=shard_kb)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard_kb is not None)
    body = torch.float32 if dtype == "fp32" else torch.bfloat16
    plain = load_model(tmp_path, dtype=dtype, head_dtype="fp32")
    with stream_for(tmp_path, dtype=body) as stream:
        planned = len(stream._ranges)
        streamed = load_model(tmp_path, dtype=dtype, head_dtype="fp32", stream=stream)
        assert stream.taken == planned > 0 and not stream._ranges  # every planned tensor came from the stream
    same_parameters(plain, streamed)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_streamed_tp_shards_equal_plain_shards(tmp_path: Path, monkeypatch, tp_size: int) -> None:
    """Under TP each rank streams its whole tensors, row slices (q/k/v, gate/up, the head's vocab rows, uneven
    at 97 rows) and column slices (o_proj, down_proj: a run of bytes a row), in pieces of whole runs. The loader
    reads only (rank, size) from the group, so one process loads every rank's shard in turn."""
    monkeypatch.setattr(ws, "PIECE_BYTES", 4096)  # o_proj a row a piece; down_proj 21 or 32 rows a piece
    save_hf_model(
        tmp_path,
        "Qwen3ForCausalLM",
        shard_kb=12,
        num_attention_heads=12,
        num_key_value_heads=6,
        intermediate_size=96,
    )
    group = object()
    for rank in range(tp_size):
        monkeypatch.setattr(
            checkpoint, "group_rank_size", lambda g, r=rank: (r, tp_size) if g is group else (0, 1)
        )
        plain = load_model(tmp_path, dtype="fp32", tp_group=group)
        with stream_for(tmp_path, tp_size, rank) as stream:
            parts = {part for (_, part) in stream._ranges}
            assert TensorSlice(0, plain.layout.vocab_start, plain.layout.vocab_end) in parts  # the head rows
            columns = {name for (name, part) in stream._ranges if part is not None and part.dim == 1}
            assert columns == {
                n for n in dict(plain.named_parameters()) if n.endswith(("o_proj.weight", "down_proj.weight"))
            }
            planned = len(stream._ranges)
            streamed = load_model(tmp_path, dtype="fp32", tp_group=group, stream=stream)
            assert stream.taken == planned and not stream._ranges  # every read came from the stream
        same_parameters(plain, streamed)


def test_damaged_file_gives_the_loaders_error(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "LlamaForCausalLM")
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-200])  # the last tensor is cut short
    with pytest.raises(UsageError) as plain:
        load_model(tmp_path, dtype="fp32")
    stream = stream_for(tmp_path)  # plans from the header, which is intact; its reads then fail
    try:
        with pytest.raises(UsageError) as streamed:
            load_model(tmp_path, dtype="fp32", stream=stream)
    finally:
        if stream is not None:
            stream.close()
    assert streamed.value.code == plain.value.code == "E610"


def test_no_stream_for_a_missing_checkpoint(tmp_path: Path) -> None:
    assert stream_for(tmp_path) is None  # no config: the loader reports E604 / E60x itself


def test_byte_ranges_by_hand(tmp_path: Path) -> None:
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # 96 bytes, rows of 16
    b = torch.arange(5, dtype=torch.bfloat16)  # 10 bytes
    file = tmp_path / "w.safetensors"
    save_file({"a": a, "b": b}, file)
    header, data_start = ws.safetensors_header(file)
    (size,) = struct.unpack("<Q", file.read_bytes()[:8])
    assert data_start == 8 + size
    begin_a = header["a"]["data_offsets"][0]
    files = {"a": file, "b": file}
    planned = ws.plan_ranges(
        files,
        [
            ("a", TensorSlice(0, 2, 5)),
            ("b", None),
            ("a", TensorSlice(1, 1, 3)),
            ("b", TensorSlice(1, 0, 2)),
            ("c", None),
        ],
    )
    assert len(planned) == 3  # a column slice of a vector and an unknown name are not planned
    rows, whole, columns = planned
    assert rows.offset == data_start + begin_a + 2 * 16 and rows.nbytes == 3 * 16 and rows.shape == (3, 4)
    assert rows.runs == 1 and rows.span == rows.nbytes
    assert whole.nbytes == 10 and whole.dtype == torch.bfloat16 and whole.shape == (5,)
    # columns 1-2 of a's six rows: runs of 8 bytes from byte 4 of each 16-byte row, spanning 5 * 16 + 8 bytes
    assert (columns.offset, columns.runs, columns.run_bytes, columns.stride) == (
        data_start + begin_a + 4,
        6,
        8,
        16,
    )
    assert columns.nbytes == 48 and columns.span == 88 and columns.shape == (6, 2)
    with ws.WeightStream([rows, whole, columns], CPU, readers=2) as stream:
        assert torch.equal(stream.take("a", TensorSlice(0, 2, 5)), a[2:5])
        assert torch.equal(stream.take("b", None), b)
        assert torch.equal(stream.take("a", TensorSlice(1, 1, 3)), a[:, 1:3])
        assert stream.take("a", TensorSlice(1, 0, 2)) is None  # not planned: the loader reads it


@pytest.mark.parametrize("piece", [8, 24, 40, 4096])
def test_column_slice_pieces_of_whole_runs(tmp_path: Path, monkeypatch, piece: int) -> None:
    """A column slice in pieces of one run, of several runs with a short last piece, and of every run at once;
    runs longer than a piece, headers whose size disagrees with the shape and empty matrices are left to the loader."""
    monkeypatch.setattr(ws, "PIECE_BYTES", piece)
    a = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
    bad = torch.zeros(3, 3)
    file = tmp_path / "w.safetensors"
    save_file({"a": a, "bad": bad, "empty": torch.zeros(0, 4)}, file)
    raw = bytearray(file.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + size].replace(b'"shape":[3,3]', b'"shape":[3,2]')  # same length, 36 bytes for 24
    file.write_bytes(raw[:8] + header + raw[8 + size :])
    parts = [("a", TensorSlice(1, 3, 5)), ("a", TensorSlice(1, 0, 10))]
    parts += [("bad", TensorSlice(1, 0, 1)), ("empty", TensorSlice(1, 0, 2))]
    planned = ws.plan_ranges(dict.fromkeys(("a", "bad", "empty"), file), parts)
    assert [(r.name, r.part) for r in planned] == [
        p for p in parts[:2] if 4 * (p[1].stop - p[1].start) <= piece
    ]
    with ws.WeightStream(planned, CPU, readers=3) as stream:
        for name, part in parts[:2]:
            value = stream.take(name, part)
            assert (
                value is None
                if 4 * (part.stop - part.start) > piece
                else torch.equal(value, a[:, part.start : part.stop])
            )


def test_close_without_taking_stops_the_threads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ws, "PIECE_BYTES", 64)
    save_hf_model(tmp_path, "LlamaForCausalLM")
    stream = stream_for(tmp_path)
    stream.close()
    assert not any(thread.is_alive() for thread in stream._threads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_load_on_cuda_equals_plain_load(tmp_path: Path, monkeypatch, dtype: str) -> None:
    """The CUDA path: pinned buffers, copies on the readers' streams, the loader's stream waiting on their events."""
    monkeypatch.setattr(ws, "PIECE_BYTES", 4096)
    save_hf_model(tmp_path, "Qwen3ForCausalLM", shard_kb=12)
    cuda = torch.device("cuda", torch.cuda.current_device())
    body = torch.float32 if dtype == "fp32" else torch.bfloat16
    plain = load_model(tmp_path, dtype=dtype, head_dtype="fp32", device=cuda)
    stream = ws.start_weight_stream(
        tmp_path, device=cuda, tp_rank=0, tp_size=1, dtype=body, head_dtype=torch.float32
    )
    with stream:
        streamed = load_model(tmp_path, dtype=dtype, head_dtype="fp32", device=cuda, stream=stream)
        assert stream.taken > 0 and not stream._ranges
    assert all(p.device == cuda for p in streamed.parameters())
    same_parameters(plain, streamed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_tp_rank_on_cuda_equals_plain_load(tmp_path: Path, monkeypatch) -> None:
    """Rank 1 of TP = 2 on CUDA: row and column slices through pinned buffers and the copy streams."""
    monkeypatch.setattr(ws, "PIECE_BYTES", 4096)
    save_hf_model(tmp_path, "Qwen3ForCausalLM", shard_kb=12, num_attention_heads=12, num_key_value_heads=6)
    group = object()
    monkeypatch.setattr(checkpoint, "group_rank_size", lambda g: (1, 2) if g is group else (0, 1))
    cuda = torch.device("cuda", torch.cuda.current_device())
    plain = load_model(tmp_path, dtype="bf16", device=cuda, tp_group=group)
    stream = ws.start_weight_stream(
        tmp_path, device=cuda, tp_rank=1, tp_size=2, dtype=torch.bfloat16, head_dtype=torch.float32
    )
    with stream:
        assert any(part is not None and part.dim == 1 for (_, part) in stream._ranges)
        streamed = load_model(tmp_path, dtype="bf16", device=cuda, tp_group=group, stream=stream)
        assert stream.taken > 0 and not stream._ranges
    same_parameters(plain, streamed)


def test_read_ahead_stays_within_its_window(tmp_path: Path, monkeypatch) -> None:
    """The kernel is asked for the next range only once what it was asked for is at most AHEAD_BYTES beyond what
    the readers have copied, so a checkpoint larger than the page cache is not evicted before it is read; the
    weights still arrive whole."""
    monkeypatch.setattr(ws, "PIECE_BYTES", 512)
    monkeypatch.setattr(ws, "AHEAD_BYTES", 2048)
    save_hf_model(tmp_path, "Qwen3ForCausalLM", shard_kb=12)
    calls: list[tuple[int, int]] = []  # (bytes advised before this call, bytes copied at this call)
    holder: dict = {}

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((sum(n for _, n in holder.setdefault("advised", [])), holder["stream"]._copied))
        holder["advised"].append((offset, length))

    monkeypatch.setattr(ws.os, "posix_fadvise", record)
    original_init = ws.WeightStream.__init__

    def init(self, *args, **kwargs) -> None:
        holder["stream"] = self
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(ws.WeightStream, "__init__", init)
    plain = load_model(tmp_path, dtype="fp32")
    with stream_for(tmp_path) as stream:
        streamed = load_model(tmp_path, dtype="fp32", stream=stream)
        advising = stream._threads[0]
        advising.join(timeout=30)  # every piece is copied, so the window lets it reach the last range
        assert not advising.is_alive()
        planned = stream.taken
    same_parameters(plain, streamed)
    assert len(calls) == planned > 10
    assert all(advised - copied <= 2048 for advised, copied in calls)
    assert max(advised for advised, _ in calls) > 2048  # the window did move
