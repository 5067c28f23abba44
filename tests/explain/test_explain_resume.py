"""Resume of an interrupted `pgdiag explain`: the token run is kept when it holds the same samples, a complete
configuration (recompute tag) is reused and never recomputed, an interrupted one continues from its finished
parts (`pgdiag logprobs` resume), and anything else is E502."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from explain_factory import make_checkpoint, sample_rows, score, write_plant

from pgdiag.errors import UsageError
from pgdiag.explain.api import explain_run
from pgdiag.explain.settings import ExplainSettings


def _stamps(directory: Path) -> dict[str, tuple[int, int]]:
    """{part path: (inode, mtime ns)} of a tag's part files."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("part-*.parquet"))
    }


def test_an_interrupted_explain_resumes_without_recomputing_finished_tags(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    rows = sample_rows(checkpoint)
    run = write_plant(tmp_path / "run", rows, score(checkpoint, rows, dtype="bf16"), score(checkpoint, rows))
    settings = ExplainSettings(tokens=10_000, configs=("ref", "bf16"))
    out = tmp_path / "ex"
    first = explain_run(run, checkpoint, settings, out=out)
    assert first.reused == [] and first.top_cause == "precision"
    tags = out / "tokens" / "logprobs"
    ref_parts, bf16_parts = _stamps(tags / "ex_ref"), _stamps(tags / "ex_bf16")
    assert len(bf16_parts) == 3  # one part per step

    # interrupt ex_bf16 after two of its three parts: manifest not complete, the last part gone
    manifest = tags / "ex_bf16" / "_manifest.json"
    content = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**content, "complete": False}))
    lost = sorted(bf16_parts)[-1]
    (tags / "ex_bf16" / lost).unlink()

    lines: list[str] = []
    second = explain_run(run, checkpoint, settings, out=out, progress=lines.append)
    assert second.reused == ["ex_ref"] and second.seconds["ex_ref"] == 0.0
    assert "recompute ex_ref: complete with the same settings, reused" in lines
    assert _stamps(tags / "ex_ref") == ref_parts  # not one file of the finished tag rewritten
    resumed = _stamps(tags / "ex_bf16")
    assert {k: v for k, v in resumed.items() if k != lost} == {
        k: v for k, v in bf16_parts.items() if k != lost
    }
    assert lost in resumed  # only the missing part was computed again
    assert json.loads(manifest.read_text())["complete"] is True
    assert [(c.cause, c.share) for c in second.causes] == [
        (c.cause, pytest.approx(c.share, abs=1e-12)) for c in first.causes
    ]
    assert second.to_json()["reused"] == ["ex_ref"]

    third = explain_run(run, checkpoint, settings, out=out)  # everything complete: nothing recomputed
    assert third.reused == ["ex_ref", "ex_bf16"] and _stamps(tags / "ex_ref") == ref_parts

    with pytest.raises(UsageError) as error:  # the user asked for a fresh start without --overwrite
        explain_run(run, checkpoint, ExplainSettings(tokens=10_000, configs=("ref",), resume=False), out=out)
    assert error.value.code == "E502"
    with pytest.raises(UsageError) as error:  # another budget takes other samples: not a resume
        explain_run(run, checkpoint, ExplainSettings(tokens=40, configs=("ref",)), out=out)
    assert error.value.code == "E502" and "other samples" in str(error.value)
    fresh = explain_run(run, checkpoint, settings, out=out, overwrite=True)
    assert fresh.reused == [] and _stamps(tags / "ex_ref") != ref_parts
