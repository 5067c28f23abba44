"""`--temperature auto` uses a run's per-token temperatures, or refuses them with E219; never ignores them.

Before, one null, short or NaN `temperature_tok` list made the recompute drop the per-token temperatures of the
whole run and recompute at the footer's temperature (exit 0, no warning): every refusal case here exited 0.
The values are checked against a plain-torch reference at each token's own temperature.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_logprobs import make_checkpoint, make_rows, naive_reference, read_stream, write_run
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.errors import InvalidInputError
from pgdiag.recompute.jobs import recompute_logprobs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, make_checkpoint(directory)


def per_token_reference(model: torch.nn.Module, ids: list[int], temperatures: list[float]) -> np.ndarray:
    """(T,) fp64 log-prob of each token at its own temperature (one full forward per distinct temperature)."""
    out = np.full(len(ids), np.nan)
    for temperature in set(temperatures):
        at_t, _ = naive_reference(model, ids, temperature)
        chosen = np.array(temperatures) == temperature
        out[chosen] = at_t[chosen]
    return out


def stream_values(result) -> dict[str, np.ndarray]:
    return {
        row["sample_id"]: np.array([np.nan if v is None else v for v in row["logprobs"]])
        for row in read_stream(result.path).iter_rows(named=True)
    }


def test_per_token_temperatures_are_used_token_by_token(checkpoint, tmp_path: Path) -> None:
    ckpt, hf_model = checkpoint
    rows = make_rows(seed=11, n_steps=1, groups=1, per_group=3)
    rng = np.random.default_rng(0)
    for row in rows[:2]:  # temperatures change inside a sample; prompt positions hold 0.0 (never used)
        n = len(row["input_ids"])
        row["temperature_tok"] = [
            0.0 if not m else float(rng.choice([0.5, 0.9, 1.4])) for m in row["loss_mask"]
        ]
        assert len(row["temperature_tok"]) == n
    rows[2]["temperature_tok"] = None  # a null list: the row temperature applies
    for row, temperature in zip(rows, (0.8, 0.8, 1.2), strict=True):
        row["temperature"] = temperature
    run = write_run(tmp_path / "run", rows, temperature=0.7)  # the footer's 0.7 must not be used
    result = recompute_logprobs(run, ckpt, dtype="fp32", head_dtype="fp32", device="cpu", batch_tokens=30)
    assert result.settings.temperature is None and result.settings.temperature_source == "column"
    got = stream_values(result)
    for row in rows:
        mask = np.array(row["loss_mask"])
        temperatures = row["temperature_tok"] or [row["temperature"]] * len(mask)
        expected = per_token_reference(hf_model, row["input_ids"], temperatures)
        np.testing.assert_allclose(got[row["sample_id"]][mask], expected[mask], atol=1e-4, rtol=0)
        at_footer, _ = naive_reference(hf_model, row["input_ids"], 0.7)
        assert np.abs(got[row["sample_id"]][mask] - at_footer[mask]).max() > 0.05  # the footer's T differs
    # an explicit --temperature wins over the columns
    forced = recompute_logprobs(run, ckpt, dtype="fp32", device="cpu", tag="forced", temperature=1.0)
    assert forced.settings.temperature == 1.0 and forced.settings.temperature_source == "option"
    lp, _ = naive_reference(hf_model, rows[0]["input_ids"], 1.0)
    mask = np.array(rows[0]["loss_mask"])
    np.testing.assert_allclose(stream_values(forced)[rows[0]["sample_id"]][mask], lp[mask], atol=1e-4, rtol=0)


def _damage(rows: list[dict], case: str) -> str:
    """Make `case` in rows[1] (rows[0] and rows[2] keep valid lists); returns the message expected."""
    target = rows[1]
    n = len(target["input_ids"])
    loss = [t for t, m in enumerate(target["loss_mask"]) if m]
    if case == "null_list_no_row_temperature":
        target["temperature_tok"] = None
        return "no temperature_tok list and no temperature, while other samples have one (1 such samples)"
    if case == "short_list":
        target["temperature_tok"] = [0.9] * (n - 1)
        return f"temperature_tok has {n - 1} values for {n} tokens"
    if case == "long_list":
        target["temperature_tok"] = [0.9] * (n + 2)
        return f"temperature_tok has {n + 2} values for {n} tokens"
    value = {"nan_value": float("nan"), "zero_value": 0.0, "negative_value": -0.5, "null_value": None}[case]
    target["temperature_tok"][loss[1]] = value
    shown = {"nan_value": "nan", "zero_value": "0", "negative_value": "-0.5", "null_value": "null"}[case]
    return f"temperature_tok pos {loss[1]}: temperature {shown} on a loss position is not a number > 0"


@pytest.mark.parametrize(
    "case",
    [
        "null_list_no_row_temperature",
        "short_list",
        "long_list",
        "nan_value",
        "zero_value",
        "negative_value",
        "null_value",
    ],
)
def test_unusable_temperature_tok_is_e219_naming_file_step_sample_column(
    case: str, checkpoint, tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    rows = make_rows(seed=12, n_steps=1, groups=1, per_group=3)
    for row in rows:
        row["temperature_tok"] = [0.9] * len(row["input_ids"])
    expected = _damage(rows, case)
    run = write_run(tmp_path / "run", rows, temperature=0.7)
    result = CliRunner().invoke(build_app(), ["logprobs", str(run), "--model", str(ckpt), "--device", "cpu"])
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    file = run / "rollouts" / "part-00000.parquet"
    assert lines[0].startswith(f"error[E219] {file}, step 0, sample {rows[1]['sample_id']}"), result.output
    assert expected in lines[0], result.output
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "--temperature T" in lines[1]
    assert not (run / "logprobs").exists()
    # a row temperature fills a null list; an explicit --temperature needs no column at all
    if case == "null_list_no_row_temperature":
        rows[1]["temperature"] = 0.9
        filled = recompute_logprobs(write_run(tmp_path / "filled", rows), ckpt, device="cpu")
        assert (
            filled.settings.temperature == pytest.approx(0.9)
            and filled.settings.temperature_source == "column"
        )
    forced = recompute_logprobs(run, ckpt, temperature=1.0, device="cpu")
    assert forced.settings.temperature_source == "option"


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_row_temperature_and_sampling_metadata_must_be_positive(
    value: float, checkpoint, tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    rows = make_rows(seed=13, n_steps=1, groups=1, per_group=2)
    sampled = write_run(tmp_path / "sampled", rows, temperature=value)
    with pytest.raises(InvalidInputError) as error:
        recompute_logprobs(sampled, ckpt, device="cpu")
    assert error.value.code == "E219" and "pgdiag.sampling.temperature" in error.value.message
    assert not (sampled / "logprobs").exists()  # was: the manifest written, then E503 from the kernel
    for row in rows:
        row["temperature"] = value
    column = write_run(tmp_path / "column", rows, temperature=None)
    with pytest.raises(InvalidInputError) as error:
        recompute_logprobs(column, ckpt, device="cpu")
    if value != value:  # a NaN column is non-finite data, found by the reader's rules before the recompute's
        assert error.value.code == "E207" and "temperature" in error.value.message, error.value.message
    else:
        assert (
            error.value.code == "E219"
            and f"sample {rows[0]['sample_id']}, temperature pos" in error.value.message
        )
    assert not (column / "logprobs").exists()
