"""Strict safetensors loading/saving of DFlash drafts, and the draft-to-target fit check.

Every failure raises `CheckpointError` naming the file and the tensor or field, before any weight is used:
missing, unexpected, misshaped or non-float tensors, truncated or garbled files, pickle-only checkpoints, and
drafts that do not fit the target. The tensor checks read safetensors headers only (`check_weight_headers`, run
at server start-up before the target loads); `read_state_dict` runs the same checks before reading any data.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import CONFIG_FILE, CheckpointError, DraftConfig, config_value
from .drafter import DFlashDrafter
from .safetensors_header import TensorHeader, read_header
from .token_map import load_token_map, save_token_map

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
# Any torch.save / pickle file counts, whatever its name (exporters write e.g. "draft.pt", "checkpoint.pth").
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Float dtypes a draft may be stored in (the loader casts between them); ints or fp8 would need dequantising.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
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
    if draft_dir.is_dir():
        found = [p.name for p in draft_dir.iterdir() if p.name in PICKLE_FILES or p.suffix in PICKLE_SUFFIXES]
        pickles = sorted(found, key=lambda name: (name not in PICKLE_FILES, name))
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


def validated_headers(draft_dir: Path, expected: dict[str, torch.Size]) -> dict[str, TensorHeader]:
    """Every tensor header of the draft's weight files by canonical name, checked against `expected`
    (name -> shape): no duplicate, unexpected, missing, misshaped or non-float tensor. Reads headers only."""
    files = weight_files(draft_dir)
    headers: dict[str, TensorHeader] = {}
    for f in files:
        for h in read_header(f):
            name = _canonical(h.name)
            if name in headers:
                raise CheckpointError(f"{f}: tensor '{h.name}' duplicates one in {headers[name].file.name}")
            if name not in expected:
                raise CheckpointError(
                    f"{f}: unexpected tensor '{h.name}' (a DFlash draft borrows embed_tokens/lm_head from the "
                    f"target and stores only its own layers)"
                )
            if h.shape != tuple(expected[name]):
                raise CheckpointError(
                    f"{f}: tensor '{h.name}' has shape {list(h.shape)}, config.json implies {list(expected[name])}"
                )
            if h.dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{f}: tensor '{h.name}' has dtype {h.dtype}; draft weights must be one of "
                    f"{', '.join(FLOAT_DTYPES)}"
                )
            headers[name] = h
    missing = sorted(set(expected) - set(headers))
    if missing:
        where = files[0] if len(files) == 1 else draft_dir / INDEX_FILE
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: missing tensor '{missing[0]}'{more}: {missing[:3]}")
    return headers


def check_weight_headers(draft_dir: str | Path, cfg: DraftConfig) -> None:
    """Check the draft's weight files against `cfg` from their safetensors headers alone (no tensor data read):
    the same tensor checks `load_drafter` makes, cheap enough for server start-up before the target loads."""
    draft_dir = Path(draft_dir)
    validated_headers(draft_dir, _expected_or_raise(cfg, draft_dir))


def read_state_dict(draft_dir: Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Read and validate every tensor against `expected` (name -> shape); raises on any mismatch.

    All headers are checked before any tensor data is read, so a bad shard fails fast and names itself.
    """
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, h in validated_headers(draft_dir, expected).items():
        by_file.setdefault(h.file, []).append((name, h.name))
    tensors: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types for what the header check cannot see
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        with handle:
            for name, raw in names:
                tensors[name] = handle.get_tensor(raw)
    return tensors


def expected_shapes(cfg: DraftConfig) -> dict[str, torch.Size]:
    """Tensor name -> shape of a draft with config `cfg` (the module built on the meta device: no memory)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def _expected_or_raise(cfg: DraftConfig, draft_dir: Path) -> dict[str, torch.Size]:
    try:
        return expected_shapes(cfg)
    except ValueError as e:  # e.g. an unsupported rope_scaling type
        raise CheckpointError(f"{draft_dir / CONFIG_FILE}: {e}") from None


def load_drafter(
    draft_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Load a z-lab (or speculators) DFlash draft strictly from safetensors.

    dtype None keeps the stored dtype of the weights (bf16 for published drafts). A `token_map.safetensors` next
    to config.json becomes `model.token_map` (reduced draft vocabulary, core/draft/token_map.py); none: full vocabulary.
    """
    draft_dir = Path(draft_dir)
    cfg = DraftConfig.load(draft_dir)
    tensors = read_state_dict(draft_dir, _expected_or_raise(cfg, draft_dir))
    stored = next(iter(tensors.values())).dtype
    model = DFlashDrafter(cfg).to(dtype=dtype or stored)
    model.load_state_dict(tensors, strict=True)
    model.token_map = load_token_map(draft_dir, cfg.vocab_size)
    return model.to(device).eval()


def save_drafter(model: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the z-lab format (what SGLang's builtin DFLASH loads too), and the
    drafter's token map, if it has one, as token_map.safetensors (a stale map in `out_dir` is removed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    save_token_map(model.token_map, out)
    return out


def _field(target_cfg: Any, *names: str) -> Any:
    text = config_value(target_cfg, "text_config") or target_cfg
    for n in names:
        v = config_value(text, n)
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
            f"{draft_source}: field '{cfg.field_name('mask_token_id')}'={cfg.mask_token_id} is not a row of the "
            f"target embedding (vocab_size={vocab})"
        )
    bad = [i for i in cfg.target_layer_ids if i >= n_layers]
    if bad:
        raise CheckpointError(
            f"{draft_source}: field '{cfg.field_name('target_layer_ids')}'={list(cfg.target_layer_ids)} has ids {bad} "
            f"out of range for a target with {n_layers} layers"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != n_layers:
        raise CheckpointError(
            f"{draft_source}: field 'num_target_layers'={cfg.num_target_layers} but the target has {n_layers} layers"
        )
    return {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_layers}
