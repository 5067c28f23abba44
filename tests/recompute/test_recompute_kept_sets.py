"""`pgdiag logprobs --kept-set` on a tiny checkpoint whose rollouts transformers sampled with top-k 20 then top-p
0.9 (vLLM processed semantics: temperature, top-k, top-p on the top-k-renormalised distribution), K recorded.

- ``recorded`` (the default here) reproduces the rollout log-probs within 1e-5 nats;
- ``off`` scores the full vocabulary: rollout − off = −log kept mass within 1e-5, and the kept mass column holds it;
- ``reconstruct`` finds the recorded K on ≥ 99.9 % of positions and scores as ``recorded`` does;
- the three stream semantics (vLLM processed, vLLM raw, SGLang default) pick their default and the bias sign.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hf_tiny import save_scaled_qwen3

import pgdiag
from pgdiag.data.runs import read_run
from pgdiag.errors import UsageError
from pgdiag.kernels.kept_reconstruct import keep_mask_vllm
from pgdiag.recompute.jobs import recompute_logprobs
from pgdiag.recompute.kept_rules import resolve_kept_set

VOCAB = 97
TEMPERATURE = 0.8
TOP_K, TOP_P = 20, 0.9
SAMPLING = {
    "engine": "vllm",
    "logprobs_mode": "processed",
    "temperature": TEMPERATURE,
    "top_k": TOP_K,
    "top_p": TOP_P,
}


def _checkpoint(directory: Path) -> torch.nn.Module:
    """A tiny random Qwen3, its head scaled by 12: a peaked distribution, as a trained LM has (top-p keeps few)."""
    return save_scaled_qwen3(directory, seed=1, head_scale=12.0, vocab_size=VOCAB)


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, top-k (ties kept), top-p (ascending cumulative)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(TEMPERATURE)(None, logits[None].clone())
    scores = TopPLogitsWarper(TOP_P)(None, TopKLogitsWarper(TOP_K)(None, scores))
    return torch.log_softmax(scores[0], dim=-1)  # -inf outside K


def _rollouts(model: torch.nn.Module, n_samples: int = 12, new_tokens: int = 14) -> tuple[pl.DataFrame, list]:
    """Samples generated token by token in fp32; per sampled position the renormalised log-prob and K."""
    gen = torch.Generator().manual_seed(7)
    rows, logits_seen = [], []
    for s in range(n_samples):
        ids = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
        prompt_len = len(ids)
        lps, kept, offsets = [None] * prompt_len, [], [0] * (prompt_len + 1)
        full_t, full_raw = [None] * prompt_len, [None] * prompt_len
        kept_lp: list[float] = []  # an engine that logged its kept log-probs at T = 1 (sampled at T = 0.8)
        for _ in range(new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()  # (V,)
            logp = _processed(logits)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            k = torch.isfinite(logp).nonzero()[:, 0].tolist()
            kept += k
            kept_lp += torch.log_softmax(logits.double(), -1)[k].tolist()
            offsets.append(offsets[-1] + len(k))
            lps.append(float(logp[token]))
            full_t.append(float(torch.log_softmax(logits.double() / TEMPERATURE, -1)[token]))
            full_raw.append(float(torch.log_softmax(logits.double(), -1)[token]))
            logits_seen.append((logits, k))
            ids.append(token)
        rows.append(
            {
                "step": s % 2,
                "sample_id": f"s{s}",
                "group_id": f"g{s // 3}",
                "input_ids": ids,
                "prompt_len": prompt_len,
                "loss_mask": [t >= prompt_len for t in range(len(ids))],
                "rollout_logprobs": lps,
                "sampling_kept_ids": kept,
                "sampling_kept_offsets": offsets,
                "sampling_kept_logprobs": kept_lp,
                "full_tempered": full_t,  # SGLang's default stream: tempered, full vocabulary
                "full_raw": full_raw,  # vLLM raw_logprobs: T = 1, full vocabulary
            }
        )
    return pl.DataFrame(rows), logits_seen


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("kept")
    model = _checkpoint(root / "ckpt")
    frame, seen = _rollouts(model)
    run = root / "run"
    pgdiag.write_run(frame.drop("full_tempered", "full_raw"), run, sampling=SAMPLING)
    return {"root": root, "ckpt": root / "ckpt", "run": run, "frame": frame, "seen": seen}


def _stream(run: Path, tag: str) -> pl.DataFrame:
    parts = sorted((run / "logprobs" / tag).glob("step=*/part-*.parquet"))
    return pl.concat([pl.read_parquet(p) for p in parts]).sort("sample_id")


def _loss_values(frame: pl.DataFrame, column: str) -> np.ndarray:
    return np.array([v for row in frame[column].to_list() for v in row if v is not None], dtype=np.float64)


def _recompute(setup: dict, tag: str, kept_set: str, temperature: float | str = "auto"):
    return recompute_logprobs(
        str(setup["run"]), str(setup["ckpt"]), tag=tag, dtype="fp32", head_dtype="fp32", kept_set=kept_set,
        device="cpu", temperature=temperature,
    )  # fmt: skip


def test_recorded_reproduces_the_rollout_within_1e5(setup: dict) -> None:
    result = _recompute(setup, "rc_auto", "auto")
    assert result.settings.kept_set == "recorded" and result.settings.kept_source == "recorded"
    rollout = _loss_values(setup["frame"].sort("sample_id"), "rollout_logprobs")
    stream = _stream(setup["run"], "rc_auto")
    got = _loss_values(stream, "logprobs")
    assert got.shape == rollout.shape
    assert np.abs(got - rollout).max() <= 1e-5, np.abs(got - rollout).max()
    mass = _loss_values(stream, "kept_mass")
    assert (mass < 1).any() and (mass <= 1).all()
    # the full-vocabulary column beside it: full = renormalised + log kept mass
    full = _loss_values(stream, "logprobs_full")
    assert np.abs(full - (got + np.log(mass))).max() <= 1e-5


def test_off_differs_by_minus_log_kept_mass(setup: dict) -> None:
    result = _recompute(setup, "rc_off", "off")
    assert result.settings.kept_set == "off" and result.settings.kept_source == "recorded"
    rollout = _loss_values(setup["frame"].sort("sample_id"), "rollout_logprobs")
    stream = _stream(setup["run"], "rc_off")
    off, mass = _loss_values(stream, "logprobs"), _loss_values(stream, "kept_mass")
    bias = rollout - off
    assert (bias >= -1e-6).all() and bias.mean() > 0.01  # the renormalised stream is above the full one
    assert np.abs(bias - (-np.log(mass))).max() <= 1e-5
    assert result.truncation_bias is not None and abs(result.truncation_bias - bias.mean()) <= 1e-5
    assert not any(w.startswith("W413") for w in result.warnings)  # K is recorded: no hidden bias


def test_reconstruct_finds_the_recorded_kept_sets(setup: dict) -> None:
    found = 0
    for logits, recorded in setup["seen"]:
        z = (logits.double() / TEMPERATURE).float()[None]
        n = torch.ones(1)
        mask = keep_mask_vllm(z, torch.tensor([TOP_K]), n * TOP_P, n * 0)
        found += mask[0].nonzero()[:, 0].tolist() == recorded
    assert found / len(setup["seen"]) >= 0.999, (found, len(setup["seen"]))
    result = _recompute(setup, "rc_rebuilt", "reconstruct")
    assert result.settings.kept_set == "reconstruct:vllm"
    rebuilt = _loss_values(_stream(setup["run"], "rc_rebuilt"), "logprobs")
    rollout = _loss_values(setup["frame"].sort("sample_id"), "rollout_logprobs")
    close = np.abs(rebuilt - rollout) <= 1e-5
    assert close.mean() >= 0.999, close.mean()
    assert any(w.startswith("W413") for w in result.warnings)  # the pipeline rebuilt K: truncation without K


@pytest.mark.parametrize(
    ("sampling", "stream", "with_kept", "temperature", "default", "source"),
    [
        (
            {"engine": "vllm", "logprobs_mode": "processed"},
            "rollout_logprobs",
            True,
            "auto",
            "recorded",
            "recorded",
        ),
        ({"engine": "vllm", "logprobs_mode": "raw"}, "full_raw", True, 1.0, "off", "recorded"),
        ({"engine": "sglang"}, "full_tempered", False, "auto", "off", "reconstruct:sglang"),
    ],
    ids=["vllm_processed", "vllm_raw", "sglang_default"],
)
def test_three_stream_semantics(
    setup: dict,
    tmp_path: Path,
    sampling: dict,
    stream: str,
    with_kept: bool,
    temperature,
    default: str,
    source: str,
) -> None:
    """Each stream gets its default; the recompute under the default agrees with the stream (no bias added to
    the trainer's side), and the kept mass (recorded or rebuilt) is a hidden bias > 0 for the full-vocabulary
    streams, reported with W413 when no K was recorded."""
    frame = (
        setup["frame"]
        .with_columns(pl.col(stream).alias("rollout_logprobs"))
        .drop("full_tempered", "full_raw")
    )
    if not with_kept:
        frame = frame.drop("sampling_kept_ids", "sampling_kept_offsets", "sampling_kept_logprobs")
    run = tmp_path / "run"
    pgdiag.write_run(
        frame, run, sampling={**sampling, "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P}
    )
    plan = resolve_kept_set(read_run(run), "auto")
    assert (plan.kept_set, plan.kept_source) == (default, source)
    result = _recompute({**setup, "run": run}, "rc", "auto", temperature)
    logged = _loss_values(frame.sort("sample_id"), "rollout_logprobs")
    got = _loss_values(_stream(run, "rc"), "logprobs")
    assert np.abs(got - logged).max() <= 1e-5  # the default scores as the stream was logged
    assert result.truncation_bias is not None and result.truncation_bias > 0.01
    assert any(w.startswith("W413") for w in result.warnings) == (not with_kept)


def test_recorded_without_kept_sets_is_e506(setup: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    pgdiag.write_run(
        setup["frame"].drop("sampling_kept_ids", "sampling_kept_offsets", "sampling_kept_logprobs"),
        run,
        sampling=SAMPLING,
    )
    with pytest.raises(UsageError) as raised:
        resolve_kept_set(read_run(run), "recorded")
    assert raised.value.code == "E506"


def _all_row(report) -> dict[str, float | None]:
    summary = report.summary.filter(pl.col("bucket") == "all")
    return dict(zip(summary["metric"].to_list(), summary["value"].to_list(), strict=True))


def test_metrics_report_the_kept_mass_beside_the_mismatch(setup: dict) -> None:
    """mismatch/* against the renormalised recompute is ~0 (the engine's stream scored the same way), the kept
    mass and truncation bias equal the recompute's columns, and full_bias = bias − truncation_bias."""
    _recompute(setup, "rc_metrics", "recorded")
    run = read_run(setup["run"])
    assert "rc_metrics" in run.kept_tags
    report = pgdiag.compute_metrics(run, new="rc_metrics", stream_b="rc_metrics")
    values = _all_row(report)
    stream = _stream(setup["run"], "rc_metrics")
    mass = _loss_values(stream, "kept_mass")
    assert abs(values["mismatch/bias"]) <= 1e-5
    assert values["mismatch/kept_mass_mean"] == pytest.approx(mass.mean(), abs=1e-6)
    assert values["mismatch/kept_mass_min"] == pytest.approx(mass.min(), abs=1e-6)
    assert values["mismatch/kept_mass_p05"] == pytest.approx(np.quantile(mass, 0.05), abs=1e-6)
    assert values["mismatch/truncation_bias"] == pytest.approx(-np.log(mass).mean(), abs=1e-5)
    assert values["mismatch/full_bias"] == pytest.approx(
        values["mismatch/bias"] - values["mismatch/truncation_bias"], abs=1e-5
    )
    assert values["mismatch/full_abs_mean"] >= abs(values["mismatch/full_bias"]) - 1e-9
    assert "W413" not in report.checks["code"].to_list()  # K is recorded


def test_metrics_warn_w413_with_the_bias_size_when_k_is_not_recorded(setup: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    frame = setup["frame"].drop(
        "sampling_kept_ids", "sampling_kept_offsets", "sampling_kept_logprobs", "full_tempered", "full_raw"
    )
    pgdiag.write_run(frame, run_dir, sampling=SAMPLING)
    without = pgdiag.compute_metrics(read_run(run_dir), new="rollout", old="rollout", stream_a=None)
    w413 = without.checks.filter(pl.col("code") == "W413")["message"].to_list()
    assert len(w413) == 1 and "of unknown size" in w413[0]
    result = _recompute({**setup, "run": run_dir}, "rc", "off")
    assert result.settings.kept_source == "reconstruct:vllm"
    report = pgdiag.compute_metrics(read_run(run_dir), new="rc", stream_b="rc")
    values = _all_row(report)
    message = report.checks.filter(pl.col("code") == "W413")["message"].to_list()
    assert len(message) == 1 and f"{values['mismatch/truncation_bias']:.4g} nats" in message[0], message
    # the processed rollout against the full-vocabulary recompute: the bias shows as mismatch of that size
    assert values["mismatch/bias"] == pytest.approx(-values["mismatch/truncation_bias"], abs=2e-3)


def test_compare_pairs_the_engine_stream_with_the_kept_set_recompute(setup: dict) -> None:
    """`compare RUN --stream-a rollout --stream-b TAG`: the engine's renormalised stream against the recompute
    scored over K agrees to 1e-5 on every token (a one-token set's 0.0 is no E206), against the full-vocabulary
    recompute it is off by −log kept mass."""
    _recompute(setup, "rc_cmp", "recorded")
    _recompute(setup, "rc_cmp_off", "off")
    run = read_run(setup["run"])
    kept = pgdiag.compare_runs(run, stream_a="rollout", stream_b="rc_cmp", keep_tokens=True)
    assert kept.pair is not None and np.abs(kept.pair.lp_b - kept.pair.lp_a).max() <= 1e-5
    full = pgdiag.compare_runs(run, stream_a="rollout", stream_b="rc_cmp_off", keep_tokens=True)
    assert full.pair is not None
    mass = _loss_values(_stream(setup["run"], "rc_cmp_off"), "kept_mass")
    gap = full.pair.lp_a - full.pair.lp_b  # the renormalised minus the full-vocabulary log-prob
    assert gap.mean() == pytest.approx(-np.log(mass).mean(), abs=1e-5)


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same rollouts from a tiny Qwen2-MoE (4 experts, top-2, a shared expert)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    root = tmp_path_factory.mktemp("kept_moe")
    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(2)
    model = Qwen2MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    frame, seen = _rollouts(model, n_samples=6)
    run = root / "run"
    pgdiag.write_run(frame.drop("full_tempered", "full_raw"), run, sampling=SAMPLING)
    return {"root": root, "ckpt": root / "ckpt", "run": run, "frame": frame, "seen": seen}


def test_moe_recorded_reproduces_the_rollout(moe_setup: dict) -> None:
    result = _recompute(moe_setup, "rc", "auto")
    assert result.settings.kept_set == "recorded" and result.settings.experts != "none"
    rollout = _loss_values(moe_setup["frame"].sort("sample_id"), "rollout_logprobs")
    got = _loss_values(_stream(moe_setup["run"], "rc"), "logprobs")
    assert np.abs(got - rollout).max() <= 1e-5, np.abs(got - rollout).max()


def test_kept_kl_of_the_engine_kept_logprobs(setup: dict) -> None:
    """The run records the engine's kept log-probs (here at T = 1 while it sampled at T = 0.8): the recompute's
    kept_kl column and mismatch/kept_kl equal KL over K of softmax_K(z) against softmax_K(z / 0.8), by hand."""
    _recompute(setup, "rc_kl", "recorded")
    expected = []
    for logits, k in setup["seen"]:
        z = logits.double()[k]
        engine = torch.log_softmax(z, 0)
        model = torch.log_softmax(z / TEMPERATURE, 0)
        expected.append(float((engine.exp() * (engine - model)).sum()))
    stream = _stream(setup["run"], "rc_kl")
    got = _loss_values(stream, "kept_kl")
    assert got.shape[0] == len(expected)
    assert np.sort(got) == pytest.approx(np.sort(expected), abs=2e-5)
    report = pgdiag.compute_metrics(read_run(setup["run"]), new="rc_kl", stream_b="rc_kl")
    assert _all_row(report)["mismatch/kept_kl"] == pytest.approx(np.mean(expected), abs=2e-5)


def _as_bitmasks(frame: pl.DataFrame, every: int = 3) -> pl.DataFrame:
    """The frame with the kept set of every `every`-th recorded position stored as a packed bitmask."""
    from pgdiag.data.kept import KEPT_BITMASK, KEPT_BITMASK_POSITIONS, pack_bitmask

    ids_col, off_col, pos_col, bits_col = [], [], [], []
    columns = (frame["sampling_kept_ids"].to_list(), frame["sampling_kept_offsets"].to_list())
    for ids, offsets in zip(*columns, strict=True):
        new_ids, new_offsets, positions, bits = [], [0], [], []
        for pos in range(len(offsets) - 1):
            kept = ids[offsets[pos] : offsets[pos + 1]]
            if kept and pos % every == 0:
                positions.append(pos)
                bits.extend(pack_bitmask(kept, VOCAB).tolist())
            else:
                new_ids.extend(kept)
            new_offsets.append(len(new_ids))
        ids_col.append(new_ids)
        off_col.append(new_offsets)
        pos_col.append(positions)
        bits_col.append(bits)
    return frame.drop("sampling_kept_logprobs").with_columns(
        pl.Series("sampling_kept_ids", ids_col, dtype=pl.List(pl.Int32)),
        pl.Series("sampling_kept_offsets", off_col, dtype=pl.List(pl.Int32)),
        pl.Series(KEPT_BITMASK_POSITIONS, pos_col, dtype=pl.List(pl.Int32)),
        pl.Series(KEPT_BITMASK, bits_col, dtype=pl.List(pl.UInt8)),
    )


def test_bitmask_positions_score_as_their_ids(setup: dict, tmp_path: Path) -> None:
    """A third of the recorded sets stored as bitmasks (read by the LM head as bits, never expanded): the
    recorded recompute equals the rollout log-probs as with ids."""
    frame = _as_bitmasks(setup["frame"].drop("full_tempered", "full_raw"))
    run = tmp_path / "run"
    pgdiag.write_run(frame, run, sampling=SAMPLING)
    _recompute({**setup, "run": run}, "rc_bits", "recorded")
    got = _loss_values(_stream(run, "rc_bits"), "logprobs")
    rollout = _loss_values(setup["frame"].sort("sample_id"), "rollout_logprobs")
    assert np.abs(got - rollout).max() <= 1e-5
