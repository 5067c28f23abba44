"""Train a tiny Qwen3-style checkpoint on a toy language and sample RL rollouts from it (pgdiag's sample data).

What: a seeded script that (1) generates text in a small word-level language (arithmetic questions, some
answered through a calculator tool call, and templated stories), (2) trains a 4-layer Qwen3 (hidden 96, GQA
4/2 heads, head_dim 32 != hidden/heads, tied embeddings, vocab 512 of which 308 are used) on it for a few
hundred steps on the CPU, so its next-token distributions are peaked like a real LM's, (3) saves it as
``sample_data/tiny-qwen/`` (config.json with ``architectures: ["Qwen3ForCausalLM"]``, model.safetensors, fp32,
plus the vocabulary as vocab.json and a matching tokenizer.json), and (4) plays a small GRPO loop with it: 4 steps x 8 prompt groups x 4
samples, sampled at temperature 0.7 with a KV cache by a bf16 copy of the model (the "engine"), tool
observations inserted by the environment and masked out of the loss, a 0/1 reward and group-normalised
advantages.

Why: recompute parity only means something on a real LM. `pgdiag logprobs sample_data/run_a --model
sample_data/tiny-qwen` recomputes the run in seconds on a CPU, and every stream has a known numerical origin:

    run_a  rollout = bf16 engine (incremental decode, bf16 logits), tempered at 0.7
           old     = fp32 trainer, teacher-forced over the whole sequence (HF transformers), tempered at 0.7
           new     = fp32 trainer after one clipped policy-gradient step on that step's batch
    run_b  the same samples (tokens, masks, rewards, advantages) seen by a second stack:
           rollout = the fp32 trainer's log-probs (an fp32 engine), old/new = a bf16 trainer (bf16 body and head)

The recompute at ``--dtype fp32`` therefore matches run_a's ``old`` within 1e-6 nats (measured max 9.5e-7),
and ``--dtype bf16`` sits between them.

How: ``PYTHONPATH=. python sample_data/make_tiny_qwen.py`` from the repository root (needs torch and transformers,
a dev dependency; 400 training steps, about 12 minutes measured on two CPU cores shared with other jobs, a few
minutes on idle ones). Seeded: a rerun on the same machine and library versions gives the same files; other
BLAS builds may round differently.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
from make_tokenizer import write_tokenizer  # sample_data/, this script's directory
from transformers import Qwen3Config, Qwen3ForCausalLM

from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

HERE = Path(__file__).resolve().parent
SEED = 1234
VOCAB_SIZE = 512
TEMPERATURE = 0.7
MAX_RESPONSE = 28
STEPS, GROUPS, SAMPLES_PER_GROUP = 4, 8, 4
CLIP_EPS = 0.2

SPECIALS = ["<pad>", "<bos>", "<eos>", "<q>", "<a>", "<call>", "</call>", "<obs>", "</obs>"]
SYMBOLS = ["+", "*", "=", ".", "?"]
NAMES = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "nia",
    "oscar",
    "peggy",
    "quinn",
    "sybil",
    "trent",
    "uma",
    "victor",
]
VERBS = [
    "sees",
    "likes",
    "finds",
    "takes",
    "brings",
    "makes",
    "holds",
    "paints",
    "reads",
    "feeds",
    "helps",
    "calls",
    "meets",
    "follows",
    "visits",
    "builds",
]
NOUNS = [
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "car",
    "book",
    "ball",
    "cup",
    "hat",
    "box",
    "door",
    "river",
    "hill",
    "road",
    "garden",
    "apple",
    "bread",
    "lamp",
    "chair",
    "table",
    "bell",
    "kite",
    "boat",
    "train",
    "clock",
    "key",
    "coin",
]
ADJECTIVES = [
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "new",
    "happy",
    "quiet",
    "loud",
    "bright",
    "dark",
    "warm",
    "cold",
    "soft",
    "fast",
    "slow",
    "tall",
]
FUNCTION_WORDS = [
    "the",
    "then",
    "near",
    "under",
    "with",
    "tell",
    "me",
    "a",
    "story",
    "about",
    "what",
    "is",
    "and",
]
WORDS = [
    *SPECIALS,
    *SYMBOLS,
    *(str(n) for n in range(200)),
    *NAMES,
    *VERBS,
    *NOUNS,
    *ADJECTIVES,
    *FUNCTION_WORDS,
]
TOKEN = {w: i for i, w in enumerate(WORDS)}


def encode(text: str) -> list[int]:
    return [TOKEN[w] for w in text.split()]


def decode(ids: list[int]) -> str:
    return " ".join(WORDS[i] if i < len(WORDS) else f"<unused{i}>" for i in ids)


# ---- the toy language: (env, prompt, full response) ------------------------------------------------------


@dataclass(frozen=True)
class Task:
    env: str  # arith, tool, story
    prompt: str
    answer: str  # the reference response (training text); rewards check the sampled one


def make_task(rng: random.Random) -> Task:
    kind = rng.choice(["arith", "tool", "story", "story"])
    if kind == "arith":
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        return Task("arith", f"<bos> <q> what is {a} + {b} ? <a>", f"{a} + {b} = {a + b} . <eos>")
    if kind == "tool":
        a, b, c = rng.randint(0, 50), rng.randint(2, 12), rng.randint(2, 12)
        prompt = f"<bos> <q> what is {a} + {b} * {c} ? <a>"
        return Task(
            "tool",
            prompt,
            f"<call> {b} * {c} </call> <obs> {b * c} </obs> {a} + {b * c} = {a + b * c} . <eos>",
        )
    name = rng.choice(NAMES)
    first = f"{name} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} ."
    second = f"then {name} {rng.choice(VERBS)} the {rng.choice(NOUNS)} near the {rng.choice(NOUNS)} ."
    return Task("story", f"<bos> <q> tell me a story about {name} <a>", f"{first} {second} <eos>")


def reward(task: Task, response: str) -> float:
    """1.0 for a correct final answer (arith, tool) or a well-formed story about the prompt's name, else 0.0."""
    words = response.split()
    if task.env == "story":
        name = task.prompt.split()[-2]
        return float(words[:1] == [name] and words.count(".") == 2 and words[-1:] == ["<eos>"])
    expected = task.answer.split()[-3]
    return float(len(words) >= 3 and words[-1] == "<eos>" and words[-3] == expected)


def tool_result(call: list[str]) -> str | None:
    """The calculator: ``b * c`` -> the product, None for anything else."""
    if len(call) == 3 and call[1] == "*" and call[0].isdigit() and call[2].isdigit():
        product = int(call[0]) * int(call[2])
        return str(product) if product < 200 else None
    return None


# ---- training ----------------------------------------------------------------------------------------------


def build_model() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=TOKEN["<bos>"],
        eos_token_id=TOKEN["<eos>"],
        pad_token_id=TOKEN["<pad>"],
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).float()


def train(
    model: Qwen3ForCausalLM, rng: random.Random, steps: int = 400, batch: int = 32, seq: int = 48
) -> None:
    """Next-token training on a stream of concatenated task texts, chunked into `seq`-token rows."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    stream: list[int] = []
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        while len(stream) < batch * seq + 1:
            task = make_task(rng)
            stream += encode(f"{task.prompt} {task.answer}")
        chunk = torch.tensor(stream[: batch * seq + 1])
        stream = stream[batch * seq :]
        inputs, labels = chunk[:-1].view(batch, seq), chunk[1:].reshape(batch, seq)
        logits = model(input_ids=inputs).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"train step {step:4d} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()


# ---- rollouts ----------------------------------------------------------------------------------------------


@dataclass
class Sample:
    task: Task
    ids: list[int]
    loss_mask: list[bool]
    rollout_logprobs: list[float | None]
    finish_reason: str


@torch.no_grad()
def sample(engine: Qwen3ForCausalLM, task: Task, generator: torch.Generator) -> Sample:
    """Sample a response at TEMPERATURE with a KV cache; the environment answers tool calls (masked spans)."""
    ids = encode(task.prompt)
    mask = [False] * len(ids)
    logprobs: list[float | None] = [None] * len(ids)
    pending = ids[:]
    past = None
    generated = 0
    finish = "length"
    while generated < MAX_RESPONSE:
        out = engine(input_ids=torch.tensor([pending]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[0, -1].float() / TEMPERATURE, dim=-1)  # (V,) from bf16 logits
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        ids.append(token)
        mask.append(True)
        logprobs.append(float(logp[token]))
        generated += 1
        pending = [token]
        if token == TOKEN["<eos>"]:
            finish = "stop"
            break
        if token == TOKEN["</call>"]:
            words = decode(ids).split()
            call = words[len(words) - 1 - words[::-1].index("<call>") + 1 : -1] if "<call>" in words else []
            result = tool_result(call)
            observation = encode(f"<obs> {result if result is not None else '0'} </obs>")
            ids += observation
            mask += [False] * len(observation)
            logprobs += [None] * len(observation)
            pending = observation
    return Sample(task, ids, mask, logprobs, finish)


@torch.no_grad()
def teacher_forced(model: Qwen3ForCausalLM, samples: list[Sample]) -> list[list[float | None]]:
    """Tempered log-prob of every loss token given its prefix, one full-sequence forward per sample."""
    out = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.ids])).logits[0].float() / TEMPERATURE  # (T, V)
        logp = torch.log_softmax(logits, dim=-1)
        values: list[float | None] = [None] * len(s.ids)
        for t, m in enumerate(s.loss_mask):
            if m:
                values[t] = float(logp[t - 1, s.ids[t]])
        out.append(values)
    return out


def policy_step(
    model: Qwen3ForCausalLM, samples: list[Sample], old: list[list], advantages: list[float]
) -> Qwen3ForCausalLM:
    """A copy of `model` after one clipped policy-gradient step (token-mean, eps 0.2) on `samples`."""
    updated = copy.deepcopy(model).train()
    optimizer = torch.optim.Adam(updated.parameters(), lr=4e-4)
    total, count = torch.zeros(()), 0
    for s, old_lp, adv in zip(samples, old, advantages, strict=True):
        logits = updated(input_ids=torch.tensor([s.ids])).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)
        pos = [t for t, m in enumerate(s.loss_mask) if m]
        lp = logp[[t - 1 for t in pos], [s.ids[t] for t in pos]]  # (K,)
        ratio = torch.exp(lp - torch.tensor([old_lp[t] for t in pos]))
        clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
        total = total - torch.minimum(ratio * adv, clipped * adv).sum()
        count += len(pos)
    optimizer.zero_grad()
    (total / max(count, 1)).backward()
    optimizer.step()
    return updated.eval()


def group_advantages(rewards: list[float]) -> list[float]:
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


def frame(rows: list[dict]) -> pl.DataFrame:
    lists = {"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Boolean)}
    floats = ("rollout_logprobs", "old_logprobs", "new_logprobs", "advantages")
    schema = {
        "step": pl.Int64, "sample_id": pl.String, "group_id": pl.String, "prompt_len": pl.Int32, **lists,
        **{c: pl.List(pl.Float32) for c in floats}, "reward": pl.Float32, "env": pl.String,
        "finish_reason": pl.String, "policy_version": pl.Int64,
    }  # fmt: skip
    return pl.DataFrame({c: [r[c] for r in rows] for c in schema}, schema=schema)


def main() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)
    model = build_model()
    train(model, rng)

    ckpt = HERE / "tiny-qwen"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    (ckpt / "vocab.json").write_text(json.dumps(TOKEN, indent=0) + "\n", encoding="utf-8")
    write_tokenizer(ckpt)  # tokenizer.json over the same ids, for --tokenizer

    engine = copy.deepcopy(model).to(torch.bfloat16)  # the inference engine: bf16 body and head
    trainer_b = copy.deepcopy(model).to(torch.bfloat16)  # run_b's trainer: bf16 numerics
    generator = torch.Generator().manual_seed(SEED)
    rows_a, rows_b = [], []
    for step in range(STEPS):
        samples, groups = [], []
        for g in range(GROUPS):
            task = make_task(rng)
            for _ in range(SAMPLES_PER_GROUP):
                samples.append(sample(engine, task, generator))
                groups.append(f"{step}:g{g}")
        rewards = [reward(s.task, decode(s.ids[len(encode(s.task.prompt)) :])) for s in samples]
        advantages = []
        for g in range(GROUPS):
            advantages += group_advantages(rewards[g * SAMPLES_PER_GROUP : (g + 1) * SAMPLES_PER_GROUP])
        old_a = teacher_forced(model, samples)
        updated = policy_step(model, samples, old_a, advantages)
        new_a = teacher_forced(updated, samples)
        old_b = teacher_forced(trainer_b, samples)
        new_b = teacher_forced(updated.to(torch.bfloat16), samples)
        for k, s in enumerate(samples):
            base = {
                "step": step, "sample_id": f"{step}:{k}", "group_id": groups[k], "prompt_len": len(encode(s.task.prompt)),
                "input_ids": s.ids, "loss_mask": s.loss_mask, "reward": rewards[k], "env": s.task.env,
                "finish_reason": s.finish_reason, "policy_version": step,
                "advantages": [advantages[k] if m else None for m in s.loss_mask],
            }  # fmt: skip
            rows_a.append(
                {
                    **base,
                    "rollout_logprobs": s.rollout_logprobs,
                    "old_logprobs": old_a[k],
                    "new_logprobs": new_a[k],
                }
            )
            rows_b.append(
                {**base, "rollout_logprobs": old_a[k], "old_logprobs": old_b[k], "new_logprobs": new_b[k]}
            )
        print(
            f"step {step}: mean reward {np.mean(rewards):.2f}, {sum(sum(s.loss_mask) for s in samples)} loss tokens"
        )

    config_sha = __import__("hashlib").sha256((ckpt / "config.json").read_bytes()).hexdigest()
    common = {
        "sampling": {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs_mode": "processed",
                     "engine": "tiny-qwen bf16 kv-cache"},
        "tokenizer": {"name": "tiny-qwen word-level", "vocab_size": VOCAB_SIZE, "tokenizer_len": len(WORDS), "sha256": None},
        "model": {"path": "sample_data/tiny-qwen", "architecture": "Qwen3ForCausalLM", "config_sha256": config_sha},
        "overwrite": True,
    }  # fmt: skip
    for name, rows, engine_name, old_name in (
        ("run_a", rows_a, "bf16 engine (kv cache)", "fp32 trainer"),
        ("run_b", rows_b, "fp32 engine", "bf16 trainer"),
    ):
        streams = {
            "rollout": stream_meta(
                "rollout_logprobs", tempered=True, logprobs_mode="processed", engine=engine_name
            ),
            "old": stream_meta("old_logprobs", tempered=True, logprobs_mode="processed", engine=old_name),
            "new": stream_meta("new_logprobs", tempered=True, logprobs_mode="processed", engine=old_name),
        }
        source = source_meta("tiny-qwen", framework_version=old_name, src_files=["make_tiny_qwen.py"])
        write_rollouts(frame(rows), HERE / name, label=name, source=source, streams_meta=streams, **common)
    print(f"wrote {ckpt}, {HERE / 'run_a'}, {HERE / 'run_b'}")


if __name__ == "__main__":
    main()
