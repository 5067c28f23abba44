"""What a logged log-prob stream means: is the temperature applied, and is it renormalised over the kept set?

Why: inference engines sample from a truncated distribution (temperature, then min-p / top-k / top-p keep a set
K of tokens, renormalised), and what they *log* depends on the engine and its logprobs mode. Two facts decide
how pgdiag must score a token to compare it with the stream: whether T is applied (``temperature_applied``) and
whether the stream is renormalised over K (``renormalised``). Every command reads them from here: the
``--kept-set`` default of ``pgdiag logprobs``, the kept-mass warnings of ``metrics`` and ``compare``, and
explain's ``sampling_truncation`` / ``logprobs_mode`` causes. docs/schema.md ("Stream semantics") is this table.

How: `stream_semantics(engine, logprobs_mode, tempered)` looks the triple up in `SEMANTICS` (engine and mode
normalised: ``raw_logprobs`` -> ``raw``, ``processed_logprobs`` -> ``processed``), falling back to the engine's
row for an unknown mode and to the footer's ``tempered`` flag. Sources, read at these commits:

* vLLM V1 (vllm-project/vllm 3e342658, ``vllm/v1/sample/sampler.py``; 3babc05a,
  ``vllm/v1/sample/ops/topk_topp_sampler.py``): ``raw_logprobs`` (the default) is ``log_softmax`` of the logits
  before penalties, temperature and truncation; ``processed_logprobs`` is ``log_softmax`` after temperature,
  min-p, top-k and top-p, so -inf outside K and renormalised over K.
* SGLang (sgl-project/sglang 584f55d, ``python/sglang/srt/layers/sampler.py``): logprobs come from the tempered
  softmax. At 584f55d they are renormalised over the top-p set only (``top_p_normalize_probs_torch``, top-k and
  min-p not applied); later versions of the same function log the tempered full-vocabulary softmax
  (``torch.log(probs)``), and with ``RETURN_ORIGINAL_LOGPROB`` the softmax before temperature. pgdiag's
  ``sglang`` row is the later, full-vocabulary default (the issue's "SGLang default"); an import of an SGLang
  that renormalised over top-p should say ``--logprobs-mode processed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

UNKNOWN = "unknown"
KEPT_SET_MODES = ("recorded", "reconstruct", "reconstruct:vllm", "reconstruct:sglang", "off")
RECONSTRUCT_ENGINES = ("vllm", "sglang")

_MODE_ALIASES = {
    "raw_logprobs": "raw",
    "raw_logits": "raw",
    "processed_logprobs": "processed",
    "processed_logits": "processed",
    "original": "raw",
}


@dataclass(frozen=True)
class StreamSemantics:
    """The two facts of one logged stream (None where the metadata cannot tell)."""

    engine: str  # vllm | sglang | transformers | unknown
    logprobs_mode: str  # raw | processed | unknown
    temperature_applied: bool | None  # the stream is log softmax(z / T), not log softmax(z)
    renormalised: bool | None  # the stream is renormalised over the kept set K (-inf outside it)
    source: str  # where the row comes from (engine function and commit)

    @property
    def hides_kept_mass(self) -> bool:
        """A full-vocabulary stream of a truncated sampler: it agrees with the trainer, but neither is the policy
        that sampled; the kept mass is a hidden bias against the behaviour policy."""
        return self.renormalised is False


# (engine, logprobs_mode) -> (temperature_applied, renormalised, source); None: taken from the footer's `tempered`
SEMANTICS: dict[tuple[str, str], tuple[bool | None, bool | None, str]] = {
    ("vllm", "raw"): (
        False,
        False,
        "vLLM V1 Sampler.forward, raw_logprobs (the default): log_softmax before penalties, T and truncation "
        "(vllm-project/vllm 3e342658)",
    ),
    ("vllm", "processed"): (
        True,
        True,
        "vLLM V1 TopKTopPSampler.forward_native, processed_logprobs: log_softmax after T, min-p, top-k, top-p "
        "(vllm-project/vllm 3babc05a)",
    ),
    ("sglang", "raw"): (
        False,
        False,
        "SGLang Sampler.forward with RETURN_ORIGINAL_LOGPROB: softmax before temperature",
    ),
    ("sglang", UNKNOWN): (
        True,
        False,
        "SGLang Sampler.forward default: log of the tempered full-vocabulary softmax",
    ),
    ("sglang", "processed"): (
        True,
        True,
        "SGLang Sampler.forward at sgl-project/sglang 584f55d: tempered, renormalised over top-p "
        "(top_p_normalize_probs_torch)",
    ),
    ("transformers", "raw"): (None, False, "transformers generate scores before the logits warpers"),
    ("transformers", "processed"): (True, True, "transformers generate scores after the logits warpers"),
    (UNKNOWN, "raw"): (None, False, "logprobs_mode raw: full vocabulary"),
    (UNKNOWN, "processed"): (True, True, "logprobs_mode processed: renormalised over the kept set"),
    (UNKNOWN, UNKNOWN): (None, None, "nothing recorded"),
}


def normalise_mode(mode: Any) -> str:
    """``raw`` / ``processed`` / ``unknown`` from what a footer or a framework wrote (``raw_logprobs`` -> raw)."""
    if not isinstance(mode, str) or not mode:
        return UNKNOWN
    text = mode.strip().lower()
    text = _MODE_ALIASES.get(text, text)
    return text if text in ("raw", "processed") else UNKNOWN


def normalise_engine(engine: Any) -> str:
    """``vllm`` / ``sglang`` / ``transformers`` / ``unknown`` from a footer's ``engine``."""
    if not isinstance(engine, str) or not engine:
        return UNKNOWN
    text = engine.strip().lower()
    return text if text in ("vllm", "sglang", "transformers") else UNKNOWN


def _tempered_flag(tempered: Any) -> bool | None:
    return tempered if isinstance(tempered, bool) else None


def stream_semantics(engine: Any, logprobs_mode: Any, tempered: Any = UNKNOWN) -> StreamSemantics:
    """The semantics of a stream logged by `engine` in `logprobs_mode`, with the footer's `tempered` flag.

    The table row decides; where it leaves T open (None), the footer's ``tempered`` (true/false) fills it; a
    footer that says ``tempered`` against the row is kept as the row says (the engine code wins).
    """
    engine_name, mode = normalise_engine(engine), normalise_mode(logprobs_mode)
    row = SEMANTICS.get((engine_name, mode))
    if row is None and engine_name == "vllm":
        row = SEMANTICS[("vllm", "raw")]  # vLLM's default mode is raw_logprobs
    if row is None:
        row = SEMANTICS.get((UNKNOWN, mode), SEMANTICS[(UNKNOWN, UNKNOWN)])
    applied, renormalised, source = row
    if applied is None:
        applied = _tempered_flag(tempered)
    return StreamSemantics(engine_name, mode, applied, renormalised, source)


def footer_semantics(meta: Mapping[str, Any], stream: str = "rollout") -> StreamSemantics:
    """`stream_semantics` of `stream` from a decoded rollouts footer (stream entry first, then ``sampling``)."""
    streams = meta.get("streams") or {}
    info = streams.get(stream) or streams.get(f"{stream}_logprobs") or {}
    sampling = meta.get("sampling") or {}
    if not isinstance(info, Mapping):
        info = {}
    if not isinstance(sampling, Mapping):
        sampling = {}
    mode = info.get("logprobs_mode")
    if normalise_mode(mode) == UNKNOWN:
        mode = sampling.get("logprobs_mode", mode)
    engine = info.get("engine") or sampling.get("engine")
    return stream_semantics(engine, mode, info.get("tempered", UNKNOWN))


def truncation_on(sampling: Mapping[str, Any]) -> bool:
    """True when the run's sampling defaults say that top-p, top-k or min-p truncated the distribution."""
    top_p, top_k, min_p = sampling.get("top_p"), sampling.get("top_k"), sampling.get("min_p")
    return (
        (isinstance(top_p, int | float) and 0 < top_p < 1)
        or (isinstance(top_k, int | float) and top_k > 0)
        or (isinstance(min_p, int | float) and min_p > 0)
    )


def default_kept_set(semantics: StreamSemantics, *, has_kept_columns: bool) -> str:
    """The ``--kept-set`` default: ``recorded`` when the run records K and its sampling stream is renormalised
    over K, else ``off`` (the kept mass is still computed and reported as the hidden bias)."""
    return "recorded" if has_kept_columns and semantics.renormalised is True else "off"


def reconstruct_engine(mode: str, semantics: StreamSemantics) -> str:
    """The engine whose truncation order ``reconstruct`` follows: the one named (``reconstruct:sglang``), else
    the footer's engine, else vLLM's."""
    if ":" in mode:
        return mode.split(":", 1)[1]
    return semantics.engine if semantics.engine in RECONSTRUCT_ENGINES else "vllm"
