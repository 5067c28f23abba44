"""The pre-flight memory guard (`pgdiag.data.memory`): E518 before a piece is read when its columns cannot fit.

The memory left comes from fake ``/proc/meminfo`` and cgroup files (or a fixed value), so a tiny run can stand
for a step too large for the machine; the size estimate is checked against the Parquet footers by hand.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rollout_factory import default_footer, rollouts_frame, valid_rows
from sample_paths import SAMPLE_DATA

from pgdiag.cli.app import build_app
from pgdiag.data import memory
from pgdiag.data.load import load_rows
from pgdiag.data.memory import MemoryLimits, available_memory, check_piece_memory, piece_bytes
from pgdiag.data.runs import read_run, restrict_steps
from pgdiag.data.schema import REQUIRED_COLUMNS, encode_footer
from pgdiag.errors import UsageError

RUN_A = SAMPLE_DATA / "run_a"
READ = {"input_ids", "loss_mask", "old_logprobs"}


def _limits(tmp_path: Path, meminfo_kb: int | None, cgroup: tuple[str, str] | None) -> MemoryLimits:
    meminfo, group = tmp_path / "meminfo", tmp_path / "cgroup"
    group.mkdir()
    if meminfo_kb is not None:
        meminfo.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kb} kB\nCached: 1 kB\n")
    if cgroup is not None:
        (group / "memory.max").write_text(cgroup[0] + "\n")
        (group / "memory.current").write_text(cgroup[1] + "\n")
    return MemoryLimits(meminfo=meminfo, cgroup=group)


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup_room(tmp_path: Path) -> None:
    cases = [
        (2048, None, 2048 * 1024),  # meminfo only
        (2048, ("max", "500"), 2048 * 1024),  # no cgroup limit set
        (2048, ("100000", "40000"), 60000),  # the cgroup leaves less
        (None, ("100000", "40000"), 60000),  # no /proc
        (1, ("100000", "40000"), 1024),
        (None, ("1000", "5000"), 0),  # over its limit already
        (None, None, None),  # nothing says: no guard
    ]
    for k, (kb, group, expected) in enumerate(cases):
        case = tmp_path / str(k)
        case.mkdir()
        assert available_memory(_limits(case, kb, group)) == expected, (kb, group)
    assert available_memory(MemoryLimits(available_bytes=7)) == 7


def test_piece_bytes_adds_the_uncompressed_chunks_of_the_columns_and_steps_read() -> None:
    run = read_run(RUN_A)
    whole = piece_bytes(run.paths, READ, None)
    by_hand = {}
    for path in run.paths:
        meta = pq.ParquetFile(path).metadata
        by_hand[path] = sum(
            meta.row_group(g).column(c).total_uncompressed_size
            for g in range(meta.num_row_groups)
            for c in range(meta.num_columns)
            if meta.schema.column(c).path.split(".")[0] in READ
        )
    assert whole == by_hand and all(v > 0 for v in whole.values())
    step_1 = piece_bytes(run.paths, READ, [1])
    assert list(step_1) == [RUN_A / "rollouts" / "step=1" / "part-00000.parquet"]  # by its folder
    assert sum(step_1.values()) == by_hand[next(iter(step_1))]
    assert piece_bytes(run.paths, READ, [99]) == {}


def test_piece_bytes_of_one_file_uses_the_step_statistics_of_its_row_groups(tmp_path: Path) -> None:
    rows = [dict(r, step=s, sample_id=f"{s}-{r['sample_id']}") for s in (0, 1, 2) for r in valid_rows()]
    table = rollouts_frame(rows).to_arrow().replace_schema_metadata(encode_footer(default_footer()))
    per_step = len(valid_rows())
    path = tmp_path / "run.parquet"
    pq.write_table(table, path, row_group_size=per_step)  # one row group per step
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 3
    sizes = [
        sum(
            meta.row_group(g).column(c).total_uncompressed_size
            for c in range(meta.num_columns)
            if meta.schema.column(c).path.split(".")[0] in READ
        )
        for g in range(3)
    ]
    assert piece_bytes([path], READ, [1]) == {path: sizes[1]}
    assert piece_bytes([path], READ, [0, 2]) == {path: sizes[0] + sizes[2]}
    assert piece_bytes([path], READ, None) == {path: sum(sizes)}


def test_a_piece_larger_than_the_memory_left_is_e518_before_the_read(tmp_path: Path) -> None:
    run = read_run(RUN_A)
    step_1 = restrict_steps(run, [1])
    required = {*REQUIRED_COLUMNS, "segment_idx"}  # what every read takes (here: no stream)
    needed = sum(piece_bytes(run.paths, required, [1]).values())
    # a fake cgroup with just less room than the step's columns: refused, naming the file, step and sizes
    limits = _limits(tmp_path, None, (str(10**9), str(10**9 - needed + 1)))
    with pytest.raises(UsageError) as refused:
        load_rows(step_1, streams=[], memory=limits)
    assert refused.value.code == "E518" and refused.value.exit_code == 2
    message = refused.value.message
    assert message.startswith(f"{RUN_A / 'rollouts' / 'step=1' / 'part-00000.parquet'}, step 1: ")
    assert f"needs at least {needed:,} bytes" in message and f"only {needed - 1:,} bytes" in message
    assert "a step too large for this machine" in refused.value.hint
    # as much room as the columns need: read
    roomy = MemoryLimits(available_bytes=sum(piece_bytes(run.paths, _all_read(step_1), [1]).values()))
    assert load_rows(step_1, streams=["old"], memory=roomy).table.n_rows > 0
    with pytest.raises(UsageError, match=r"run_a \(4 files\), the whole run"):
        check_piece_memory("run_a", run.paths, READ, None, MemoryLimits(available_bytes=0))


def _all_read(run) -> set[str]:
    return set(run.lazy.collect_schema().names())


@pytest.mark.parametrize("command", ["check", "metrics", "compare"])
def test_every_reader_refuses_with_one_e518_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    from typer.testing import CliRunner

    monkeypatch.setattr(memory, "available_memory", lambda limits=None: 1000)
    args = {
        "check": ["check", str(RUN_A)],
        "metrics": ["metrics", str(RUN_A), "--out", str(tmp_path / "out")],
        "compare": ["compare", str(RUN_A), str(SAMPLE_DATA / "run_b"), "--out", str(tmp_path / "out")],
    }[command]
    result = CliRunner().invoke(build_app(), args, env={"COLUMNS": "1000"})
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("error[E518] ") and "run_a" in lines[0] and "only 1,000 bytes" in lines[0]
    assert lines[1].startswith("hint: a step too large for this machine")
    assert not (tmp_path / "out").exists()
