"""The ``pgdiag.rollouts`` footer of an imported step: schema, source, streams, sampling and import settings.

What: `step_footer(imported, options, preset, streams)` is the metadata written into each part
(docs/schema.md): the source (framework, version, preset, files, retokenized, unsafe load), one entry per stream
with its temper and logprobs mode (from the step's sampling settings, else the ``--sampling`` fallback), and
the import's ``--group-by`` and ``--shift``; what the preset adds (tokenizer, model) is merged last.

Why apart: `pgdiag.importers.writer` writes it into every part and builds the run's ``pgdiag.json`` from it.
"""

from __future__ import annotations

from typing import Any

from pgdiag import __version__
from pgdiag.data.schema import ROLLOUTS_SCHEMA
from pgdiag.data.writing import source_meta, stream_meta
from pgdiag.importers.base import ImportedStep, ImportOptions
from pgdiag.importers.step_rows import stream_of


def step_footer(
    imported: ImportedStep, options: ImportOptions, preset: str, streams: list[str]
) -> dict[str, Any]:
    sampling = {
        **options.sampling_fallback(),
        **{k: v for k, v in imported.sampling.items() if v is not None},
    }
    footer: dict[str, Any] = {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": f"pgdiag {__version__}",
        "source": source_meta(
            imported.framework,
            framework_version=imported.framework_version,
            preset=preset,
            src_files=imported.src_files,
            retokenized=imported.retokenized,
            unsafe_load=imported.unsafe_load,
        ),
        "streams": {
            stream_of(c): stream_meta(
                imported.stream_fields.get(c, c),
                tempered=sampling.get("tempered", "unknown"),
                logprobs_mode=sampling.get("logprobs_mode", "unknown"),
                engine=sampling.get("engine"),
            )
            for c in streams
        },
        "sampling": {k: v for k, v in sampling.items() if k != "tempered"},
        "import": {
            "group_by": options.group_by,
            "shift": [[c, k] for c, k in options.shifts],
            "ignored_codes": [],
        },
    }
    footer.update(imported.footer)
    if imported.unsafe_load:
        footer["source"] = {**footer["source"], "unsafe_load": True}
    return footer
