"""Strict safetensors loading/saving of DFlash drafts, and the draft-to-target fit check.

Every failure raises `CheckpointError` naming the file and the tensor or field, before any weight is used:
missing, unexpected or misshaped tensors, pickle-only checkpoints, and drafts that do not fit the target.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import CONFIG_FILE, CheckpointError, DraftConfig
from .drafter import DFlashDrafter

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
# Third-party exporters sometimes prefix every name with "model."; the tensors are otherwise identical.
STRIPPED_PREFIXES = ("model.",)


def weight_files(draft_dir: Path) -> list[Path]:
    """The safetensors files of a draft directory (single file or an index of shards)."""
    index = draft_dir / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e})") from None
        files = [draft_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: shard '{f.name}' is missing")
        return files
    single = draft_dir / WEIGHTS_FILE
    if single.is_file():
        return [single]
    pickles = [p for p in PICKLE_FILES if (draft_dir / p).exists()]
    if pickles:
        raise CheckpointError(
            f"{draft_dir / pickles[0]}: pickle weights are never loaded (unsafe); convert the draft to "
            f"{WEIGHTS_FILE}"
        )
    raise CheckpointError(f"{single}: missing (no safetensors weights in {draft_dir})")


def _canonical(name: str) -> str:
    for p in STRIPPED_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def read_state_dict(draft_dir: Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Read and validate every tensor against `expected` (name -> shape); raises on any mismatch."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in weight_files(draft_dir):
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types for truncated/garbled headers
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        with handle:
            for raw in handle.keys():
                name = _canonical(raw)
                if name in tensors:
                    raise CheckpointError(f"{f}: tensor '{raw}' duplicates one in {origin[name].name}")
                if name not in expected:
                    raise CheckpointError(
                        f"{f}: unexpected tensor '{raw}' (a DFlash draft borrows embed_tokens/lm_head from the "
                        f"target and stores only its own layers)"
                    )
                t = handle.get_tensor(raw)
                if t.shape != expected[name]:
                    raise CheckpointError(
                        f"{f}: tensor '{raw}' has shape {list(t.shape)}, config.json implies {list(expected[name])}"
                    )
                tensors[name], origin[name] = t, f
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{draft_dir}: missing tensor '{missing[0]}'{more}: {missing[:3]}")
    return tensors


def expected_shapes(cfg: DraftConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def load_drafter(
    draft_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Load a z-lab (or speculators) DFlash draft strictly from safetensors.

    dtype None keeps the stored dtype of the weights (bf16 for published drafts).
    """
    draft_dir = Path(draft_dir)
    cfg = DraftConfig.load(draft_dir)
    try:
        shapes = expected_shapes(cfg)
    except ValueError as e:  # e.g. an unsupported rope_scaling type
        raise CheckpointError(f"{draft_dir / CONFIG_FILE}: {e}") from None
    tensors = read_state_dict(draft_dir, shapes)
    stored = next(iter(tensors.values())).dtype
    model = DFlashDrafter(cfg).to(dtype=dtype or stored)
    model.load_state_dict(tensors, strict=True)
    return model.to(device).eval()


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the z-lab format (what SGLang's builtin DFLASH loads too)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def _field(target_cfg: Any, *names: str) -> Any:
    text = getattr(target_cfg, "text_config", None) or target_cfg
    for n in names:
        v = text.get(n) if isinstance(text, dict) else getattr(text, n, None)
        if v is not None:
            return v
    return None


def check_fit(cfg: DraftConfig, target_cfg: Any, draft_source: str = CONFIG_FILE) -> dict[str, Any]:
    """Check that a draft fits a target (HF config object or dict). Returns the target facts used.

    The drafter embeds with the target's table and projects with its head, so the hidden size must match
    and the vocabularies must agree; every layer id must name a real target layer.
    """
    hidden = _field(target_cfg, "hidden_size")
    vocab = _field(target_cfg, "vocab_size")
    n_layers = _field(target_cfg, "num_hidden_layers")
    if None in (hidden, vocab, n_layers):
        raise CheckpointError("target config: missing hidden_size / vocab_size / num_hidden_layers")
    if cfg.hidden_size != hidden:
        raise CheckpointError(
            f"{draft_source}: field 'hidden_size'={cfg.hidden_size} does not match the target's hidden_size={hidden}"
        )
    if cfg.vocab_size != vocab:
        raise CheckpointError(
            f"{draft_source}: field 'vocab_size'={cfg.vocab_size} does not match the target's vocab_size={vocab}"
        )
    if cfg.mask_token_id >= vocab:
        raise CheckpointError(
            f"{draft_source}: field 'dflash_config.mask_token_id'={cfg.mask_token_id} is not a row of the "
            f"target embedding (vocab_size={vocab})"
        )
    bad = [i for i in cfg.target_layer_ids if i >= n_layers]
    if bad:
        raise CheckpointError(
            f"{draft_source}: field 'dflash_config.target_layer_ids'={list(cfg.target_layer_ids)} has ids {bad} "
            f"out of range for a target with {n_layers} layers"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != n_layers:
        raise CheckpointError(
            f"{draft_source}: field 'num_target_layers'={cfg.num_target_layers} but the target has {n_layers} layers"
        )
    return {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_layers}
