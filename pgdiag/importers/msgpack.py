"""A MessagePack decoder for data files (prime-rl's rollout transport), with no dependency.

MessagePack is data: decoding runs no code. Every format except the extension types is read (extension types
are an unknown layout: E703). Arrays whose elements all share one fixed-width encoding are decoded with numpy
in one step (float64, float32, bool, positive fixint), so per-token lists of floats and masks cost no Python
loop; other arrays are Python lists. A truncated buffer is E703 naming the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from pgdiag.importers.base import bad_layout

# fixed-width element encodings an array may be decoded in one numpy step: first byte -> (width, numpy dtype)
_UNIFORM = {0xCB: (9, ">f8"), 0xCA: (5, ">f4")}


class _Truncated(Exception):
    pass


class _Decoder:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.array = np.frombuffer(data, dtype=np.uint8)

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise _Truncated
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        end = self.pos + size
        if end > len(self.data):
            raise _Truncated
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos = end
        return value

    def uniform_array(self, n: int) -> np.ndarray | None:
        """The next `n` elements as one numpy array when they share a fixed-width encoding, else None."""
        if n == 0 or self.pos >= len(self.data):
            return None
        first = self.data[self.pos]
        if first in _UNIFORM:
            width, dtype = _UNIFORM[first]
            end = self.pos + n * width
            if end > len(self.data):
                return None
            block = self.array[self.pos : end].reshape(n, width)
            if not (block[:, 0] == first).all():
                return None
            self.pos = end
            return np.ascontiguousarray(block[:, 1:]).view(dtype).reshape(n).astype(np.float64)
        if first in (0xC2, 0xC3):
            end = self.pos + n
            block = self.array[self.pos : end]
            if block.shape[0] < n or not ((block == 0xC2) | (block == 0xC3)).all():
                return None
            self.pos = end
            return block == 0xC3
        if first < 0x80:
            end = self.pos + n
            block = self.array[self.pos : end]
            if block.shape[0] < n or not (block < 0x80).all():
                return None
            self.pos = end
            return block.astype(np.int64)
        return None

    def value(self) -> Any:
        if self.pos >= len(self.data):
            raise _Truncated
        b = self.data[self.pos]
        self.pos += 1
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")
        if 0x90 <= b <= 0x9F:
            return self.sequence(b & 0x0F)
        if 0x80 <= b <= 0x8F:
            return self.mapping(b & 0x0F)
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        fixed = {
            0xCA: ">f",
            0xCB: ">d",
            0xCC: ">B",
            0xCD: ">H",
            0xCE: ">I",
            0xCF: ">Q",
            0xD0: ">b",
            0xD1: ">h",
            0xD2: ">i",
            0xD3: ">q",
        }
        if b in fixed:
            return self.unpack(fixed[b])
        lengths = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
        if b in lengths:
            raw = self.take(self.unpack(lengths[b]))
            return raw if b in (0xC4, 0xC5, 0xC6) else raw.decode("utf-8")
        if b in (0xDC, 0xDD):
            return self.sequence(self.unpack(">H" if b == 0xDC else ">I"))
        if b in (0xDE, 0xDF):
            return self.mapping(self.unpack(">H" if b == 0xDE else ">I"))
        raise ValueError(f"MessagePack type byte 0x{b:02x} (extension types are not data pgdiag reads)")

    def sequence(self, n: int) -> Any:
        uniform = self.uniform_array(n)
        if uniform is not None:
            return uniform
        return [self.value() for _ in range(n)]

    def mapping(self, n: int) -> dict[Any, Any]:
        out = {}
        for _ in range(n):
            key = self.value()
            out[key if not isinstance(key, list) else tuple(key)] = self.value()
        return out


def decode(data: bytes, *, source: Path | str) -> Any:
    """The one MessagePack value filling `data`; a truncated buffer, trailing bytes or an extension is E703."""
    decoder = _Decoder(data)
    try:
        value = decoder.value()
    except _Truncated as exc:
        raise bad_layout(
            source, "file", f"complete MessagePack ({len(data)} bytes end inside a value: torn file?)"
        ) from exc
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise bad_layout(source, "file", f"MessagePack data ({exc})") from exc
    if decoder.pos != len(data):
        raise bad_layout(
            source, "file", f"one MessagePack value filling the file ({len(data) - decoder.pos} bytes left)"
        )
    return value
