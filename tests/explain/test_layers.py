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


def test_layer_subset_fallback_when_both_configurations_do_not_fit(setup) -> None:
    """Memory for ref + bf16 of blocks 0-3 but not of all 6 (the memory a settings field, the model's bytes
    computed by hand): blocks 4-5 are skipped and named, blocks 0-3 equal the full comparison's exactly."""
    from pgdiag.explain.layers import fitting_blocks
    from pgdiag.model import read_model_config

    checkpoint, planted, run = setup
    config = read_model_config(checkpoint)
    # tiny Qwen3: hidden 32, 4 heads x 16 (q 64), 2 kv heads x 16 (kv 32), intermediate 64, vocab 64, q/k norm
    table = 64 * 32  # embedding rows, and the head read separately
    block = 32 * (64 + 2 * 32) + 64 * 32 + 2 * 32 + 2 * 16 + 3 * 32 * 64  # attention, norms, MLP = 16480
    ref_and_bf16 = [
        (table + k * block) * 4 + table * 4 + (table + k * block) * 2 + table * 4 for k in range(7)
    ]
    assert fitting_blocks(config, [("fp32", "fp32"), ("bf16", "fp32")], int(ref_and_bf16[6] / 0.8)) == (6, {})
    memory = int(ref_and_bf16[4] / 0.8) + 1  # 4 blocks fit, 5 do not
    blocks, skipped = fitting_blocks(config, [("fp32", "fp32"), ("bf16", "fp32")], memory)
    assert blocks == 4 and skipped["blocks"].startswith("blocks 4-5 not compared")

    settings = ExplainSettings(tokens=1000, memory_bytes=memory)
    cut = compare_layers(run, checkpoint, "ref", f"bf16@{planted}", settings)
    full = compare_layers(run, checkpoint, "ref", f"bf16@{planted}", ExplainSettings(tokens=1000))
    assert [r.layer for r in cut.rows] == [-1, 0, 1, 2, 3]
    assert cut.rows == full.rows[:5]  # a block's output depends only on the blocks before it
    assert cut.first_divergent == 3
    assert cut.to_json()["skipped"] == skipped and full.skipped == {}
    with pytest.raises(UsageError) as error:
        compare_layers(run, checkpoint, "ref", "bf16", ExplainSettings(tokens=100, memory_bytes=20_000))
    assert error.value.code == "E508"
