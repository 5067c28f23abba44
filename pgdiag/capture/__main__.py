"""``python -m pgdiag.capture fast-llm --redis URL --out DIR [--docs-per-step N]``: see docs/import.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pgdiag.errors import EXIT_INTERRUPTED, PgdiagError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pgdiag.capture", description=__doc__)
    sub = parser.add_subparsers(dest="source", required=True)
    fast = sub.add_parser(
        "fast-llm",
        help="record Fast-LLM's Redis stream fast_llm_streaming to capture_<step>.jsonl files",
        description="Read every message of Redis stream fast_llm_streaming with plain XREAD from its first "
        "entry (never joining Fast-LLM's consumer group, acknowledging or trimming, so the trainer receives "
        "every message as before) and write one JSON line per message to OUT/capture_<step>.jsonl. Start it "
        "before the trainer; stop it with Ctrl-C. Import with: pgdiag import --preset fast-llm OUT RUN.",
    )
    fast.add_argument("--redis", required=True, help="Redis URL, e.g. redis://localhost:6379/0")
    fast.add_argument("--out", required=True, type=Path, help="folder for the capture files (created)")
    fast.add_argument(
        "--docs-per-step",
        type=int,
        default=None,
        help="documents the trainer consumes per optimizer step: message k goes to capture_<first-step + k // N>"
        ".jsonl; without it every message goes to one file and `pgdiag metrics --docs-per-step` regroups later",
    )
    fast.add_argument("--first-step", type=int, default=1, help="step number of the first block (default 1)")
    fast.add_argument("--max-messages", type=int, default=None, help="stop after this many messages")
    fast.add_argument(
        "--idle-timeout", type=float, default=None, help="stop after this many seconds without a new message"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pgdiag.capture.fast_llm import CaptureSettings, capture

    settings = CaptureSettings(
        docs_per_step=args.docs_per_step,
        first_step=args.first_step,
        max_messages=args.max_messages,
        idle_timeout_s=args.idle_timeout,
    )
    try:
        result = capture(args.redis, args.out, settings, progress=lambda line: print(line, file=sys.stderr))
    except PgdiagError as err:
        print(f"error[{err.code}] {err.message}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        return err.exit_code
    print(
        f"captured {result.n_messages} messages into {len(result.complete_files)} complete files"
        + (f" and {result.partial_file.name}" if result.partial_file else ""),
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
