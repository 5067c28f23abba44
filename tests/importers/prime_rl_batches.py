"""prime-rl 0.8.0 rollout files as its filesystem transport writes them (PrimeIntellect-ai/prime-rl 559b4477).

prime-rl needs a GPU stack to import, so its wire types are declared here exactly as in
``src/prime_rl/transports/rollouts/types.py`` (same fields, same order, same ``msgspec.Struct`` options) and
encoded with msgspec's own MessagePack encoder, as ``FileSystemMicroBatchSender`` does. `pack` builds a packed
micro-batch from samples the way ``prepare_sample`` + ``pad_micro_batch`` lay it out (position ids restarting
at 0 per sample, padding tokens 1 with loss false and env "" extending the last ``seq_lens`` entry), and `dummy`
is ``_make_dummy_batch`` (loss mask all false, weight streams dropped).

The kept-set masks of prime-rl#3431 (branch feat/top-p-mask-replay at d09488d5, ``src/prime_rl/transport/
types.py``) are declared the same way: ``KeptTokens(ids, counts)`` of raw int32 bytes, ``MicroBatch.kept_tokens``
appended last; `pack` concatenates the samples' bytes and pads ``counts`` with zeros as ``_pad_kept_tokens`` does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class KeptTokens(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    ids: bytes
    counts: bytes


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    kept_tokens: KeptTokens | None = None


@dataclass
class Sample:
    """One TrainingSample: a flat token sequence, token-aligned lists."""

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    advantages: list[float]
    temperatures: list[float]
    env_name: str
    ref_logprobs: list[float] | None = None
    rl_weights: list[float] | None = None
    routed_experts: np.ndarray | None = (
        None  # (T, layers, top_k), as the orchestrator encodes a branch's routes
    )
    kept: list[list[int]] | None = None  # the kept set of every token ([] = no mask), as _encode_kept_tokens


def pack(samples: list[Sample], pad_to_multiple_of: int = 1) -> MicroBatch:
    total = sum(len(s.token_ids) for s in samples)
    with_ref = samples[0].ref_logprobs is not None
    with_rl = any(s.rl_weights is not None for s in samples)
    batch = MicroBatch(
        input_ids=[t for s in samples for t in s.token_ids],
        loss_mask=[m for s in samples for m in s.mask],
        advantages=[a for s in samples for a in s.advantages],
        inference_logprobs=[x for s in samples for x in s.logprobs],
        position_ids=[i for s in samples for i in range(len(s.token_ids))],
        sequence_lengths=[len(s.token_ids) for s in samples],
        temperatures=[t for s in samples for t in s.temperatures],
        env_names=[s.env_name for s in samples for _ in s.token_ids],
        seq_lens=[len(s.token_ids) for s in samples],
        ref_logprobs=[x for s in samples for x in s.ref_logprobs] if with_ref else None,  # type: ignore[union-attr]
        rl_weights=[w for s in samples for w in (s.rl_weights or [1.0] * len(s.token_ids))]
        if with_rl
        else None,
    )
    if samples[0].routed_experts is not None:  # prepare_sample concatenates the samples' RoutedExperts bytes
        routes = np.concatenate([s.routed_experts for s in samples], axis=0)  # type: ignore[misc]
        batch.routed_experts = RoutedExperts(routes.tobytes(), list(routes.shape), str(routes.dtype))
    if samples[0].kept is not None:  # KeptTokens bytes of the samples one after the other
        sets = [k for s in samples for k in (s.kept or [[]] * len(s.token_ids))]
        batch.kept_tokens = KeptTokens(
            np.asarray([t for k in sets for t in k], dtype="<i4").tobytes(),
            np.asarray([len(k) for k in sets], dtype="<i4").tobytes(),
        )
    padding = -total % pad_to_multiple_of
    if padding:
        batch.input_ids.extend([1] * padding)
        batch.advantages.extend([0.0] * padding)
        batch.loss_mask.extend([False] * padding)
        batch.position_ids.extend(range(padding))
        batch.sequence_lengths[-1] += padding
        batch.seq_lens[-1] += padding
        batch.inference_logprobs.extend([0.0] * padding)
        batch.temperatures.extend([1.0] * padding)
        if batch.ref_logprobs is not None:
            batch.ref_logprobs.extend([0.0] * padding)
        if batch.rl_weights is not None:
            batch.rl_weights.extend([0.0] * padding)
        batch.env_names.extend([""] * padding)
        if batch.routed_experts is not None:  # _pad_routed_experts: zero bytes, shape[0] += padding
            row = batch.routed_experts.shape[1] * batch.routed_experts.shape[2]
            batch.routed_experts.data += b"\0" * (
                padding * row * np.dtype(batch.routed_experts.dtype).itemsize
            )
            batch.routed_experts.shape[0] += padding
        if batch.kept_tokens is not None:  # _pad_kept_tokens: zero counts
            batch.kept_tokens.counts += b"\0" * (padding * 4)
    return batch


def dummy(source: MicroBatch) -> MicroBatch:
    out = copy.deepcopy(source)
    out.advantages = [0.0] * len(out.input_ids)
    out.loss_mask = [False] * len(out.input_ids)
    out.rl_weights = None
    out.ce_weights = None
    out.ref_kl_weights = None
    return out


def write_rank(root: Path, step: int, rank: int, batches: list[MicroBatch]) -> Path:
    path = root / "rollouts" / f"step_{step}" / f"rank_{rank}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.msgpack.Encoder().encode(batches))
    return path
