"""`compare --model CKPT`: the exact best-fit temperature from side b's logits recovers a one-sided T = 0.7.

Side a's log-probs are computed from an independent reference (HF transformers, fp32) with the logits divided by
0.7; side b's from the plain logits. pgdiag recomputes b's logits with its own model and must find τ* ≈ 0.7.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from batch_factory import write_run
from hf_tiny import save_tiny_llama
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.compare.api import compare_runs
from pgdiag.data.runs import read_run

VOCAB = 97


@pytest.fixture(scope="module")
def tempered_runs(tmp_path_factory):
    return _tempered_runs(tmp_path_factory.mktemp("tau"), stepped=False)


@pytest.fixture(scope="module")
def stepped_runs(tmp_path_factory):
    """The same samples, one per step (6 steps): a comparison read step by step holds them in 6 pieces."""
    return _tempered_runs(tmp_path_factory.mktemp("tau_steps"), stepped=True)


def _tempered_runs(root, *, stepped: bool):
    model = save_tiny_llama(root / "ckpt", seed=0, vocab_size=VOCAB, max_position_embeddings=128)
    rng = np.random.default_rng(3)
    samples = []
    for i in range(6):
        prompt_len, length = 3, 20
        ids = rng.integers(0, VOCAB, size=length)
        with torch.no_grad():
            logits = (
                model(torch.as_tensor(ids)[None]).logits[0].double()
            )  # (T, V): row p predicts token p + 1
        loss = list(range(prompt_len, length))
        pred = logits[torch.as_tensor(loss) - 1]  # (m, V)
        tok = torch.as_tensor(ids[loss])[:, None]
        lp_tempered = torch.log_softmax(pred / 0.7, dim=-1).gather(1, tok).squeeze(1).numpy()
        lp_plain = torch.log_softmax(pred, dim=-1).gather(1, tok).squeeze(1).numpy()
        samples.append({
            "step": i if stepped else 0, "sample_id": f"s{i}", "input_ids": ids.tolist(), "prompt_len": prompt_len, "loss": loss,
            "streams": {"rollout": lp_tempered, "old": lp_plain}, "reward": 0.0, "env": "x",
        })  # fmt: skip
    a = write_run(root / "engine.parquet", samples, run="engine", streams={"rollout_logprobs": "rollout"})
    b = write_run(root / "trainer.parquet", samples, run="trainer", streams={"rollout_logprobs": "old"})
    return a, b, root / "ckpt"


def test_exact_tau_with_model_is_within_001_of_07(tempered_runs) -> None:
    a, b, ckpt = tempered_runs
    report = compare_runs(read_run(a), read_run(b), stream_a="rollout", model=ckpt).report
    tau = report.value("mismatch/tau_fit", scope="token")
    assert tau is not None and abs(tau - 0.7) < 0.01
    assert report.value("mismatch/tau_fit_rms", scope="token") < 1e-3  # float32 storage of the log-probs
    assert report.meta["diagnosis"][report.meta["pairs"][0]]["tau_source"] == "logits (--model)"
    w401 = report.checks.filter(report.checks["code"] == "W401")["message"].to_list()
    assert len(w401) == 1 and "best-fit temperature 0.7" in w401[0]  # the slope hint's warning is superseded


def test_tau_gate_fails_through_the_cli(tempered_runs) -> None:
    a, b, ckpt = tempered_runs
    result = CliRunner().invoke(
        build_app(), ["compare", str(a), str(b), "--model", str(ckpt), "--fail-on", "tau_dev>0.02", "--json"]
    )
    assert result.exit_code == 1, result.output
    gate = json.loads(result.stdout)["gates"][0]
    assert gate["metric"] == "mismatch/tau_fit" and abs(gate["value"] - 0.3) < 0.01


def test_exact_tau_read_step_by_step_equals_one_piece(stepped_runs, monkeypatch) -> None:
    """Six pieces of one step each give the fit of one piece exactly; with a budget of 40 tokens (the third
    sample cut after 6 of its 17) both fit the same first 40 matched tokens."""
    from pgdiag.compare import tau as tau_module

    a, b, ckpt = stepped_runs

    def fit(chunk_rows: int) -> tuple[float, float, int, list[str]]:
        report = compare_runs(
            read_run(a), read_run(b), stream_a="rollout", model=ckpt, chunk_rows=chunk_rows
        ).report
        row = report.summary.filter(report.summary["metric"] == "mismatch/tau_fit").row(0, named=True)
        w401 = report.checks.filter(report.checks["code"] == "W401")["message"].to_list()
        return row["value"], report.value("mismatch/tau_fit_rms", scope="token"), row["n"], w401

    one, many = fit(10**6), fit(2)
    assert one == many
    assert one[2] == 6 * 17 and abs(one[0] - 0.7) < 0.01
    assert len(one[3]) == 1 and "best-fit temperature 0.7" in one[3][0]
    monkeypatch.setattr(tau_module, "TAU_FIT_TOKENS", 40)
    cut_one, cut_many = fit(10**6), fit(2)
    assert cut_one == cut_many and cut_one[2] == 40
    assert abs(cut_one[0] - 0.7) < 0.01 and cut_one[1] != one[1]  # a fit of fewer tokens
