"""Where a whatif rule loses data: the buckets of the `threshold/<breakdown>` tables (step, env, response position,
lag), coded once per batch so that each rule costs one `bincount` per breakdown (docs/whatif.md, "Rows")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pgdiag.analysis.settings import POSITION_EDGES
from pgdiag.data.batch import TokenBatch
from pgdiag.data.versions import TokenLag, lag_buckets


def _sample_of_token(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))


def _position_bucket(resp_pos: np.ndarray) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    edges = np.asarray([*POSITION_EDGES, np.inf])
    index = np.clip(np.searchsorted(edges, resp_pos, side="right") - 1, 0, len(POSITION_EDGES) - 1)
    labels = [
        (
            f"[{POSITION_EDGES[i]},{'inf' if i + 1 == len(POSITION_EDGES) else POSITION_EDGES[i + 1]})",
            float(edges[i]),
            float(edges[i + 1]),
        )
        for i in range(len(POSITION_EDGES))
    ]
    return index, labels


@dataclass(frozen=True)
class Localiser:
    """The buckets of every `threshold/<breakdown>` table, coded once per batch: per breakdown a bucket code per
    token (M,), and per bucket its label, bounds and token count."""

    tables: tuple[tuple[str, np.ndarray, tuple[tuple[str, float | None, float | None, int], ...]], ...]

    @staticmethod
    def of(batch: TokenBatch, lag: TokenLag | None = None) -> Localiser:
        tok_sample = _sample_of_token(batch.offsets)
        tables = []
        steps, step_code = np.unique(batch.step, return_inverse=True)
        tables.append(("step", step_code[tok_sample], [(str(int(v)), float(v), float(v)) for v in steps]))
        if batch.env is not None:
            envs = sorted(set(batch.env.tolist()), key=str)
            index = {env: i for i, env in enumerate(envs)}
            env_code = np.asarray([index[e] for e in batch.env.tolist()], dtype=np.int64)
            tables.append(("env", env_code[tok_sample], [(str(e), None, None) for e in envs]))
        resp_pos = batch.pos.astype(np.int64) - batch.prompt_len[tok_sample].astype(np.int64)
        index, labels = _position_bucket(resp_pos)
        tables.append(("position", index, labels))
        if lag is not None:
            code = np.zeros(batch.n_tokens, dtype=np.int64)  # lag_buckets covers every token
            lag_labels = []
            for i, (label, tok) in enumerate(lag_buckets(lag.lag)):
                code[tok] = i
                value = float(label) if label.isdigit() else None
                lag_labels.append((label, value, value))
            tables.append(("lag", code, lag_labels))
        coded = []
        for name, code, labels in tables:
            counts = np.bincount(code, minlength=len(labels))
            buckets = tuple((lab, lo, hi, int(n)) for (lab, lo, hi), n in zip(labels, counts, strict=True))
            coded.append((name, code, buckets))
        return Localiser(tuple(coded))

    def hits(self, flags: np.ndarray) -> Iterator[tuple[str, str, float | None, float | None, float, int]]:
        """(breakdown, bucket, lo, hi, tokens flagged, tokens) of the non-empty buckets; a run read in pieces adds
        both counts over its pieces (`whatif_fold.WhatifFold`)."""
        for name, code, buckets in self.tables:
            hits = np.bincount(code, weights=flags, minlength=len(buckets))
            for (label, lo, hi, n), hit in zip(buckets, hits, strict=True):
                if n:
                    yield name, label, lo, hi, float(hit), n
