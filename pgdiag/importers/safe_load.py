"""Loading ``.pt`` files and pickles without running code from them.

A pickle names globals (classes, functions) that the loader calls to rebuild objects, so loading an untrusted
pickle can run anything (``os.system`` in a ``__reduce__``). pgdiag loads framework dumps through an
**allow-list**: a mapping from the global's dotted name to the object pgdiag returns for it. Entries are
numpy's array-rebuilding functions and pgdiag *shims* (`record_shim`: a plain record that keeps whatever
state the pickle sets), never framework code, so the framework need not be installed. Any other global
raises E701 naming it, before anything it names is called.

* `load_pt`: ``torch.load(weights_only=True, map_location="cpu", mmap=True)`` inside
  ``torch.serialization.safe_globals(allow-list)``; tensors, dicts, lists and plain scalars need no entry.
* `load_pickle`: a `pickle.Unpickler` whose ``find_class`` returns only allow-list entries.
* ``allow_unsafe=True`` (``--allow-unsafe-pickle``) loads with plain pickle / ``weights_only=False``: code in
  the file runs, the framework must be importable, and the result says ``unsafe_load=True`` so the writer
  warns and records ``pgdiag.source.unsafe_load``.

A truncated or unreadable file is E703 (torn dump). A preset builds its allow-list as
``{**numpy_allow_list(), "miles.utils.types.AdapterRef": record_shim("miles.utils.types.AdapterRef")}``.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgdiag.importers.base import bad_layout, unsafe_global

_NUMPY_DTYPE_CLASSES = (
    "BoolDType",
    "Int8DType",
    "Int16DType",
    "Int32DType",
    "Int64DType",
    "UInt8DType",
    "UInt16DType",
    "UInt32DType",
    "UInt64DType",
    "Float16DType",
    "Float32DType",
    "Float64DType",
    "StrDType",
    "ObjectDType",
)
_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


@dataclass(frozen=True)
class Loaded:
    """What a safe load returned, and whether it went through the unsafe escape."""

    value: Any
    unsafe_load: bool


def numpy_allow_list() -> dict[str, Any]:
    """The numpy globals a pickled array needs: ``_reconstruct``, ``scalar``, ``ndarray``, ``dtype`` and the
    ``numpy.dtypes`` classes of bool, int, float, str and object, under both ``numpy._core`` and ``numpy.core``.
    """
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    entries: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for core in ("numpy._core", "numpy.core"):
        entries[f"{core}.multiarray._reconstruct"] = multiarray._reconstruct
        entries[f"{core}.multiarray.scalar"] = multiarray.scalar
    dtypes = getattr(np, "dtypes", None)
    for name in _NUMPY_DTYPE_CLASSES:
        cls = getattr(dtypes, name, None) if dtypes is not None else None
        if cls is not None:
            entries[f"numpy.dtypes.{name}"] = cls
    return entries


def record_shim(qualified_name: str) -> type:
    """A stand-in class for the framework class `qualified_name` (``"miles.utils.types.AdapterRef"``).

    Instances accept any constructor arguments (kept as ``args`` / ``kwargs``) and any pickled state: a dict
    updates the instance's attributes, a ``(dict, slots)`` pair both, anything else is kept as ``state``.
    So `getattr(record, "field")` reads what the framework pickled; no framework code runs.
    """
    module, _, name = qualified_name.rpartition(".")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self: Any, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1] or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self: Any) -> str:
        return f"<record {qualified_name} {sorted(self.__dict__)}>"

    return type(
        name,
        (),
        {"__init__": __init__, "__setstate__": __setstate__, "__repr__": __repr__, "__module__": module},
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, allow: Mapping[str, Any], source: str) -> None:
        super().__init__(file)
        self._allow = allow
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        dotted = f"{module}.{name}"
        entry = self._allow.get(dotted)
        if entry is None:
            raise unsafe_global(self._source, dotted)
        return entry


def load_pickle(
    source: Path | bytes, allow: Mapping[str, Any], *, allow_unsafe: bool = False, name: str | None = None
) -> Loaded:
    """Unpickle `source` (a file or bytes) with only the globals of `allow`; E701 names any other global.

    `name` labels bytes in messages (e.g. ``"gen_batch.dp: batch"``). A truncated pickle is E703.
    """
    label = name or str(source if isinstance(source, Path) else "<bytes>")
    data = source.read_bytes() if isinstance(source, Path) else source
    try:
        if allow_unsafe:
            return Loaded(pickle.loads(data), True)  # the user chose the unsafe escape
        # buffered: the C unpickler calls a bare BytesIO's read() once per opcode, but prefetches through peek()
        stream = io.BufferedReader(io.BytesIO(data), buffer_size=1 << 20)
        return Loaded(_RestrictedUnpickler(stream, allow, label).load(), False)
    except (EOFError, pickle.UnpicklingError, ValueError, IndexError, TypeError, AttributeError) as exc:
        raise bad_layout(
            label, "pickle", f"a complete pickle ({type(exc).__name__}: {exc}); torn file?"
        ) from exc


def _named_global(path: Path, exc: Exception, allow: Mapping[str, Any]) -> str | None:
    """The first global of `path` outside `allow`, read from the archive without loading it."""
    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # an unreadable archive: fall back to torch's message
        names = []
    outside = [n for n in names if n not in allow]
    if outside:
        return outside[0]
    match = _GLOBAL_IN_MESSAGE.search(str(exc))
    return match.group(1) if match else None


def load_pt(path: Path, allow: Mapping[str, Any] | None = None, *, allow_unsafe: bool = False) -> Loaded:
    """``torch.load`` of `path` on the CPU, memory-mapped, with only tensors, plain containers and `allow`.

    E701 names a global outside `allow`; a truncated or non-zip file is E703.
    """
    import torch

    allow = allow or {}
    if not zipfile.is_zipfile(path):
        raise bad_layout(path, "file", "a torch.save zip archive (truncated or legacy file?)")
    if allow_unsafe:
        return Loaded(torch.load(path, map_location="cpu", weights_only=False), True)
    entries = [(obj, dotted) for dotted, obj in allow.items()]
    try:
        with torch.serialization.safe_globals(entries):
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        name = _named_global(path, exc, allow)
        if name is not None:
            raise unsafe_global(path, name) from exc
        raise bad_layout(path, "pickle", f"a readable torch.save archive ({exc})") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise bad_layout(
            path, "file", f"a complete torch.save archive ({type(exc).__name__}: {exc})"
        ) from exc
    return Loaded(value, False)
