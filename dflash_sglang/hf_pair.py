"""A target and its drafter as Hugging Face loads them, for the reference decoder's commands (`dflash-sglang
generate`, bench/serving/accept.py, scripts/bench_draft_block.py): a prompt's token ids (the chat template where the
tokenizer has one) and the pair's loading (safetensors only, no remote code, the drafter checked against the target
first). torch and transformers are imported when a pair is loaded, not with this module."""
from __future__ import annotations

import json
from pathlib import Path


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    """A prompt (a string, or a chat's messages list) -> its [n] token ids, through the chat template with `chat`."""
    if isinstance(prompt, list) or (chat and getattr(tokenizer, "chat_template", None)):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def load_pair(target_dir: Path, draft_dir: Path, device: str):
    """HF target (safetensors only, no remote code), tokenizer and strictly-loaded drafter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .core.draft.checkpoint import check_fit, load_drafter
    from .core.draft.config import DraftConfig

    if not (target_dir / "config.json").is_file():
        raise ValueError(f"--target {target_dir}: not an HF model directory (no config.json)")
    cfg = DraftConfig.load(draft_dir)
    check_fit(cfg, json.loads((target_dir / "config.json").read_text()), str(draft_dir / "config.json"))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, use_safetensors=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = load_drafter(draft_dir, device=device, dtype=dtype)
    return target, tokenizer, drafter
