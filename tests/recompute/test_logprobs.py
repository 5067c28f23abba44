"""`recompute_logprobs` and `pgdiag logprobs` against a naive full-logits reference on a tiny random Qwen3.

The reference runs Hugging Face transformers (eager attention) on one sample at a time, takes fp64
``log_softmax(logits / T)`` and reads position ``t - 1`` for token ``t``: an off-by-one shift, attention across
packed samples or a wrong temperature all show up as differences far above the 1e-4 tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
import typer
from hf_tiny import save_scaled_qwen3
from rollout_factory import write_rollouts_file
from typer.testing import CliRunner

from pgdiag.cli.app import register_commands
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.recompute.forward import ProgressUpdate
from pgdiag.recompute.jobs import recompute_logprobs

VOCAB = 97  # odd, so a TP split is uneven
TEMPERATURE = 0.7


def make_checkpoint(directory: Path) -> torch.nn.Module:
    """A tiny random Qwen3 (GQA, qk-norm, head_dim != hidden/heads) saved as safetensors; returns the HF model.
    Its head is scaled by 20: entropies well below log(V), as a trained LM has."""
    return save_scaled_qwen3(directory, seed=0, head_scale=20.0, vocab_size=VOCAB)


def make_rows(
    seed: int = 0, n_steps: int = 2, groups: int = 2, per_group: int = 3, vocab: int = VOCAB
) -> list[dict]:
    """Samples with prompts, masked tool spans in the middle, one sample without loss tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(n_steps):
        for g in range(groups):
            for k in range(per_group):
                n = int(rng.integers(6, 25))
                prompt_len = int(rng.integers(2, 5))
                mask = [t >= prompt_len for t in range(n)]
                if n > 12:  # a tool observation inside the response
                    for t in range(prompt_len + 3, prompt_len + 6):
                        mask[t] = False
                if step == 1 and g == 1 and k == 2:
                    mask = [False] * n
                rows.append(
                    {
                        "step": step,
                        "sample_id": f"{step}:{g}:{k}",
                        "group_id": f"g{step}{g}",
                        "input_ids": rng.integers(0, vocab, size=n).tolist(),
                        "prompt_len": prompt_len,
                        "loss_mask": mask,
                        "rollout_logprobs": [-0.5 if m else None for m in mask],
                    }
                )
    return rows


def write_run(directory: Path, rows: list[dict], temperature: float | None = TEMPERATURE) -> Path:
    sampling = None if temperature is None else {"temperature": temperature}
    raw_types = {"temperature": pl.Float32} if any("temperature" in r for r in rows) else None
    write_rollouts_file(
        directory / "rollouts" / "part-00000.parquet", rows, raw_types=raw_types, sampling=sampling
    )
    return directory


def naive_reference(
    model: torch.nn.Module, ids: list[int], temperature: float, softmax_vocab: int = VOCAB
) -> tuple[np.ndarray, np.ndarray]:
    """(T,) log-prob and entropy of each token t given tokens < t (NaN at t = 0), fp64, one sample alone."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :, :softmax_vocab].double() / temperature  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    lp, ent = np.full(len(ids), np.nan), np.full(len(ids), np.nan)
    for t in range(1, len(ids)):
        lp[t] = float(logp[t - 1, ids[t]])
        ent[t] = float(-(logp[t - 1].exp() * logp[t - 1]).sum())
    return lp, ent


def cli_app() -> typer.Typer:
    """A Typer app with only `logprobs`/`recompute` registered, as the lead's app registers them."""
    app = typer.Typer(pretty_exceptions_show_locals=False)

    @app.callback()
    def _root() -> None:
        """pgdiag"""

    register_commands(app, ("logprobs", "recompute"))
    return app


def read_stream(directory: Path) -> pl.DataFrame:
    parts = sorted(directory.glob("step=*/part-*.parquet"))
    return pl.concat([pl.read_parquet(p) for p in parts]).sort(["step", "sample_id"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, make_checkpoint(directory)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", make_rows())


def test_matches_naive_reference_at_loss_positions_and_null_elsewhere(checkpoint, run_dir: Path) -> None:
    ckpt, hf_model = checkpoint
    # small budgets: several packed batches and several parts per step
    result = recompute_logprobs(
        run_dir, ckpt, dtype="fp32", head_dtype="fp32", batch_tokens=40, part_samples=4, device="cpu"
    )
    assert result.tag == "rc_fp32_fp32"
    assert result.path == run_dir / "logprobs" / "rc_fp32_fp32"
    assert result.settings.temperature == TEMPERATURE and result.settings.temperature_source == "sampling"
    assert result.settings.impl == "torch"
    rows = {r["sample_id"]: r for r in make_rows()}
    assert result.n_samples == len(rows)
    assert result.n_loss_tokens == sum(sum(r["loss_mask"]) for r in rows.values())
    assert result.parts_computed == 4 and result.parts_skipped == 0  # 6 samples a step, 4 a part
    out = read_stream(result.path)
    assert out.height == len(rows) and out["sample_id"].n_unique() == len(rows)
    for row in out.iter_rows(named=True):
        src = rows[row["sample_id"]]
        lp_ref, ent_ref = naive_reference(hf_model, src["input_ids"], TEMPERATURE)
        mask = np.array(src["loss_mask"])
        lp = np.array([np.nan if v is None else v for v in row["logprobs"]])
        ent = np.array([np.nan if v is None else v for v in row["entropy"]])
        assert len(lp) == len(mask)
        assert np.array_equal(~np.isnan(lp), mask) and np.array_equal(~np.isnan(ent), mask)
        np.testing.assert_allclose(lp[mask], lp_ref[mask], atol=1e-4, rtol=0)
        np.testing.assert_allclose(ent[mask], ent_ref[mask], atol=1e-4, rtol=0)
    # the values are not degenerate (all equal, or uniform over the vocabulary)
    all_lp = np.concatenate([np.array(v, dtype=float) for v in out["logprobs"].list.drop_nulls()])
    all_ent = np.concatenate([np.array(v, dtype=float) for v in out["entropy"].list.drop_nulls()])
    assert all_lp.max() < 0.0 and all_lp.std() > 0.5 and all_ent.mean() < np.log(VOCAB) - 1.0


def test_packed_equals_one_sample_per_forward(checkpoint, tmp_path: Path) -> None:
    ckpt, _ = checkpoint
    run = write_run(tmp_path / "run", make_rows(seed=3))
    alone = recompute_logprobs(run, ckpt, dtype="fp32", tag="alone", batch_tokens=1, device="cpu")
    packed = recompute_logprobs(run, ckpt, dtype="fp32", tag="packed", batch_tokens=4096, device="cpu")
    micro = recompute_logprobs(run, ckpt, dtype="fp32", tag="micro", micro_batch=2, device="cpu")
    assert (packed.settings.micro_batch, micro.settings.micro_batch) == (None, 2)
    a = read_stream(alone.path)
    for other in (packed, micro):
        b = read_stream(other.path)
        assert a["sample_id"].to_list() == b["sample_id"].to_list()
        for col in ("logprobs", "entropy"):
            x = np.array(a[col].explode().fill_null(np.nan).to_list(), dtype=float)
            y = np.array(b[col].explode().fill_null(np.nan).to_list(), dtype=float)
            assert np.array_equal(np.isnan(x), np.isnan(y))
            np.testing.assert_allclose(x[~np.isnan(x)], y[~np.isnan(y)], atol=1e-5, rtol=0)


def test_temperature_option_and_column(checkpoint, tmp_path: Path) -> None:
    ckpt, hf_model = checkpoint
    rows = make_rows(seed=5, n_steps=1, groups=1, per_group=2)
    rows[0]["temperature"], rows[1]["temperature"] = 0.5, 1.3
    run = write_run(tmp_path / "run", rows, temperature=None)
    result = recompute_logprobs(run, ckpt, dtype="fp32", device="cpu")
    assert result.settings.temperature is None and result.settings.temperature_source == "column"
    out = read_stream(result.path)
    for row, temp in zip(out.iter_rows(named=True), (0.5, 1.3), strict=True):
        src = next(r for r in rows if r["sample_id"] == row["sample_id"])
        lp_ref, _ = naive_reference(hf_model, src["input_ids"], temp)
        mask = np.array(src["loss_mask"])
        lp = np.array([np.nan if v is None else v for v in row["logprobs"]])
        np.testing.assert_allclose(lp[mask], lp_ref[mask], atol=1e-4, rtol=0)
    plain = write_run(
        tmp_path / "plain", make_rows(seed=5, n_steps=1, groups=1, per_group=1), temperature=None
    )
    default = recompute_logprobs(plain, ckpt, dtype="fp32", device="cpu")
    assert default.settings.temperature == 1.0 and default.settings.temperature_source == "default"
    assert [w[:4] for w in default.warnings] == ["W409"]
    forced = recompute_logprobs(plain, ckpt, dtype="fp32", tag="forced", temperature=2.0, device="cpu")
    assert forced.settings.temperature == 2.0 and forced.settings.temperature_source == "option"


def test_softmax_vocab_restricts_the_head(checkpoint, tmp_path: Path) -> None:
    ckpt, hf_model = checkpoint
    rows = make_rows(seed=9, n_steps=1, groups=1, per_group=2, vocab=80)
    run = write_run(tmp_path / "run", rows)
    result = recompute_logprobs(run, ckpt, dtype="fp32", softmax_vocab=80, device="cpu")
    assert result.settings.softmax_vocab == 80
    for row in read_stream(result.path).iter_rows(named=True):
        src = next(r for r in rows if r["sample_id"] == row["sample_id"])
        lp_ref, ent_ref = naive_reference(hf_model, src["input_ids"], TEMPERATURE, softmax_vocab=80)
        mask = np.array(src["loss_mask"])
        lp = np.array([np.nan if v is None else v for v in row["logprobs"]])
        ent = np.array([np.nan if v is None else v for v in row["entropy"]])
        np.testing.assert_allclose(lp[mask], lp_ref[mask], atol=1e-4, rtol=0)
        np.testing.assert_allclose(ent[mask], ent_ref[mask], atol=1e-4, rtol=0)
    with pytest.raises(InvalidInputError) as error:  # a token id >= 40 exists in these rows
        recompute_logprobs(run, ckpt, dtype="fp32", softmax_vocab=40, tag="small", device="cpu")
    assert error.value.code == "E208" and "vocab_size 40" in error.value.message
    with pytest.raises(UsageError) as no_tokenizer:
        recompute_logprobs(run, ckpt, softmax_vocab="tokenizer", tag="tok", device="cpu")
    assert no_tokenizer.value.code == "E506"  # the run records no tokenizer length


class StopAfter:
    """A progress callback that raises once `parts` parts are done: an interrupted job."""

    def __init__(self, parts: int) -> None:
        self.parts = parts

    def __call__(self, update: ProgressUpdate) -> None:
        if update.parts_done >= self.parts:
            raise KeyboardInterrupt


def test_resume_after_interruption_loses_and_duplicates_nothing(checkpoint, tmp_path: Path) -> None:
    ckpt, _ = checkpoint
    run = write_run(tmp_path / "run", make_rows(seed=7, n_steps=2, groups=3, per_group=3))
    options = {"dtype": "fp32", "part_samples": 2, "batch_tokens": 50, "device": "cpu"}
    with pytest.raises(KeyboardInterrupt):
        recompute_logprobs(run, ckpt, progress=StopAfter(3), **options)
    out_dir = run / "logprobs" / "rc_fp32_fp32"
    assert len(list(out_dir.glob("step=*/part-*.parquet"))) == 3
    assert not list(out_dir.rglob(".*tmp*"))
    with pytest.raises(UsageError) as incomplete:  # readers refuse the incomplete stream
        from pgdiag.data.runs import read_run

        read_run(run).collect(["rc_fp32_fp32_logprobs"])
    assert incomplete.value.code == "E504"
    resumed = recompute_logprobs(run, ckpt, **options)
    assert (resumed.parts_skipped, resumed.parts_computed) == (3, 7)  # 9 samples a step -> 5 parts a step
    fresh = recompute_logprobs(run, ckpt, tag="fresh", **options)
    a, b = read_stream(resumed.path), read_stream(fresh.path)
    assert a.height == 18 and a["sample_id"].n_unique() == 18
    assert a.select("sample_id", "logprobs", "entropy").equals(b.select("sample_id", "logprobs", "entropy"))


def test_existing_output_needs_overwrite_and_same_settings(checkpoint, run_dir: Path) -> None:
    ckpt, _ = checkpoint
    first = recompute_logprobs(run_dir, ckpt, dtype="fp32", tag="rc", device="cpu")
    with pytest.raises(UsageError) as complete:
        recompute_logprobs(run_dir, ckpt, dtype="fp32", tag="rc", device="cpu")
    assert complete.value.code == "E502" and "--overwrite" in complete.value.hint
    with pytest.raises(UsageError) as changed:
        recompute_logprobs(run_dir, ckpt, dtype="fp32", head_dtype="bf16", tag="rc", device="cpu")
    assert changed.value.code == "E502" and "head_dtype" in changed.value.message
    again = recompute_logprobs(
        run_dir, ckpt, dtype="fp32", head_dtype="bf16", tag="rc", overwrite=True, device="cpu"
    )
    assert again.settings.head_dtype == "bf16" and again.path == first.path
    lp_bf16 = np.array(read_stream(again.path)["logprobs"].explode().drop_nulls().to_list())
    assert lp_bf16.size == first.n_loss_tokens


def test_token_id_outside_vocabulary_is_e208_before_any_weight_is_read(checkpoint, tmp_path: Path) -> None:
    ckpt, _ = checkpoint
    config_only = tmp_path / "config_only"  # no weights: the input check must not need them
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only / "config.json")
    rows = make_rows(seed=1, n_steps=1, groups=1, per_group=2)
    rows[1]["input_ids"][3] = VOCAB + 5
    run = write_run(tmp_path / "run", rows)
    with pytest.raises(InvalidInputError) as error:
        recompute_logprobs(run, config_only, device="cpu")
    assert error.value.code == "E208"
    assert f"sample {rows[1]['sample_id']}" in error.value.message and "pos 3" in error.value.message
    assert f"token {VOCAB + 5}" in error.value.message and "\n" not in error.value.message
    assert not (run / "logprobs").exists()
    # valid rollouts, refused checkpoint (no weights): the error leaves no output behind
    good = write_run(tmp_path / "good", make_rows(seed=1, n_steps=1, groups=1, per_group=2))
    with pytest.raises(UsageError) as refused:
        recompute_logprobs(good, config_only, device="cpu")
    assert refused.value.code == "E604" and not (good / "logprobs").exists()


@pytest.mark.parametrize("defect", ["E201", "E203", "E213", "E102"])
def test_bad_rollouts_are_one_line_input_errors(defect: str, checkpoint, tmp_path: Path) -> None:
    ckpt, _ = checkpoint
    rows = make_rows(seed=4, n_steps=1, groups=1, per_group=3)
    if defect == "E201":
        rows[2]["loss_mask"] = rows[2]["loss_mask"][:-1]
    elif defect == "E203":
        rows[2]["loss_mask"][0] = True
    elif defect == "E213":
        rows[2]["input_ids"][1] = None
        rows[2]["seq_hash"] = 12345  # the factory cannot hash ids with a null
    run = write_run(tmp_path / "run", rows)
    if defect == "E102":
        path = run / "rollouts" / "part-00000.parquet"
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(["group_id"]).replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(InvalidInputError) as error:
        recompute_logprobs(run, ckpt, device="cpu")
    assert error.value.code == defect and error.value.exit_code == 3 and "\n" not in error.value.message
    if defect != "E102":
        assert f"sample {rows[2]['sample_id']}" in error.value.message
    assert not (run / "logprobs").exists()


def test_bad_options_are_usage_errors(checkpoint, run_dir: Path) -> None:
    ckpt, _ = checkpoint
    for kwargs in (
        {"tag": "Rollout"},
        {"tag": "old"},
        {"dtype": "fp8"},
        {"head_dtype": "fp16"},  # an fp16 body is accepted (the explain matrix), an fp16 head is not
        {"batch_tokens": 0},
        {"temperature": -1.0},
    ):
        with pytest.raises(UsageError) as error:
            recompute_logprobs(run_dir, ckpt, device="cpu", **kwargs)
        assert error.value.code == "E503"


def test_metrics_reads_the_recomputed_stream(checkpoint, run_dir: Path) -> None:
    ckpt, _ = checkpoint
    result = recompute_logprobs(run_dir, ckpt, dtype="fp32", device="cpu")
    from pgdiag.data.runs import read_run

    frame = read_run(run_dir).collect(
        ["sample_id", "loss_mask", "rc_fp32_fp32_logprobs", "rc_fp32_fp32_entropy"]
    )
    assert frame.height == result.n_samples
    for row in frame.iter_rows(named=True):
        lp = row["rc_fp32_fp32_logprobs"]
        assert [v is not None for v in lp] == row["loss_mask"]
        assert all(v <= 0.0 for v in lp if v is not None)


def test_cli_exit_codes_and_json(checkpoint, tmp_path: Path) -> None:
    ckpt, _ = checkpoint
    runner = CliRunner()
    app = cli_app()
    run = write_run(tmp_path / "run", make_rows(seed=2, n_steps=1))
    ok = runner.invoke(
        app, ["logprobs", str(run), "--model", str(ckpt), "--dtype", "fp32", "--device", "cpu", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    assert '"command": "logprobs"' in ok.stdout and "rc_fp32_fp32" in ok.stdout
    again = runner.invoke(
        app, ["recompute", str(run), "--model", str(ckpt), "--dtype", "fp32", "--device", "cpu"]
    )
    assert again.exit_code == 2 and "error[E502]" in again.output and "Traceback" not in again.output
    rows = make_rows(seed=2, n_steps=1)
    rows[0]["input_ids"][1] = VOCAB
    bad = write_run(tmp_path / "bad", rows)
    invalid = runner.invoke(app, ["logprobs", str(bad), "--model", str(ckpt), "--device", "cpu"])
    assert invalid.exit_code == 3 and "error[E208]" in invalid.output and "Traceback" not in invalid.output
    missing = runner.invoke(app, ["logprobs", str(tmp_path / "nope"), "--model", str(ckpt)])
    assert missing.exit_code == 2 and "error[E501]" in missing.output
