"""The residual add of a row-parallel output, out = x + (sum over the TP ranks of part): by NCCL, or for two
GPUs by the copy engines.

What: `start(part)` begins summing this rank's partial output part (n, H) of o_proj or down_proj over the TP
group; `finish(pending, x)` returns x + sum (+ bias), on the current stream. Two implementations:
- `NcclSums`: an asynchronous NCCL all-reduce, then the add (what `tp_dense.dense_overlapped` always did);
- `PeerCopySums` (TP = 2, CUDA): each rank copies its partial into the other rank's receive buffer (PyTorch
  symmetric memory) with one device-to-device copy, which the copy engines run over NVLink, then raises a flag in
  the other rank's signal pad with a stream memory operation (`cuStreamWriteValue32`); the receiver's stream waits
  for the flag (`cuStreamWaitValue32`) and one kernel adds the two partials into the residual
  (`pgdiag.model.residual_add_triton`).

Why: NCCL's all-reduce kernels take SMs from the GEMMs they overlap, and cuBLAS's persistent GEMM kernels,
which size their grid to every SM, then wait for those SMs: at TP = 2 on the Qwen3-8B shape the overlapped
all-reduces still cost about 0.27 s of a 2.82 s pass (docs/benchmarks.md, issue 26). Copies and stream memory
operations use no SM at all.

How (`PeerCopySums`): exchange number s (counted alike on both ranks, one per `start`) goes to receive slot
s % slots and raises the flag to s (flags only grow; the wait is `>=`, so no flag is ever reset). A slot is
written again only `slots` exchanges later; in `dense_overlapped`'s order (a layer's o_proj partials, then each
chunk's down_proj partial after its o_proj sum is consumed) a rank that sends exchange s has consumed the other
rank's exchange s - 4, which that rank sent after consuming s - 8, so 8 slots suffice; 4 x chunks are kept.
The sum is part + other in the body dtype, rounded once, the same value on both ranks and the same as NCCL's
two-rank sum; so with the same GEMMs the output equals the NCCL form bit for bit.

The sharded residual (`pgdiag.model.tp_dense.dense_sharded`) uses two more operations: `start(part, pieces)` sums
only this rank's piece of the rows (the copy engines push the peer's piece alone, half the bytes), and
`start_gather(buffer, start, pieces)` / `finish_gather` hand this rank's piece of a normed chunk to the other ranks,
in place in their `gather_buffer` (symmetric memory for the copy engines; broadcasts for `NcclSums`). Every push,
sum or gather, is one exchange of the same sequence on one copy stream, so a flag >= s means exchanges 1..s all
arrived. The gather buffers are not slotted: buffer 0 (a layer's input norm) is written again only after the
rank that reads it has sent the down_proj partials computed after its q/k/v GEMMs read it, buffer 1 (the
post-attention norm, and the final norm) only after the o_proj partials computed after its gate/up GEMMs read it.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from pgdiag.model.transformer import CausalLM

WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-around safe (EQ is 0x1)
FLAG_WORD = 256  # uint32 index of rank 0's flag in a signal pad (rank 1's: the next); pads: >= 512


@dataclass
class PendingSum:
    """An exchange in flight: this rank's partial (n, H), the rows of it this rank keeps (None: all), its
    sequence number and receive slot (peer copy), or the collectives' handles."""

    part: Tensor | None
    work: dist.Work | None = None
    seq: int = 0
    slot: int = 0
    keep: tuple[int, int] | None = None
    works: tuple[dist.Work, ...] = ()

    def kept(self) -> Tensor:
        """This rank's rows of the partial: (n_kept, H)."""
        return self.part if self.keep is None else self.part[self.keep[0] : self.keep[1]]


def _keep(pieces: tuple[int, ...] | None, rank: int) -> tuple[int, int] | None:
    return None if pieces is None else (pieces[rank], pieces[rank + 1])


def residual_add_reference(x: Tensor, p: Tensor, q: Tensor, out: Tensor | None = None) -> Tensor:
    """x + (p + q), each add rounded to the dtype (the reference of `pgdiag.model.residual_add_triton`)."""
    return torch.add(x, p + q, out=out)


def residual_add(x: Tensor, p: Tensor, q: Tensor, out: Tensor | None = None) -> Tensor:
    """x + (p + q): one Triton kernel for contiguous CUDA tensors, else the reference."""
    if x.device.type != "cuda" or not all(t.is_contiguous() for t in (x, p, q)):
        return residual_add_reference(x, p, q, out)
    from pgdiag.model.residual_add_triton import residual_add_triton

    return residual_add_triton(x, p, q, out)


def _with_bias(summed: Tensor, bias: Tensor | None) -> Tensor:
    return summed if bias is None else summed + bias


class NcclSums:
    """The sums by NCCL all-reduce (any TP degree, any backend)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.size = len(self.ranks)

    def start(self, part: Tensor, pieces: tuple[int, ...] | None = None) -> PendingSum:
        """Start summing part (n, H) over the group, in place (every row; with `pieces`, the tp + 1 row
        boundaries of `tp.chunk_pieces`, `finish` gives this rank's piece only)."""
        work = dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return PendingSum(part, work, keep=_keep(pieces, self.rank))

    def finish(
        self, pending: PendingSum, x: Tensor, bias: Tensor | None = None, out: Tensor | None = None
    ) -> Tensor:
        """x (n_kept, H) + the summed partial's kept rows (+ bias), written into `out` when given."""
        pending.work.wait()
        return torch.add(x, _with_bias(pending.kept(), bias), out=out)

    def gather_buffer(self, which: int, rows: int, like: Tensor) -> Tensor:
        """A (rows, H) buffer for `start_gather` (`which` names the peer-copy form's buffers; here a new one)."""
        return like.new_empty(rows, like.shape[1])

    def start_gather(self, buffer: Tensor, start: int, pieces: tuple[int, ...]) -> PendingSum:
        """Start giving every rank each rank's piece ``start + pieces[r] : start + pieces[r + 1]`` of `buffer`
        (N, H), this rank's already written there (one broadcast a rank)."""
        works = tuple(
            dist.broadcast(buffer[start + a : start + b], src, group=self.group, async_op=True)
            for src, a, b in zip(self.ranks, pieces, pieces[1:], strict=False)
            if b > a
        )
        return PendingSum(None, works=works)

    def finish_gather(self, pending: PendingSum) -> None:
        """Later work on the current stream sees every piece of the gather."""
        for work in pending.works:
            work.wait()


class _StreamMemoryOps:
    """cuStreamWriteValue32 / cuStreamWaitValue32 of the CUDA driver (no SM: the GPU's front end runs them)."""

    def __init__(self) -> None:
        driver = ctypes.CDLL("libcuda.so.1")
        self._write = driver.cuStreamWriteValue32_v2
        self._wait = driver.cuStreamWaitValue32_v2
        for fn in (self._write, self._wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """After the stream's earlier work (a memory fence first, the driver's default): *address = value."""
        self._check(self._write(stream.cuda_stream, address, value, 0), "cuStreamWriteValue32")

    def wait_geq(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """The stream's later work waits until *address >= value."""
        self._check(self._wait(stream.cuda_stream, address, value, WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    @staticmethod
    def _check(code: int, name: str) -> None:
        if code != 0:
            raise RuntimeError(f"{name} failed with CUDA driver error {code}")


class PeerCopySums:
    """The sums of a two-rank TP group on CUDA by copy-engine pushes into symmetric memory (module docstring).

    `rows` bounds the rows of one partial, `gather_rows` those of a gather buffer (0: no gathers); built
    collectively (every rank of the group, same arguments)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rows: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        gather_rows: int = 0,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if dist.get_world_size(group) != 2:
            raise ValueError("PeerCopySums needs a TP group of exactly 2 ranks")
        self.rank, self.size = dist.get_rank(group), 2
        self.peer = 1 - self.rank
        self.rows, self.slots, self.gather_rows, self.device = rows, slots, gather_rows, device
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before rendezvous by older torch; deprecated (a warning) since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)
        self.recv = symm_mem.empty((slots, rows, hidden), dtype=dtype, device=device)  # (S, rows, H) mine
        self.handle = symm_mem.rendezvous(self.recv, group)
        self.peer_recv = self.handle.get_buffer(self.peer, (slots, rows, hidden), dtype)  # the peer's, mapped
        pads = self.handle.signal_pad_ptrs  # torch's barriers use a pad's first words; none run on this one
        self.peer_flag = pads[self.peer] + 4 * (FLAG_WORD + self.rank)  # where I raise my flag
        self.my_flag = pads[self.rank] + 4 * (FLAG_WORD + self.peer)  # where the peer raises its flag
        self.gathered = self.peer_gathered = None  # (2, gather_rows, H): mine, and the peer's mapped here
        if gather_rows:
            self.gathered = symm_mem.empty((2, gather_rows, hidden), dtype=dtype, device=device)
            gather_handle = symm_mem.rendezvous(self.gathered, group)
            self.peer_gathered = gather_handle.get_buffer(self.peer, (2, gather_rows, hidden), dtype)
        self.stream = torch.cuda.Stream(device)
        self.ops = _StreamMemoryOps()
        # a pad may be shared with earlier allocations (torch's pools): the flag starts at 0 before any push
        self.ops.write(torch.cuda.current_stream(device), self.my_flag, 0)
        torch.cuda.synchronize(device)
        dist.barrier(group)
        self.seq = 0  # exchanges pushed (sums and gathers): the flag's value after the last
        self.sums = 0  # sums pushed: the receive slot of the next

    def _push(self, source: Tensor, target: Tensor) -> int:
        """Copy `source`, computed on the current stream, into `target` (peer memory) on the copy stream, then
        raise the flag to this exchange's number; returns it."""
        self.seq += 1
        self.stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self.stream):
            if source.numel():
                target.copy_(source)  # device-to-device memcpy: a copy engine, over NVLink
            self.ops.write(self.stream, self.peer_flag, self.seq)
        return self.seq

    def start(self, part: Tensor, pieces: tuple[int, ...] | None = None) -> PendingSum:
        """Push part (n, H), computed on the current stream, into the peer's next slot (with `pieces`, the
        boundaries of `tp.chunk_pieces`: the peer's piece only); raise the flag."""
        keep, theirs = _keep(pieces, self.rank), _keep(pieces, self.peer)
        sent = part if theirs is None else part[theirs[0] : theirs[1]]  # (n_peer, H)
        if sent.shape[0] > self.rows:
            raise ValueError(
                f"a partial of {sent.shape[0]} rows exceeds the {self.rows} rows of a receive slot"
            )
        self.sums += 1
        slot = self.sums % self.slots  # the slots count sums only (gathers land in the gather buffers)
        seq = self._push(sent, self.peer_recv[slot, : sent.shape[0]])
        part.record_stream(self.stream)  # the allocator keeps it until the copy is done
        return PendingSum(part, seq=seq, slot=slot, keep=keep)

    def finish(
        self, pending: PendingSum, x: Tensor, bias: Tensor | None = None, out: Tensor | None = None
    ) -> Tensor:
        """x (n_kept, H) + (the kept rows of part + the peer's) (+ bias), once the peer's flag has reached this
        exchange; written into `out` when given."""
        stream = torch.cuda.current_stream(x.device)
        self.ops.wait_geq(stream, self.my_flag, pending.seq)
        mine = pending.kept()  # (n_kept, H)
        other = self.recv[pending.slot, : mine.shape[0]]  # (n_kept, H)
        if bias is not None:
            return torch.add(x, (mine + other) + bias, out=out)
        return residual_add(x, mine, other, out=out)

    def gather_buffer(self, which: int, rows: int, like: Tensor) -> Tensor:
        """Gather buffer `which` (0 or 1) of this rank, its first `rows` rows (rows, H): symmetric memory the peer
        writes its pieces into."""
        if self.gathered is None or rows > self.gather_rows:
            raise ValueError(f"{rows} rows exceed the {self.gather_rows} rows of a gather buffer")
        return self.gathered[which, :rows]

    def start_gather(self, buffer: Tensor, start: int, pieces: tuple[int, ...]) -> PendingSum:
        """Push this rank's piece ``start + pieces[rank] : start + pieces[rank + 1]`` of `buffer` (one of
        `gather_buffer`'s) to the same rows of the peer's buffer; raise the flag."""
        which = 0 if buffer.data_ptr() == self.gathered[0].data_ptr() else 1
        a, b = start + pieces[self.rank], start + pieces[self.rank + 1]
        return PendingSum(None, seq=self._push(buffer[a:b], self.peer_gathered[which, a:b]))

    def finish_gather(self, pending: PendingSum) -> None:
        """Later work on the current stream waits until the peer's piece has arrived."""
        self.ops.wait_geq(torch.cuda.current_stream(self.device), self.my_flag, pending.seq)


def overlap_sums(
    model: CausalLM, rows: int, device: torch.device, gather_rows: int = 0
) -> NcclSums | PeerCopySums:
    """The overlapped dense layers' sums for partials of up to `rows` rows (and, for the sharded residual, gathers
    of up to `gather_rows` rows): NCCL, or the copy-engine pushes of `PeerCopySums` (`model.tp_reduce ==
    "peer_copy"`, TP = 2, CUDA), its buffers grown collectively (every rank of the group runs the same batches)
    when a batch needs more rows. Where symmetric memory or the driver's stream memory operations are refused
    (one warning), NCCL from then on."""
    peer = model.tp_reduce == "peer_copy" and model.layout.tp_size == 2 and device.type == "cuda"
    if not peer or model._peer_sums_failed:
        return NcclSums(model.tp_group)
    current = model._peer_sums
    if current is None or rows > current.rows or gather_rows > current.gather_rows:
        if model._peer_sums is not None:  # its last pushes and adds must be done before its buffers go
            torch.cuda.synchronize(device)
            dist.barrier(model.tp_group)
            model._peer_sums = None
        capacity = 1 << max(rows - 1, 1).bit_length()  # a power of two: few regrowths
        gathers = 1 << max(gather_rows - 1, 1).bit_length() if gather_rows else 0
        try:
            model._peer_sums = PeerCopySums(
                model.tp_group, capacity, model.config.hidden_size, model.body_dtype, device,
                slots=4 * max(model.tp_overlap_chunks, 2), gather_rows=gathers,
            )  # fmt: skip
        except (RuntimeError, OSError, AttributeError) as error:
            warnings.warn(
                f"TP sums by copy engine unavailable ({error}); using NCCL all-reduces", stacklevel=2
            )
            model._peer_sums_failed = True
            return NcclSums(model.tp_group)
    return model._peer_sums
