"""Fast allow-listed reading of ``torch.save`` archives holding large plain lists (slime and miles dumps).

`pgdiag.importers.safe_load.load_pt` reads through ``torch.load(weights_only=True)``, whose unpickler runs in
Python, one opcode at a time: a slime rollout dump keeps every token id and log-prob as a Python number, so one
million response tokens take about 10 s there. `load_pt_lists` reads the same archive with the C
``pickle.Unpickler`` and the same guarantee: ``find_class`` returns only allow-list entries (any other global is
E701 naming it, before anything it names is called) plus what a tensor needs (``torch._utils._rebuild_tensor_v2``
as a pgdiag function, the ``torch.<Type>Storage`` names as dtype markers, ``collections.OrderedDict``, ``_codecs.encode`` for protocol-2 bytes), and
``persistent_load`` only reads storage bytes from the archive. No code from the file runs. Tensors come back as
CPU torch tensors (views of one buffer per storage, shared as saved).
"""

from __future__ import annotations

import codecs
import collections
import gc
import io
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pgdiag.importers.base import bad_layout, unsafe_global
from pgdiag.importers.safe_load import Loaded, load_pt

_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


_READ_BLOCK = 1 << 20


class _StorageType:
    """Stands for ``torch.<Type>Storage`` in a pickle: only its dtype is used."""

    def __init__(self, dtype_name: str) -> None:
        self.dtype_name = dtype_name


def _rebuild_tensor(storage: Any, storage_offset: int, size: tuple, stride: tuple, *_: Any) -> Any:
    """``torch._utils._rebuild_tensor_v2`` for plain CPU tensors: a strided view of the storage."""
    return storage.as_strided(tuple(size), tuple(stride), int(storage_offset))


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, data: bytes, archive: zipfile.ZipFile, prefix: str, allow: Mapping[str, Any], path: Path
    ):
        # A BytesIO has no ``peek``, so the C unpickler would call its ``read`` once per opcode (millions of
        # Python calls, 4x the parse itself); a BufferedReader lets it prefetch the stream in 1 MiB blocks.
        super().__init__(io.BufferedReader(io.BytesIO(data), buffer_size=_READ_BLOCK))
        self._archive = archive
        self._prefix = prefix
        self._allow = allow
        self._path = path
        self._storages: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        dotted = f"{module}.{name}"
        if dotted in self._allow:
            return self._allow[dotted]
        if dotted == "torch._utils._rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if dotted == "collections.OrderedDict":
            return collections.OrderedDict
        if dotted == "_codecs.encode":  # protocol-2 pickles of bytes (numpy array data): str -> bytes
            return codecs.encode
        raise unsafe_global(self._path, dotted)

    def persistent_load(self, pid: Any) -> Any:
        import torch

        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
        ):
            raise bad_layout(
                self._path,
                "pickle",
                f"tensor storages ('storage', type, key, location, numel), got {pid!r:.80}",
            )
        _, storage_type, key, _location, numel = pid
        if key not in self._storages:
            try:
                raw = self._archive.read(f"{self._prefix}data/{key}")
            except KeyError as exc:
                raise bad_layout(self._path, f"data/{key}", "the storage the pickle names") from exc
            dtype = getattr(torch, storage_type.dtype_name)
            flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            if flat.numel() != int(numel):
                raise bad_layout(self._path, f"data/{key}", f"{numel} elements, got {flat.numel()}")
            self._storages[key] = flat
        return self._storages[key]


def _load_without_gc(unpickler: pickle.Unpickler) -> Any:
    """Unpickle with the cyclic collector paused: millions of new numbers trigger it for nothing (~10 %)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return unpickler.load()
    finally:
        if enabled:
            gc.enable()


def load_pt_lists(
    path: Path, allow: Mapping[str, Any] | None = None, *, allow_unsafe: bool = False
) -> Loaded:
    """``torch.load`` of `path` through the C unpickler, allow-listed (see the module docstring).

    E701 names a global outside `allow`; a truncated or non-zip file is E703. `allow_unsafe` defers to
    `load_pt` (plain ``torch.load``).
    """
    allow = allow or {}
    if allow_unsafe:
        return load_pt(path, allow, allow_unsafe=True)
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pickles) != 1:
                raise bad_layout(path, "data.pkl", "one pickle in the torch.save archive")
            prefix = pickles[0][: -len("data.pkl")]
            if f"{prefix}byteorder" in archive.namelist() and archive.read(f"{prefix}byteorder") != b"little":
                raise bad_layout(path, "byteorder", "little-endian storages")
            data = archive.read(pickles[0])
            value = _load_without_gc(_Unpickler(data, archive, prefix, allow, path))
    except (
        zipfile.BadZipFile,
        EOFError,
        pickle.UnpicklingError,
        ValueError,
        OSError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
    ) as exc:
        raise bad_layout(
            path, "file", f"a complete torch.save archive ({type(exc).__name__}: {exc})"
        ) from exc
    return Loaded(value, False)
