"""`pgdiag logprobs --routing recompute|replay` on a tiny Qwen2-MoE run that records its routes.

The routes the model itself chooses (one sample per forward, as the recompute below runs with micro_batch=1, so
every forward has the same shape) are written into the run's ``routed_experts`` column: replaying them gives the
recompute stream bit for bit and a disagreement of 0. Changing the experts of a known set of tokens gives, per
step and layer, exactly that fraction in ``_routing.parquet``, and a replay stream that moves away from the
recompute one. Bad routes are one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from test_logprobs import cli_app, make_rows, write_run
from typer.testing import CliRunner

from pgdiag.compare.routing import routing_attribution
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.model import load_model
from pgdiag.recompute.jobs import recompute_logprobs
from pgdiag.recompute.routing import ROUTING_METRIC, read_routing

VOCAB = 97
N_EXPERTS, TOP_K = 8, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = tmp_path_factory.mktemp("qwen2moe")
    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def own_routes(checkpoint: Path, rows: list[dict]) -> list[list[int]]:
    """Per row, the router's top-k of every token and MoE layer, flat (T * L * k), one sample per forward."""
    model = load_model(checkpoint, dtype="fp32")
    out = []
    for row in rows:
        ids = torch.tensor(row["input_ids"])
        n = ids.shape[0]
        topk = model.forward_packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32)).router_topk
        out.append(topk.reshape(-1).tolist())  # (T, L, k) flattened token-major
    return out


def logprobs_of(result) -> list[list[float | None]]:
    frame = pl.read_parquet(sorted(Path(result.path).glob("step=*/part-*.parquet")))
    return frame.sort(["step", "sample_id"])["logprobs"].to_list()


def test_replaying_own_routes_equals_recompute_and_changes_give_their_fraction(
    tmp_path: Path, checkpoint: Path
) -> None:
    rows = make_rows(vocab=VOCAB)
    routes = own_routes(checkpoint, rows)
    run = write_run(tmp_path / "run", [{**r, "routed_experts": x} for r, x in zip(rows, routes, strict=True)])
    options = {"dtype": "fp32", "micro_batch": 1, "device": "cpu"}
    recomputed = recompute_logprobs(run, checkpoint, tag="rc", routing="recompute", **options)
    replayed = recompute_logprobs(run, checkpoint, tag="rp", routing="replay", **options)
    assert recomputed.settings.routing == "recompute" and replayed.settings.routing == "replay"
    assert recomputed.routing_disagree_frac == 0.0 and replayed.routing_disagree_frac == 0.0
    assert logprobs_of(recomputed) == logprobs_of(replayed)
    table = read_routing(replayed.path)
    assert table.columns == ["step", "layer", "tokens", "disagree", ROUTING_METRIC]
    assert table["layer"].to_list() == [0, 1, 0, 1]
    assert table[ROUTING_METRIC].to_list() == [0.0] * 4

    # change the last expert of every 3rd token in layer 0 and every 2nd token in layer 1
    changed, expected = [], {}
    for row, flat in zip(rows, routes, strict=True):
        r = np.array(flat).reshape(len(row["input_ids"]), 2, TOP_K)
        for layer, every in ((0, 3), (1, 2)):
            picked = np.arange(r.shape[0]) % every == 0
            r[picked, layer, -1] = [
                next(e for e in range(N_EXPERTS) if e not in r[t, layer]) for t in np.flatnonzero(picked)
            ]
            if any(row["loss_mask"]):  # samples without loss tokens are not forwarded, so not counted
                tokens, moved = expected.get((row["step"], layer), (0, 0))
                expected[(row["step"], layer)] = (tokens + r.shape[0], moved + int(picked.sum()))
        changed.append(r.reshape(-1).tolist())  # fmt: skip
    run2 = write_run(
        tmp_path / "run2", [{**r, "routed_experts": x} for r, x in zip(rows, changed, strict=True)]
    )
    recomputed2 = recompute_logprobs(run2, checkpoint, tag="rc", routing="recompute", **options)
    replayed2 = recompute_logprobs(run2, checkpoint, tag="rp", routing="replay", **options)
    assert logprobs_of(recomputed2) == logprobs_of(recomputed)  # the router choosing ignores the record
    table = read_routing(recomputed2.path)
    for step, layer, tokens, disagree, frac in table.iter_rows():
        assert (tokens, disagree) == expected[(step, layer)]
        assert frac == pytest.approx(disagree / tokens, rel=1e-12)
    total = sum(m for _, m in expected.values()) / sum(t for t, _ in expected.values())
    assert recomputed2.routing_disagree_frac == pytest.approx(total, rel=1e-12)
    diffs = [
        abs(a - b)
        for x, y in zip(logprobs_of(replayed2), logprobs_of(recomputed2), strict=True)
        for a, b in zip(x, y, strict=True)
        if a is not None
    ]
    assert max(diffs) > 1e-3


def test_routing_errors(tmp_path: Path, checkpoint: Path) -> None:
    rows = make_rows(vocab=VOCAB, n_steps=1)
    plain = write_run(tmp_path / "plain", rows)
    with pytest.raises(UsageError, match="no 'routed_experts' column") as err:
        recompute_logprobs(plain, checkpoint, routing="replay", dtype="fp32", device="cpu")
    assert err.value.code == "E506"  # replay needs the routes column
    result = recompute_logprobs(plain, checkpoint, routing="recompute", dtype="fp32", device="cpu")
    assert result.routing_disagree_frac is None and not (result.path / "_routing.parquet").exists()
    short = [{**r, "routed_experts": [0] * (len(r["input_ids"]) * 2 * TOP_K - 1)} for r in rows]
    with pytest.raises(InvalidInputError, match="routed_experts length") as err:
        recompute_logprobs(write_run(tmp_path / "short", short), checkpoint, routing="replay", dtype="fp32")
    assert err.value.code == "E201"
    wild = [{**r, "routed_experts": [N_EXPERTS] * (len(r["input_ids"]) * 2 * TOP_K)} for r in rows]
    with pytest.raises(InvalidInputError, match=r"expert 8 outside \[-1, 8\)") as err:
        recompute_logprobs(write_run(tmp_path / "wild", wild), checkpoint, routing="replay", dtype="fp32")
    assert err.value.code == "E218"


def test_cli_routing_replay_reports_the_fraction(tmp_path: Path, checkpoint: Path) -> None:
    rows = make_rows(vocab=VOCAB, n_steps=1)
    routes = own_routes(checkpoint, rows)
    run = write_run(tmp_path / "run", [{**r, "routed_experts": x} for r, x in zip(rows, routes, strict=True)])
    args = ["logprobs", str(run), "--model", str(checkpoint), "--dtype", "fp32", "--micro-batch", "1"]
    result = CliRunner().invoke(cli_app(), [*args, "--routing", "replay", "--experts", "loop", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["summary"]["rc_fp32_fp32"]
    assert summary["routing/disagree_frac"] == 0.0
    assert summary["settings"]["routing"] == "replay" and summary["settings"]["experts"] == "loop"
    dense = tmp_path / "dense"
    from test_logprobs import make_checkpoint

    make_checkpoint(dense)
    result = CliRunner().invoke(
        cli_app(), ["logprobs", str(run), "--model", str(dense), "--routing", "replay"]
    )
    assert result.exit_code == 2
    assert "E506" in result.output and "dense" in result.output


def test_compare_attributes_the_mismatch_to_routing(tmp_path: Path, checkpoint: Path) -> None:
    """An engine whose only difference from the trainer is routing (its log-probs = the replay of its routes):
    replay leaves no mismatch, recompute does, so routing explains all of it; the CLI prints and returns it."""
    rows = make_rows(vocab=VOCAB)
    changed = []
    for row, flat in zip(rows, own_routes(checkpoint, rows), strict=True):
        r = np.array(flat).reshape(len(row["input_ids"]), 2, TOP_K)
        r[::2, :, -1] = [
            [next(e for e in range(N_EXPERTS) if e not in r[t, layer]) for layer in range(2)]
            for t in range(0, r.shape[0], 2)
        ]
        changed.append(r.reshape(-1).tolist())  # fmt: skip
    staging = write_run(
        tmp_path / "staging", [{**r, "routed_experts": x} for r, x in zip(rows, changed, strict=True)]
    )
    engine = logprobs_of(recompute_logprobs(staging, checkpoint, tag="rp", routing="replay", dtype="fp32"))
    run = write_run(
        tmp_path / "run",
        [{**r, "routed_experts": x, "rollout_logprobs": lp} for r, x, lp in zip(rows, changed, engine, strict=True)],
    )  # fmt: skip
    recompute_logprobs(run, checkpoint, tag="rc", routing="recompute", dtype="fp32")
    recompute_logprobs(run, checkpoint, tag="rp", routing="replay", dtype="fp32")
    table = routing_attribution(run, stream_a="rollout", recompute="rc", replay="rp")
    assert table["step"].to_list() == ["all", "0", "1"]
    assert table["abs_mean_replay"].to_list() == pytest.approx([0.0] * 3, abs=1e-7)  # float32 storage
    assert min(table["abs_mean_recompute"].to_list()) > 1e-2
    assert table["routing/mismatch_share"].to_list() == pytest.approx([1.0] * 3, abs=1e-5)
    assert 0.3 < table["routing/disagree_frac"][0] < 0.7  # half the tokens moved in both layers
    args = ["compare", str(run), "--stream-a", "rollout", "--stream-b", "rc", "--routing-replay", "rp"]
    from pgdiag.cli.app import build_app

    result = CliRunner().invoke(build_app(), [*args, "--json", "--exit-zero"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in json.loads(result.stdout)["routing"]] == ["all", "0", "1"]
