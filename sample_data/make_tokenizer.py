"""Write ``sample_data/tiny-qwen/tokenizer.json`` from the tiny model's word-level ``vocab.json``.

What: a `tokenizers` WordLevel tokenizer over exactly the ids of ``vocab.json`` (whitespace-split words, the
``<...>`` control words marked special), so ``--tokenizer sample_data/tiny-qwen`` decodes the sample runs'
token ids to their words. Why: the worst-token tables show text only when a tokenizer is known. How:
``python sample_data/make_tokenizer.py`` from the repository root (needs the `tokenizers` package of the dev
extra); `make_tiny_qwen.py` calls `write_tokenizer` when it saves the checkpoint. Deterministic: same vocab, same
bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_tokenizer(checkpoint: Path) -> Path:
    """Build ``checkpoint/tokenizer.json`` from ``checkpoint/vocab.json``; returns its path."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab: dict[str, int] = json.loads((checkpoint / "vocab.json").read_text(encoding="utf-8"))
    unknown = "<pad>"  # the vocabulary has no <unk>; no sampled text holds an unknown word
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    control = sorted((w for w in vocab if w.startswith("<") and w.endswith(">")), key=vocab.__getitem__)
    tokenizer.add_special_tokens([AddedToken(w, special=True) for w in control])
    path = checkpoint / "tokenizer.json"
    tokenizer.save(str(path))
    return path


if __name__ == "__main__":
    print(write_tokenizer(HERE / "tiny-qwen"))
