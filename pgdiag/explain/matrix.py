"""The recompute matrix of `pgdiag explain`: which configurations, what they cost, which fit, and running them.

Each configuration is one `pgdiag logprobs` recompute (`pgdiag.recompute.jobs.recompute_logprobs`: TP, MoE
routing, resume) of the token run, written under the tag ``<prefix>_<name>`` so any two can be compared
afterwards. All run at side a's fitted temperature over the full vocabulary (the frame the attribution works
in); the temperature and kept-set configurations come from the sampling grid's one forward (`explain.grid`).

| name | body | head | batches | role |
|---|---|---|---|---|
| ref | fp32 | fp32 | packed | the reference |
| bf16 | bf16 | fp32 | packed | precision; batch invariance (packed side); MoE routes recomputed |
| bf16_head | bf16 | bf16 | packed | precision of the head |
| fp16 | fp16 | fp32 | packed | precision |
| b1 | bf16 | fp32 | one sequence per forward | batch invariance |
| replay | bf16 | fp32 | packed, recorded routes | MoE runs with recorded routes: routing |
| kept | fp32 | fp32 | packed, over the recorded kept sets | runs with kept sets: side a's exact truncation |

A configuration whose weights do not fit the device (an fp32 body of a 70B model needs 282 GB) is skipped; the
fp32 reference then falls back to a bf16 body with the fp32 head (``ref`` is left out and ``bf16`` plays the
reference), and the JSON names what was skipped and why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgdiag.explain.attribution import ConfigRoles

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Config:
    """One recompute configuration of the matrix."""

    name: str
    dtype: str
    head_dtype: str
    micro_batch: int | None = None
    routing: str = "recompute"
    kept_set: str = "off"  # "recorded": scored over the run's recorded kept sets (issue 23's --kept-set)

    def tag(self, prefix: str) -> str:
        return f"{prefix}_{self.name}"


CONFIGS = (
    Config("ref", "fp32", "fp32"),
    Config("bf16", "bf16", "fp32"),
    Config("bf16_head", "bf16", "bf16"),
    Config("fp16", "fp16", "fp32"),
    Config("b1", "bf16", "fp32", micro_batch=1),
    Config("replay", "bf16", "fp32", routing="replay"),
    Config("kept", "fp32", "fp32", kept_set="recorded"),
)


def parameter_count(config: Any) -> int:
    """Parameters of a decoder from its `ModelConfig` (embedding, head, attention, MLP or experts, norms; biases
    left out)."""
    fixed, blocks = parameter_split(config)
    return fixed + sum(blocks)


def parameter_split(config: Any, *, active: bool = False) -> tuple[int, list[int]]:
    """(parameters outside the blocks: embedding, head, final norm; [parameters of each block]); `active`: an MoE
    block counts the experts one token runs (top-k of them), not all."""
    h, vocab = config.hidden_size, config.vocab_size
    attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    norms = 2 * h + (2 * config.head_dim if config.qk_norm else 0)
    moe = config.moe
    dense_mlp = 3 * h * config.intermediate_size
    if moe is None:
        mlp = [dense_mlp] * config.num_hidden_layers
    else:
        ran = moe.top_k if active else moe.num_experts
        expert = 3 * h * moe.expert_intermediate_size * ran + h * moe.num_experts
        shared = 3 * h * moe.shared_expert_intermediate_size
        mlp = [expert + shared if sparse else dense_mlp for sparse in moe.sparse_layers]
    head = 0 if config.tie_word_embeddings else vocab * h
    return vocab * h + head + h, [attention + norms + m for m in mlp]


def weight_bytes(config: Any, dtype: str, tp: int) -> int:
    """Bytes of one rank's weights in `dtype` (what the fit check compares with the device's memory)."""
    return parameter_count(config) * _BYTES[dtype] // max(tp, 1)


def grid_dtype(config: Any, memory: int) -> str:
    """The sampling grid's body dtype: fp32 when its weights fit in 80 % of `memory` on one device, else bf16."""
    return "fp32" if weight_bytes(config, "fp32", 1) <= 0.8 * memory else "bf16"


def prefix_bytes(config: Any, dtype: str, head_dtype: str, blocks: int) -> int:
    """Bytes of a model cut to its first `blocks` blocks (the embedding and the blocks in `dtype`, the head in
    `head_dtype`, read separately even when tied): what `explain --layers` weighs against the memory."""
    _, per_block = parameter_split(config)
    table = config.vocab_size * config.hidden_size
    return (table + sum(per_block[:blocks])) * _BYTES[dtype] + table * _BYTES[head_dtype]


def device_memory(device: str) -> int:
    """Bytes of memory of `device` (a CUDA device's total, else the machine's RAM)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_matrix(
    model_config: Any,
    *,
    moe_routes: bool,
    records_kept: bool = False,
    tp: int,
    memory: int,
    names: tuple[str, ...] | None,
) -> tuple[list[Config], dict[str, str]]:
    """(configurations to run, {skipped name: why}). Weights that fill more than 80 % of `memory` do not fit."""
    run: list[Config] = []
    skipped: dict[str, str] = {}
    for config in CONFIGS:
        if names is not None and config.name not in names:
            continue
        if config.routing == "replay" and not (model_config.moe and moe_routes):
            skipped[config.name] = "dense model or no recorded routes (routed_experts)"
            continue
        if config.kept_set == "recorded" and not records_kept:
            skipped[config.name] = (
                "the run records no kept sets (sampling_kept_ids/offsets): kept sets come from the grid"
            )
            continue
        need = weight_bytes(model_config, config.dtype, tp)
        if need > 0.8 * memory:
            skipped[config.name] = (
                f"{config.dtype} body needs {need / 2**30:.1f} GiB per rank of {memory / 2**30:.1f} GiB: fell back "
                "to the bf16 body with the fp32 head as the reference"
            )
            continue
        run.append(config)
    return run, skipped


def roles(configs: list[Config], prefix: str) -> ConfigRoles:
    """Which tag plays which role in the attribution (`explain.attribution.ConfigRoles`)."""
    tags = {c.name: c.tag(prefix) for c in configs}
    reference = tags.get("ref") or tags.get("bf16")
    precision = tuple(tags[n] for n in ("bf16", "bf16_head", "fp16") if n in tags and tags[n] != reference)
    return ConfigRoles(
        reference=reference,
        precision=precision,
        packed=tags.get("bf16"),
        single=tags.get("b1"),
        replay=tags.get("replay"),
        recompute_routes=tags.get("bf16") if "replay" in tags else None,
        kept=tags.get("kept") if "ref" in tags else None,
    )


@dataclass(frozen=True)
class CostModel:
    """The rates behind explain's cost line (docs/explain.md, "What the matrix costs"). `CUDA_COST` is calibrated
    on the measured matrix of docs/benchmarks.md (one H200, Qwen3-8B shape, 61,445 tokens forwarded)."""

    flops_16bit: float  # achieved FLOP/s of a bf16/fp16 body (tensor cores)
    flops_fp32: float  # achieved FLOP/s of an fp32 body (no tensor cores: ~1/15 of the 16-bit peak)
    load_bytes_per_s: float  # checkpoint read and copy to the device
    start_s: float  # per configuration: process, allocation, first batch
    compile_s: float  # once per body dtype: the first call of the recompute's fused pointwise kernels
    grid_elements_per_s: float  # sampling grid: loss tokens x temperatures x vocabulary, softmax and sort


# H100/H200 dense bf16 peak 989 TFLOP/s at 40 %; fp32 at 1/15 of the peak, at 50 %
CUDA_COST = CostModel(0.4 * 989e12, 0.5 * 989e12 / 15, 8e9, 2.0, 6.0, 1e10)
# the CPU's start-up and grid rate from benchmarks/bench_explain.py --tiny on a 2-core machine (27 s measured)
CPU_COST = CostModel(2e10, 5e10, 1e9, 2.5, 0.0, 2e6)


@dataclass(frozen=True)
class CostEstimate:
    """What the matrix will cost, printed before it runs: tokens x configurations x seconds, each configuration's
    seconds its start-up, compile and forward (`estimate_cost`)."""

    tokens: int  # loss tokens of the budget
    forwarded: int  # prompt + response tokens of the budget's samples
    configurations: int  # the matrix's configurations plus the sampling grid
    seconds_by_config: dict[str, float]  # name (and "grid") -> estimated seconds
    device: str

    @property
    def seconds(self) -> float:
        return sum(self.seconds_by_config.values())

    @property
    def seconds_per_token(self) -> float:
        """Mean seconds per loss token and configuration."""
        return self.seconds / max(self.tokens * self.configurations, 1)

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.3g}" for name, s in self.seconds_by_config.items())
        return (
            f"recompute matrix: {self.tokens} tokens x {self.configurations} configurations (with the sampling "
            f"grid) x {self.seconds_per_token * 1e6:.3g} us/token ≈ {self.seconds:.3g} s on {self.device} "
            f"(estimated, {self.forwarded} tokens forwarded, start-up and compile included: {parts} s)"
        )


def estimate_cost(
    model_config: Any,
    configs: list[Config],
    tokens: int,
    device: str,
    *,
    forwarded: int | None = None,
    tp: int = 1,
    grid_dtype: str = "fp32",
    temperatures: int = 27,
) -> CostEstimate:
    """Seconds of each configuration and of the sampling grid (docs/explain.md, "What the matrix costs"):

        start_s + bytes / load_bytes_per_s + [compile_s, the first configuration of its body dtype]
        + (2 · P_blocks · forwarded + 2 · V · H · tokens) / (rate(body dtype) · tp)

    P_blocks the blocks' parameters (MoE: those a token activates), V · H the head; the grid is one forward in
    `grid_dtype` at one rank (no compile) plus tokens · temperatures · V / grid_elements_per_s. Attention's
    quadratic FLOPs are left out (2 % at 1,000-token samples of an 8B model)."""
    rates = CUDA_COST if device.startswith("cuda") else CPU_COST
    forwarded = tokens if forwarded is None else forwarded
    _, active = parameter_split(model_config, active=True)
    head = model_config.vocab_size * model_config.hidden_size
    flops = 2.0 * sum(active) * forwarded + 2.0 * head * tokens

    def forward(dtype: str, ranks: int) -> float:
        rate = rates.flops_fp32 if dtype == "fp32" else rates.flops_16bit
        load = weight_bytes(model_config, dtype, ranks) / rates.load_bytes_per_s
        return rates.start_s + load + flops / (rate * ranks)

    seconds: dict[str, float] = {}
    compiled: set[str] = set()
    for config in configs:
        compile_s = rates.compile_s if config.dtype not in compiled else 0.0
        compiled.add(config.dtype)
        seconds[config.name] = forward(config.dtype, tp) + compile_s
    vocab_work = tokens * temperatures * model_config.vocab_size / rates.grid_elements_per_s
    seconds["grid"] = forward(grid_dtype, 1) + vocab_work
    return CostEstimate(tokens, forwarded, len(configs) + 1, seconds, device)


def run_matrix(
    token_run: Path,
    model: str | Path,
    configs: list[Config],
    *,
    prefix: str,
    temperature: float | str,  # "auto": each token at its recorded temperature
    tp: int,
    device: str | None,
    batch_tokens: int,
    resume: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Recompute every configuration on the token run; returns ({tag: seconds}, [tags reused]).

    `resume`: a tag already complete with the same model, settings and input (its manifest) is reused, not
    recomputed; an interrupted tag continues from its finished parts (`pgdiag logprobs` resume); a tag made
    with other settings is E502. Without `resume` an existing tag is E502 (the caller cleared the token run)."""
    from pgdiag.recompute.jobs import recompute_logprobs
    from pgdiag.recompute.settings import RecomputeSettings

    seconds: dict[str, float] = {}
    reused: list[str] = []
    for config in configs:
        tag = config.tag(prefix)
        settings = RecomputeSettings(
            tag=tag, dtype=config.dtype, head_dtype=config.head_dtype, temperature=temperature,
            micro_batch=config.micro_batch, routing=config.routing, batch_tokens=batch_tokens, entropy=False,
            impl="auto", resume=resume,
            kept_set=config.kept_set,  # the common frame is the full vocabulary, but for ex_kept (module docstring)
        )  # fmt: skip
        if resume and finished_tag(token_run, model, settings, tp, device):
            reused.append(tag)
            seconds[tag] = 0.0
            if progress is not None:
                progress(f"recompute {tag}: complete with the same settings, reused")
            continue
        if progress is not None:
            progress(f"recompute {tag}: body {config.dtype}, head {config.head_dtype}")
        result = recompute_logprobs(str(token_run), str(model), settings, tp=tp, device=device)
        seconds[tag] = result.seconds if result is not None else 0.0
    return seconds, reused


def finished_tag(token_run: Path, model: str | Path, settings: Any, tp: int, device: str | None) -> bool:
    """Whether the tag of `settings` is complete in `token_run` with the model, settings and input fingerprint
    this recompute would record (the fields `pgdiag logprobs` compares before resuming)."""
    import json

    from pgdiag.recompute.launch import ParallelLayout
    from pgdiag.recompute.output import MANIFEST_NAME
    from pgdiag.recompute.plan import plan_recompute

    layout = ParallelLayout(rank=0, world_size=tp, tp_rank=0, tp_size=tp, dp_rank=0, dp_size=1)
    plan = plan_recompute(str(token_run), str(model), settings, layout, device)
    path = plan.out_dir / MANIFEST_NAME
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(old, dict)
        and old.get("complete") is True
        and all(old.get(k) == plan.manifest[k] for k in ("model", "settings", "input_fingerprint"))
    )
