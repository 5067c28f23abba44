"""Writes areal_rejection.json: AReaL's own rejection sampling and M2PO masking run on a fixed batch.

Why: the whatif rules `areal_rs:LEVEL,ACTION,METRIC,AGG,UPPER[,LOWER]`, `kpop:U` and `m2po:τ` replay AReaL's
`apply_rejection_sampling` (`areal/utils/functional/functional.py`) and `_apply_m2po_masking`
(`areal/trainer/ppo/actor.py`) at areal-project/AReaL @ cbff54d. The test beside this script checks pgdiag's
masks and weights against AReaL's. How: AReaL is not a pgdiag dependency; both modules import on a CPU from a
source checkout once about forty light packages are on the path (the imports of its launcher, trackers and
RPC layer, none used by these functions):

    git clone https://github.com/areal-project/AReaL && cd AReaL && git checkout cbff54d
    pip install --no-deps -t /tmp/arealsite aiohttp multidict attrs yarl propcache aiohappyeyeballs \
        aiosignal frozenlist colorlog tenacity flask blinker itsdangerous torchdata lark uvloop hydra-core \
        "antlr4-python3-runtime==4.9.3" omegaconf ray msgpack jsonschema referencing rpds-py \
        jsonschema-specifications numba llvmlite orjson einops aiofiles openai jiter swanlab pyroaring \
        watchdog pydantic-settings python-dotenv pyecharts simplejson prettytable trackio gradio-client \
        uvicorn starlette tensorboardX tabulate pybase64
    PYTHONPATH=.:/tmp/arealsite python PGDIAG/tests/analysis/own_code/make_areal_rejection.py

The batch is one packed float32 tensor (1D, `cu_seqlens`), as AReaL feeds a micro-batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from areal.api.cli_args import RejectionSamplingConfig
from areal.trainer.ppo.actor import _apply_m2po_masking
from areal.utils.functional.functional import apply_rejection_sampling

# pgdiag rule -> AReaL RejectionSamplingConfig
REJECTIONS = {
    "areal_rs:token,mask,ratio,mean,2.0,0.5": dict(
        level="token", action="mask", metric="ratio", upper=2.0, lower=0.5
    ),
    "areal_rs:token,clamp,ratio,mean,1.5,0.8": dict(
        level="token", action="clamp", metric="ratio", upper=1.5, lower=0.8
    ),
    "areal_rs:token,mask,kl_k3,mean,0.05": dict(level="token", action="mask", metric="kl_k3", upper=0.05),
    "areal_rs:token,mask,kl_k2,mean,0.02": dict(level="token", action="mask", metric="kl_k2", upper=0.02),
    "areal_rs:sequence,mask,ratio,mean,1.2,0.85": dict(
        level="sequence", action="mask", metric="ratio", agg="mean", upper=1.2, lower=0.85
    ),
    "areal_rs:sequence,clamp,ratio,mean,1.1,0.95": dict(
        level="sequence", action="clamp", metric="ratio", agg="mean", upper=1.1, lower=0.95
    ),
    "areal_rs:sequence,mask,kl_k1,sum,0.3": dict(
        level="sequence", action="mask", metric="kl_k1", agg="sum", upper=0.3
    ),
    "areal_rs:sequence,mask,kl_k3,max,0.1": dict(
        level="sequence", action="mask", metric="kl_k3", agg="max", upper=0.1
    ),
    "areal_rs:sequence,mask,kl_k2,mean,0.02": dict(
        level="sequence", action="mask", metric="kl_k2", agg="mean", upper=0.02
    ),
    "kpop:0.01": dict(level="token", action="mask", metric="binary_kl", upper=0.01),
}
M2PO_TAUS = (0.04, 0.01, 1e-6)


def batch() -> dict[str, list]:
    """Packed float32 behaviour (μ) and proximal log-probs of 7 sequences (finite: pgdiag's reader refuses a
    non-finite log-prob, E207, so AReaL's NaN handling is not replayed)."""
    gen = torch.Generator().manual_seed(1623)
    lengths = [8, 3, 11, 1, 6, 9, 4]
    n = sum(lengths)
    behaviour = torch.log(torch.rand(n, generator=gen) * 0.95 + 0.03)
    proximal = torch.clamp(behaviour + torch.randn(n, generator=gen) * 0.25, max=-1e-4)
    return {"lengths": lengths, "behaviour": behaviour.tolist(), "proximal": proximal.tolist()}


def main() -> None:
    data = batch()
    behaviour = torch.tensor(data["behaviour"], dtype=torch.float32)
    proximal = torch.tensor(data["proximal"], dtype=torch.float32)
    cu_seqlens = torch.tensor([0, *torch.tensor(data["lengths"]).cumsum(0).tolist()], dtype=torch.int32)
    loss_mask = torch.ones_like(behaviour)
    out: dict = {"areal_commit": "cbff54d", **data, "rejections": {}, "m2po": {}}
    for rule, fields in REJECTIONS.items():
        if fields["metric"] == "binary_kl":
            # cbff54d's __post_init__ refuses metric="binary_kl" although the field's choices and
            # apply_rejection_sampling offer it (KPop): set the fields after validation
            config = RejectionSamplingConfig()
            for name, value in fields.items():
                setattr(config, name, value)
        else:
            config = RejectionSamplingConfig(**fields)
        result = apply_rejection_sampling(proximal, behaviour, loss_mask, cu_seqlens, config)
        out["rejections"][rule] = {
            "loss_mask": result.loss_mask.tolist(),
            "weight": result.behave_imp_weight.tolist(),
        }
    for tau in M2PO_TAUS:  # the batch is one micro-batch tensor: pgdiag's scope=step over one step
        kept = _apply_m2po_masking(behaviour, proximal, loss_mask.bool(), tau)
        out["m2po"][f"m2po:{tau:g}"] = kept.tolist()
    Path(__file__).with_name("areal_rejection.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
