"""`explain --layers A B`: cumulative and local error per block, the first divergent layer found by the local
error, on a tiny checkpoint with a perturbation planted in one block of one configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from explain_factory import make_checkpoint, perturbed_checkpoint, sample_rows, score, write_plant
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.errors import UsageError
from pgdiag.explain.layers import compare_layers
from pgdiag.explain.settings import ExplainSettings


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("layers")
    checkpoint = make_checkpoint(root / "ckpt", layers=6)
    planted = perturbed_checkpoint(checkpoint, root / "planted", 0.5, only="layers.3.mlp")
    rows = sample_rows(checkpoint, steps=2, per_step=4)
    lp = score(checkpoint, rows)
    return checkpoint, planted, write_plant(root / "run", rows, lp, lp)


def test_a_perturbation_in_one_block_is_found_there_by_the_local_error(setup) -> None:
    checkpoint, planted, run = setup
    found = compare_layers(run, checkpoint, "bf16", f"bf16@{planted}", ExplainSettings(tokens=1000))
    assert found.first_divergent == 3
    local = {r.layer: r.local for r in found.rows}
    cumulative = {r.layer: r.cumulative for r in found.rows}
    assert local[3] > 1e-3 and all(local[i] == 0.0 for i in (-1, 0, 1, 2, 4, 5))  # same dtype: bit-identical
    assert cumulative[2] == 0.0 and cumulative[3] == pytest.approx(local[3])
    assert cumulative[5] > 0.0  # the error carries on through the later blocks: cumulative cannot locate it


def test_precision_and_one_planted_block(setup) -> None:
    checkpoint, planted, run = setup
    found = compare_layers(run, checkpoint, "ref", f"bf16@{planted}", ExplainSettings(tokens=1000))
    assert found.first_divergent == 3
    local = [r.local for r in found.rows if r.layer >= 0]
    assert min(local) > 0.0  # bf16 rounding in every block
    plain = compare_layers(run, checkpoint, "ref", "bf16", ExplainSettings(tokens=1000))
    assert plain.first_divergent is None  # precision alone is spread evenly
    cumulative = [r.cumulative for r in plain.rows if r.layer >= 0]
    assert cumulative[-1] >= cumulative[0]


def test_unknown_configuration_is_refused(setup) -> None:
    checkpoint, _, run = setup
    with pytest.raises(UsageError) as error:
        compare_layers(run, checkpoint, "ref", "int8", ExplainSettings(tokens=100))
    assert error.value.code == "E503"


def test_cli_layers_json_and_page(setup, tmp_path: Path) -> None:
    checkpoint, planted, run = setup
    page = tmp_path / "layers.html"
    result = CliRunner().invoke(
        build_app(),
        ["explain", str(run), "--model", str(checkpoint), "--layers", "ref", f"ref@{planted}", "--tokens", "200",
         "--json", "--html", str(page), "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["layers"]["first_divergent"] == 3
    assert "DIVERGES first at layer 3" in payload["verdict"]["line"]
    text = page.read_text()
    assert "First divergent layer" in text and "<img " in text
    assert (tmp_path / "out" / "explain.parquet").exists()
