"""Where a checkpoint's tensors are read from: safetensors files (single or sharded index), or tensors in memory.

What: `open_tensor_source(path)` finds a checkpoint directory's weight files (E604 when there are none or a shard
is missing, E609 for a pickle checkpoint with the command that converts it, E610 for a damaged safetensors file)
and returns a `TensorSource`, which reads one tensor or one row/column slice at a time without reading the rest
(`safe_open(...).get_slice`), so each tensor-parallel rank reads only its shard.

Why apart: the loader (`pgdiag.model.checkpoint`) only calls `names`, `shape`, `is_fp32`, `dtype` and `read`, so a
subclass can feed weights from anywhere (benchmarks/bench_recompute_tp.py generates each rank's slice on the fly).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from pgdiag.errors import Code, UsageError

if TYPE_CHECKING:
    from pgdiag.model.tp import TensorSlice

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_TORCH_STORAGE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


class TensorSource:
    """Named tensors readable one slice at a time: safetensors files (lazy) or in-memory tensors.

    The loader only calls `names`, `shape`, `is_fp32`, `dtype` and `read`; a subclass overriding those can feed
    weights from anywhere (benchmarks/bench_recompute_tp.py generates each rank's slice on the fly).
    """

    def __init__(
        self, files: Mapping[str, Path] | None = None, tensors: Mapping[str, Tensor] | None = None
    ) -> None:
        self._files = dict(files or {})  # tensor name -> safetensors file
        self._tensors = dict(tensors or {})  # tensor name -> tensor (mmap'd .bin or already in memory)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return sorted({*self._files, *self._tensors})

    def file_of(self, name: str) -> Path | None:
        """The safetensors file holding tensor `name` (None for an in-memory tensor or an unknown name)."""
        return self._files.get(name)

    def _slice(self, name: str):  # safetensors PySafeSlice
        file = self._files[name]
        try:
            if file not in self._handles:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(file), framework="pt", device="cpu")
                )
            return self._handles[file].get_slice(name)
        except (SafetensorError, OSError) as error:
            raise UsageError(
                Code.DAMAGED_SAFETENSORS, f"{file}: not a readable safetensors file ({one_line_text(error)})"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._slice(name).get_shape())

    def is_fp32(self, name: str) -> bool:
        if name in self._tensors:
            return self._tensors[name].dtype == torch.float32
        return self._slice(name).get_dtype() == "F32"

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of `name` (safetensors names mapped to torch dtypes; float32 when unknown)."""
        if name in self._tensors:
            return self._tensors[name].dtype
        return _SAFETENSORS_DTYPES.get(self._slice(name).get_dtype(), torch.float32)

    def stored_dtype(self, name: str) -> str:
        """The dtype as stored, in safetensors' spelling (``BF16``, ``F32``, ``I8``, ``U8``, ...)."""
        if name in self._tensors:
            return _TORCH_STORAGE_NAMES.get(self._tensors[name].dtype, str(self._tensors[name].dtype))
        return str(self._slice(name).get_dtype())

    def read(self, name: str, part: TensorSlice | None) -> Tensor:
        """The whole tensor, or rows/columns `part.start:part.stop` along `part.dim`, without reading the rest."""
        if name in self._tensors:
            t = self._tensors[name]
            if part is None or part.stop - part.start == t.shape[part.dim]:
                return t  # shared, not copied: the caller's tensor becomes the parameter
            # a copy, so that the full tensor can be freed once every rank has its slice
            return t.narrow(part.dim, part.start, part.stop - part.start).clone()
        sl = self._slice(name)
        if part is None:
            return sl[:]
        return sl[part.start : part.stop] if part.dim == 0 else sl[:, part.start : part.stop]


def open_tensor_source(path: Path) -> TensorSource:
    """Find the weight files of a checkpoint directory; E604 when none or a shard is missing."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise UsageError(
                    Code.CHECKPOINT_FILE_MISSING,
                    f"{index}: shard {shard.name} listed in weight_map is missing",
                )
        return TensorSource(files=files)
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt", device="cpu") as f:
                return TensorSource(files=dict.fromkeys(f.keys(), single))
        except (SafetensorError, OSError) as error:
            raise UsageError(
                Code.DAMAGED_SAFETENSORS,
                f"{single}: not a readable safetensors file ({one_line_text(error)})",
            ) from None
    pickles = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth") and p.is_file())
    if pickles:
        raise UsageError(
            Code.PICKLE_CHECKPOINT,
            f"{path}: {pickles[0]} is a pickle checkpoint; pgdiag loads weights only from safetensors",
            'convert it once, where you trust the file: python -c "import torch; from safetensors.torch '
            f"import save_file; save_file(torch.load('{pickles[0]}', weights_only=True), 'model.safetensors')\"",
        )
    raise UsageError(
        Code.CHECKPOINT_FILE_MISSING, f"{path}: no model.safetensors or model.safetensors.index.json"
    )


def head_storage_dtype(head: torch.dtype, stored_fp32: bool, stored: torch.dtype) -> torch.dtype:
    """The dtype the LM head is kept in: `head`, except that an fp32 head of a 16-bit checkpoint keeps its
    16-bit values (exact; the kernel's fp32 head upcasts them, `kernels.lm_head_logprobs_triton.head_mode_for`),
    which halves its memory and lets the kernel multiply 16-bit W tiles instead of tf32x3 on an fp32 copy."""
    if head == torch.float32 and not stored_fp32 and stored in (torch.bfloat16, torch.float16):
        return stored
    return head


def one_line_text(error: BaseException) -> str:
    """An exception's text on one line."""
    return " ".join(str(error).split())


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(
            Code.CHECKPOINT_FILE_MISSING, f"{index}: not a valid index (needs a 'weight_map' object)"
        ) from None
    if not isinstance(weight_map, dict):
        raise UsageError(
            Code.CHECKPOINT_FILE_MISSING, f"{index}: 'weight_map' must map tensor names to shard files"
        )
    return weight_map
