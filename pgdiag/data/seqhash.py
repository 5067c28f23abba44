"""Sequence hashes that identify a sample by its tokens.

Two trainers fed from one rollout stream share tokens, not sample ids, so pgdiag keys samples by a hash of
their `input_ids`: the 8-byte BLAKE2b digest (no key, no personalisation) of the ids encoded as consecutive
little-endian int32, read as a little-endian uint64. It needs only `hashlib`, so it is stable across
platforms. `seq_hashes` hashes many rows given as flat values + offsets (one hashlib call per row, no Python
loop over tokens); `input_fingerprint` hashes the sorted sample keys of a recompute input.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

_INT32_LE = np.dtype("<i4")


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def seq_hash(input_ids: Sequence[int] | np.ndarray) -> int:
    """BLAKE2b-64 of `input_ids` as little-endian int32, as an unsigned 64-bit integer.

    Ids outside the int32 range raise ValueError (the schema stores ids as int32).
    """
    ids = np.asarray(input_ids)
    if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
        raise ValueError("token id outside the int32 range")
    return _digest(ids.astype(_INT32_LE, copy=False).tobytes())


def seq_hashes(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(R,) uint64 hashes of R rows stored as flat int32 `values` (N,) and `offsets` (R + 1,)."""
    data = np.ascontiguousarray(values, dtype=_INT32_LE)
    byte_offsets = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    out = np.empty(len(byte_offsets) - 1, dtype=np.uint64)
    view = memoryview(data).cast("B")
    for row in range(out.shape[0]):
        digest = hashlib.blake2b(view[byte_offsets[row] : byte_offsets[row + 1]], digest_size=8).digest()
        out[row] = int.from_bytes(digest, "little")
    return out


def input_fingerprint(keys: Iterable[tuple[int, str, int, int]]) -> int:
    """BLAKE2b-64 of the sorted (step, sample_id, segment_idx, seq_hash) tuples of a recompute input.

    Each tuple is encoded as ``step,sample_id,segment_idx,seq_hash\\n`` in UTF-8, in sorted order.
    """
    hasher = hashlib.blake2b(digest_size=8)
    for step, sample_id, segment_idx, hash_value in sorted(keys):
        hasher.update(f"{step},{sample_id},{segment_idx},{hash_value}\n".encode())
    return int.from_bytes(hasher.digest(), "little")
