"""Library errors, the catalogue of error and warning codes, and the CLI exit codes they map to (docs/cli.md).

Every expected failure is a `PgdiagError` carrying a catalogue code (``E201``), a one-line message that names
the file, sample and column where it can, and an optional hint. The CLI prints ``error[CODE] message`` plus
``hint: ...`` and exits with `exit_code`; nothing else in pgdiag turns errors into exit codes.

`Code` is the one catalogue: each code has one meaning and one exit code (2 usage/IO, 3 invalid data; a
warning exits 0, or 1 under ``--strict``). docs/cli.md repeats the table for users and a test keeps the two,
and every code written anywhere in pgdiag, in sync. An error raised with a code outside the catalogue is a bug
(``ValueError``, exit 101).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

EXIT_OK = 0
EXIT_GATE = 1
EXIT_USAGE = 2
EXIT_INVALID = 3
EXIT_INTERNAL = 101
EXIT_INTERRUPTED = 130


class Code(StrEnum):
    """One error (``E``) or warning (``W``) code: its short meaning and the exit code it leads to."""

    meaning: str
    exit_code: int

    def __new__(cls, code: str, meaning: str, exit_code: int) -> Code:
        member = str.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        member.exit_code = exit_code
        return member

    # file, footer and type rules of the rollout schema
    NOT_ROLLOUTS_FILE = (
        "E101",
        "not a pgdiag rollouts file or report (not Parquet, footer schema missing, another version or kind)",
        3,
    )
    MISSING_COLUMN = ("E102", "a required column is missing", 3)
    LOSSY_CAST = ("E103", "a column cannot be cast losslessly to its schema type", 3)
    ALIGNMENT_UNSUPPORTED = ("E104", "the file's alignment is not `token`", 3)
    BAD_FOOTER_SHAPE = ("E105", "a footer entry is not JSON of the documented shape", 3)
    # usage errors found while parsing options
    BAD_GATE = ("E110", "a gate expression or profile cannot be parsed or names no known metric", 2)
    STREAM_NOT_FOUND = ("E111", "a named stream or entropy is not in the run", 2)
    UNPARSABLE_OPTION = (
        "E112",
        "an option's text cannot be parsed (--steps, --streams A,B, --shift, --map, whatif LO,HI, --losses)",
        2,
    )
    # row and token rules of the rollout schema
    LENGTH_MISMATCH = ("E201", "a per-token list and input_ids differ in length", 3)
    BAD_PROMPT_LEN = ("E202", "prompt_len outside [1, T]", 3)
    LOSS_WITHOUT_CONTEXT = ("E203", "a loss position at 0 or before prompt_len", 3)
    NULL_ON_LOSS = ("E204", "a stream is null on a loss position", 3)
    POSITIVE_LOGPROB = ("E205", "a log-prob > 1e-6", 3)
    ZERO_FILLED = ("E206", "log-probs zero-filled (exact 0.0 used for missing values)", 3)
    NON_FINITE = ("E207", "NaN or ±inf in a float column", 3)
    TOKEN_OUT_OF_VOCAB = ("E208", "a token id < 0 or >= the vocabulary size", 3)
    NO_LOSS_TOKENS = ("E209", "the selection has no loss tokens", 3)
    DUPLICATE_SAMPLE = ("E210", "duplicate (run, step, sample_id, segment_idx)", 3)
    MISSING_GROUP = ("E211", "group_id null or empty", 3)
    SEQ_HASH_MISMATCH = ("E212", "seq_hash differs from the hash of input_ids", 3)
    NULL_REQUIRED = ("E213", "a null inside input_ids or loss_mask, or a null required scalar", 3)
    EXPERT_OUT_OF_RANGE = ("E218", "a routed_experts id outside [-1, num_experts)", 3)
    BAD_TEMPERATURE = (
        "E219",
        "a temperature the recompute cannot use (temperature_tok or temperature missing, of the wrong length, "
        "or not a number > 0)",
        3,
    )
    KEPT_OFFSETS_BROKEN = (
        "E220",
        "sampling_kept_offsets not T + 1 non-decreasing offsets from 0 to len(sampling_kept_ids) "
        "(or a kept bitmask of the wrong length)",
        3,
    )
    SAMPLED_OUTSIDE_KEPT = ("E221", "a sampled token is not in its recorded kept set", 3)
    KEPT_OUT_OF_VOCAB = ("E222", "a kept token id < 0 or >= the vocabulary size", 3)
    KEPT_DUPLICATE = ("E223", "a token id twice in one kept set", 3)
    VALUE_OFF_LOSS = ("W214", "a per-token value set outside loss_mask (ignored)", 0)
    EMPTY_LOSS_MASK = ("W215", "a sample with an empty loss_mask", 0)
    ISOLATED_ZEROS = ("W216", "isolated exact 0.0 log-probs below the E206 limits, or 0 < lp <= 1e-6", 0)
    UNEQUAL_GROUPS = ("W217", "prompt groups of unequal size within a step", 0)
    # semantic checks of stream pairs and of two runs
    TOKENS_DIFFER = ("E301", "matched samples differ in tokens", 3)
    SHIFTED = ("E302", "a stream looks shifted by one position against its pair", 3)
    MASKS_DIFFER = ("E303", "loss masks differ on over 1 % of positions", 3)
    NOTHING_MATCHED = ("E304", "no sample of the two sides matched", 3)
    STALE_RECOMPUTE = ("E305", "a recompute stream was computed on other rollouts", 3)
    UNMATCHED_SAMPLES = ("E306", "samples of one side have no match on the other", 3)
    MASKS_DIFFER_SLIGHTLY = ("W303", "loss masks differ on some positions (1 % or fewer)", 0)
    ONE_SIDED_TEMPERATURE = ("W401", "one side looks tempered (temperature on one side only)", 0)
    TEMPERATURE_METADATA = ("W402", "the streams' temperature metadata disagree", 0)
    PROCESSED_LOGPROBS = ("W403", "processed (top-p/top-k renormalised) log-probs on one side", 0)
    RETOKENIZED = ("W405", "token ids were re-tokenized from text", 0)
    FIRST_TOKEN_DOMINATES = ("W406", "the first response token dominates the mismatch", 0)
    STALE_WEIGHTS = ("W407", "a step's mismatch jumps (resume or weight sync?)", 0)
    NO_OLD_STREAM = ("W408", "TRL single iteration: no old stream", 0)
    UNKNOWN_SEMANTICS = ("W409", "a stream's tempering or logprobs mode is unknown", 0)
    EXTREME_TOKENS = ("W410", "tokens with |Δ| > 20 (counted, not clamped)", 0)
    PRECISION_MISMATCH = ("W411", "the streams record different head or body dtypes", 0)
    KEPT_FORMULA_INEXACT = (
        "W412",
        "a penalty, logit bias, guided decoding, logits processor or T < 1e-5 changed the sampler's logits: "
        "the kept-set recompute is approximate",
        0,
    )
    HIDDEN_KEPT_MASS = (
        "W413",
        "truncated sampling without a recorded kept set: the kept mass is a hidden bias (size estimated)",
        0,
    )
    # inputs, outputs and settings
    INPUT_NOT_FOUND = ("E501", "an input path matched nothing", 2)
    OUTPUT_EXISTS = ("E502", "the output exists and cannot be reused (pass --overwrite)", 2)
    BAD_OPTION_VALUE = ("E503", "an option value is outside its range or not one of its choices", 2)
    INCOMPLETE_RECOMPUTE = ("E504", "a recompute dataset is incomplete", 2)
    UNFINISHED_RECOMPUTE = (
        "W504",
        "an unfinished recompute under RUN/logprobs/ is left out (resume or remove it)",
        0,
    )
    AMBIGUOUS_INPUT = ("E505", "the input holds several runs or file kinds; pick one", 2)
    MISSING_SETTING = ("E506", "a setting needs another setting or an input column that is missing", 2)
    NOT_IN_KEY_STYLE = ("E507", "a setting the chosen --key-style or --level does not have", 2)
    DEVICE_UNAVAILABLE = ("E508", "the requested device or backend is not available here", 2)
    MISSING_PACKAGE = ("E509", "an optional package needed by this option is not installed", 2)
    BAD_PARALLEL_LAUNCH = ("E510", "the parallel launch does not fit the processes started", 2)
    WRONG_PLOT_INPUT = ("E511", "the plot's input lacks the table or rows it draws", 2)
    NEEDS_RUN_ON_DISK = ("E512", "the option reads the run from disk, but in-memory batches were given", 2)
    BAD_TENSORS = ("E513", "tensor shapes, dtypes or devices of a library call do not fit together", 2)
    SETTINGS_TWICE = ("E514", "settings given twice: a settings object and keyword options", 2)
    UNREADABLE_PATH = (
        "E516",
        "a file or folder of the input cannot be read (permission, link, too long, not a folder, not a regular file)",
        2,
    )
    UNWRITABLE_PATH = (
        "E517",
        "a file or folder cannot be written or read (permission, too long, read-only, disk full)",
        2,
    )
    OUT_OF_MEMORY = ("E518", "out of memory (read fewer steps or use a larger machine)", 2)
    OUTPUT_BUSY = ("E519", "another process is writing this output now", 2)
    WORKER_DIED = (
        "E520",
        "a parallel worker died (killed by a signal, the OOM killer); the parts written are kept for a resume",
        2,
    )
    BAD_COMMAND_LINE = ("E515", "the command line cannot be parsed (unknown option, missing argument)", 2)
    OPTIONS_CONFLICT = ("E521", "an option does not fit the number of RUNs given or another option", 2)
    WRONG_FILE_KIND = ("E522", "a file an option names is not of the kind the option reads", 2)
    # imports of framework dumps
    UNSAFE_PICKLE_GLOBAL = ("E701", "a pickle needs a global outside the preset's allow-list", 2)
    TEXT_ONLY_SOURCE = ("E702", "the source holds text but no token ids (pass --retokenize --tokenizer)", 2)
    BAD_DUMP_LAYOUT = ("E703", "a dump file is torn, truncated or not in the preset's layout", 3)
    STREAM_ALL_ZEROS = ("W701", "a stream the source writes as zeros was dropped", 0)
    STREAM_COPIED = ("W702", "a stream the source writes as a copy of another was dropped", 0)
    TRAIN_FORWARD_LOGPROBS = (
        "W703",
        "the dump's old log-probs come from the training forward (kept, flagged)",
        0,
    )
    UNREAD_FLOAT_LIST = (
        "W704",
        "a per-token float column of no canonical name is kept but read as no stream (--map it)",
        0,
    )
    # checkpoints
    UNSUPPORTED_ARCHITECTURE = ("E601", "unsupported model architecture", 2)
    UNSUPPORTED_ROPE = ("E602", "unsupported RoPE configuration", 2)
    TENSORS_MISMATCH = ("E603", "checkpoint tensors do not match the config", 2)
    CHECKPOINT_FILE_MISSING = ("E604", "a checkpoint file or shard is missing", 2)
    BAD_TP_SIZE = ("E605", "the TP size does not divide heads, kv heads or intermediate_size", 2)
    BAD_MODEL_CONFIG = ("E606", "config.json lacks a needed field or has an unsupported value", 2)
    UNKNOWN_DTYPE = ("E607", "an unknown dtype name", 2)
    EMBEDDING_ROWS = ("E608", "embedding rows differ from vocab_size", 2)
    PICKLE_CHECKPOINT = ("E609", "a pickle checkpoint (.bin/.pt): convert it to safetensors", 2)
    DAMAGED_SAFETENSORS = ("E610", "a safetensors file is damaged or not safetensors", 2)
    NON_FLOAT_WEIGHTS = ("E611", "a weight is stored quantized or as integers, not as floats", 2)
    NON_FINITE_MODEL = ("E612", "the model's weights (or its forward) hold NaN or inf", 2)
    TIED_HEAD_DIFFERS = ("W606", "tied embeddings, but the file's lm_head.weight differs (embedding used)", 0)
    FP32_ROUNDED = ("W607", "fp32 weights rounded to a 16-bit body dtype", 0)


def catalogued(code: str) -> Code:
    """The catalogue entry of `code`; ValueError (a bug in pgdiag) for a code outside the catalogue."""
    try:
        return Code(code)
    except ValueError:
        raise ValueError(f"{code!r} is not a pgdiag error or warning code (see pgdiag.errors.Code)") from None


def one_line(text: str) -> str:
    """`text` with line breaks written as ``\\n`` / ``\\r``, so an id or an exception text cannot break the
    one-line rule of a message."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


class PgdiagError(Exception):
    """An expected failure: a catalogue code, a one-line message and an optional hint (line breaks inside
    either, from an id or a library's text, are escaped by `one_line`)."""

    exit_code: int = EXIT_USAGE

    def __init__(self, code: Code | str, message: str, hint: str | None = None) -> None:
        entry = catalogued(code)
        if type(self) is not PgdiagError and entry.exit_code != self.exit_code:
            raise ValueError(
                f"{entry.value} exits {entry.exit_code}, not {self.exit_code}: raise the other class"
            )
        message = one_line(message)
        super().__init__(f"{entry.value}: {message}")
        self.code = entry.value
        self.message = message
        self.hint = None if hint is None else one_line(hint)


class UsageError(PgdiagError):
    """Bad option, missing file, unsupported checkpoint, existing output (exit 2)."""

    exit_code = EXIT_USAGE


class InvalidInputError(PgdiagError):
    """Validation or alignment error in the input data (E1xx-E3xx, E703), or nothing to compare (exit 3)."""

    exit_code = EXIT_INVALID


def missing_package(feature: str, package: str, install: str) -> UsageError:
    """`UsageError` MISSING_PACKAGE (E509) for an optional package: ``<feature> needs the <package> package``
    with `install` (the pip command) as the hint; raise it from the ImportError."""
    return UsageError(Code.MISSING_PACKAGE, f"{feature} needs the {package} package", install)


def not_among(code: Code, message: str, listed: str, present: Iterable[str], then: str = "") -> UsageError:
    """`UsageError` `code` with `message` for a name that is not among `present`, and the hint
    ``<listed>: <the names present, or none><then>``."""
    return UsageError(code, message, f"{listed}: {', '.join(present) or 'none'}{then}")
