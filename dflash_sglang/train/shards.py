"""On-disk cache of training sequences and their target features (computed once, read every epoch).

A shard is one safetensors file holding n sequences concatenated along time (no padding):
  tokens      [N] int32        prompt + response ids of every sequence, back to back
  offsets     [n + 1] int64    sequence i is tokens[offsets[i]:offsets[i+1]]
  prompt_lens [n] int64        the first prompt_lens[i] tokens of sequence i are prompt (no loss there)
  features    [N, F] float16   target layer outputs for `layer_ids`, concatenated (F = n_feat * hidden)
  final_hidden [N, H] float16  the target's last hidden state (after its final norm): row t gives the target's
                               distribution over token t + 1 with one lm_head matmul (logit distillation,
                               objective.py). Caches built before it existed lack it: they still train with
                               --distill-weight 0, and a distilling run refuses them naming the shard.
The metadata records the layer ids so a cache built for other layers is never silently reused.
`read_shard` maps the features from the file instead of reading them (`_mapped_tensor`).
"""
from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

SHARD_GLOB = "shard_*.safetensors"


@dataclass
class Sequence_:
    """One cached training sequence."""

    tokens: Tensor  # [T] int64
    prompt_len: int
    features: Tensor  # [T, F] float16
    final_hidden: Tensor | None = None  # [T, H] float16; None in a cache written before it was stored
    source: Path | None = None  # the shard it was read from (named by errors about it)


def shard_path(cache_dir: Path, index: int) -> Path:
    return cache_dir / f"shard_{index:05d}.safetensors"


def write_shard(path: Path, seqs: Sequence[Sequence_], layer_ids: Sequence[int], extra: dict | None = None) -> None:
    """Write atomically (tmp file + rename) so a killed job never leaves a truncated shard behind."""
    if not seqs:
        raise ValueError(f"{path}: refusing to write an empty shard")
    lens = torch.tensor([len(s.tokens) for s in seqs])
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]).to(torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.long),
        "features": torch.cat([s.features for s in seqs]).to(torch.float16).contiguous(),
    }
    finals = [s.final_hidden for s in seqs]
    if any(f is not None for f in finals):
        assert all(f is not None for f in finals), "a shard stores the final hidden state of every sequence or none"
        tensors["final_hidden"] = torch.cat(finals).to(torch.float16).contiguous()
    meta = {"layer_ids": json.dumps(list(layer_ids)), **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)


def read_shard(path: Path, layer_ids: Sequence[int] | None = None) -> list[Sequence_]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        stored = json.loads(meta.get("layer_ids", "null"))
        if layer_ids is not None and stored != list(layer_ids):
            raise ValueError(f"{path}: features were cached for layer ids {stored}, "
                             f"the drafter wants {list(layer_ids)}")
        tokens, offsets = f.get_tensor("tokens").long(), f.get_tensor("offsets")
        prompt_lens = f.get_tensor("prompt_lens")
        has_final = "final_hidden" in f.keys()
    feats = _mapped_tensor(path, "features")
    final = _mapped_tensor(path, "final_hidden") if has_final else None
    out = []
    for i in range(len(prompt_lens)):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out.append(Sequence_(tokens[a:b], int(prompt_lens[i]), feats[a:b],
                             None if final is None else final[a:b], path))
    return out


def _mapped_tensor(path: Path, name: str) -> Tensor:
    """The shard's float16 tensor `name` (`features` [N, F], `final_hidden` [N, H]) as a copy-on-write memory map
    of the file, not a copy in memory.

    Training touches a batch of sequences per step; the page cache keeps what fits and drops the rest, so a cache
    larger than the free memory (SmolLM2, 5 features: ~5.8 KB per token, 16 GB for 12k regenerated sequences)
    still trains on a shared CPU machine. Copy-on-write: an in-place write changes this process's copy only.
    """
    with path.open("rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mapped[:8], "little")
    entry = json.loads(mapped[8 : 8 + n])[name]
    assert entry["dtype"] == "F16", "write_shard stores float16 features and final hidden states"
    begin, end = entry["data_offsets"]
    # frombuffer keeps a reference to the map, which stays open while any sequence's view of it lives
    flat = torch.frombuffer(mapped, dtype=torch.float16, count=(end - begin) // 2, offset=8 + n + begin)
    return flat.view(entry["shape"])


def list_shards(cache_dir: Path) -> list[Path]:
    return sorted(Path(cache_dir).glob(SHARD_GLOB))


def load_cache(cache_dir: Path, layer_ids: Sequence[int] | None = None) -> list[Sequence_]:
    shards = list_shards(cache_dir)
    if not shards:
        raise FileNotFoundError(f"no feature shards ({SHARD_GLOB}) in {cache_dir}")
    return [s for p in shards for s in read_shard(p, layer_ids)]


def iter_batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
