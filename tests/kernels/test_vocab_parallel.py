"""Vocab-parallel LM head on CPU: gloo process groups of 2 and 3 ranks, uneven shards, equal to TP=1.

Each rank holds rows `vocab_shard_range(V, rank, world)` of W and calls `lm_head_logprobs` with the group; the
parent compares every rank's result to the single-process result. Targets sit at shard boundaries, in the
last row and on ignored tokens; an out-of-vocab target must raise E208 on every rank.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_head_cases import make_case

from pgdiag.errors import InvalidInputError
from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.vocab_parallel import vocab_shard_range

TEMPERATURE = 0.7


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _boundary_targets(targets: torch.Tensor, vocab: int, world_size: int) -> torch.Tensor:
    """Targets with the first and last row of every shard planted at the front."""
    targets = targets.clone()
    edges = []
    for rank in range(world_size):
        start, stop = vocab_shard_range(vocab, rank, world_size)
        edges += [start, stop - 1]
    targets[2 : 2 + len(edges)] = torch.tensor(edges)
    return targets


def _rank_main(rank: int, world_size: int, port: int, vocab: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        case = make_case(40, 24, vocab, seed=11)
        targets = _boundary_targets(case.targets, vocab, world_size)
        start, stop = vocab_shard_range(vocab, rank, world_size)
        out = lm_head_logprobs(
            case.hidden,
            case.weight[start:stop],
            targets,
            temperature=TEMPERATURE,
            head_dtype="fp32",
            tp_group=dist.group.WORLD,
            vocab_start=start,
        )
        bad = targets.clone()
        bad[7] = vocab  # one past the last row: no rank holds it
        try:
            lm_head_logprobs(
                case.hidden, case.weight[start:stop], bad, tp_group=dist.group.WORLD, vocab_start=start
            )
            error_code = ""
        except InvalidInputError as err:
            error_code = err.code
        torch.save(
            {"logprobs": out.logprobs, "entropy": out.entropy, "error_code": error_code},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world_size", "vocab"), [(2, 21), (3, 37)], ids=["tp2_v21", "tp3_v37"])
def test_vocab_parallel_equals_one_rank(world_size: int, vocab: int, tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(world_size, _free_port(), vocab, str(tmp_path)), nprocs=world_size)
    case = make_case(40, 24, vocab, seed=11)
    targets = _boundary_targets(case.targets, vocab, world_size)
    single = lm_head_logprobs(case.hidden, case.weight, targets, temperature=TEMPERATURE, head_dtype="fp32")
    for rank in range(world_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # |logprob| reaches ~40, where 1e-5 is a few fp32 ulp: allow a relative 1e-6 as well
        torch.testing.assert_close(got["logprobs"], single.logprobs, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got["entropy"], single.entropy, rtol=0, atol=1e-5)
        assert got["error_code"] == "E208"
