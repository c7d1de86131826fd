"""The memory-bandwidth roofline every benchmark prints first.

At batch 1 a decode step reads every weight once, so HBM bandwidth / weight bytes bounds autoregressive
tokens/s/user. A DFlash step reads the target once (verify of B tokens) plus the drafter and the borrowed
lm_head, and commits tau tokens, so its batch-1 ceiling is tau * BW / (target_bytes + draft_bytes). KV-cache
reads, activations and launch overheads are ignored, which is why these are ceilings.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_tbs: float  # TB/s (1e12 B/s)
    memory_gb: float
    source: str


GPUS: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100", 3.35, 80, "NVIDIA H100 SXM datasheet"),
        Hardware("h200", 4.8, 141, "NVIDIA H200 datasheet"),
        Hardware("b200", 8.0, 180, "NVIDIA B200 datasheet"),
        Hardware("b300", 8.0, 288, "NVIDIA B300 (HGX) datasheet"),
    )
}


def measure_cpu_bandwidth(mb: int = 64, repeats: int = 5) -> float:
    """Single-process copy bandwidth in TB/s (read + write bytes of a tensor copy, best of `repeats`)."""
    import torch

    src = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e12


def detect() -> str:
    """'h100' | 'h200' | 'b200' | 'b300' from the CUDA device name, else 'cpu'."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            for key in GPUS:
                if key in name:
                    return key
            return "cpu"
    except Exception:
        pass
    return "cpu"


def hardware(name: str = "auto", cpu_bandwidth_tbs: float | None = None) -> Hardware:
    """The named GPU from the table, or 'cpu' with a stated bandwidth (or a measured one when None)."""
    key = detect() if name == "auto" else name.lower()
    if key in GPUS:
        return GPUS[key]
    if key != "cpu":
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(GPUS)} or 'cpu'")
    if cpu_bandwidth_tbs is not None:
        return Hardware("cpu", cpu_bandwidth_tbs, 0, "stated (--cpu-bandwidth-tbs)")
    return Hardware("cpu", measure_cpu_bandwidth(), 0, "measured: single-process tensor copy")


def local_weight_gb(model_dir: str | Path) -> float | None:
    """Weight GB of a local checkpoint (safetensors file sizes), None if `model_dir` is not a local directory."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 1e9 if files else None


def borrowed_head_gb(target_dir: str | Path) -> float:
    """GB of the target lm_head a DFlash draft pass reads (vocab x hidden at the target's checkpoint dtype)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), 2)
    return cfg["vocab_size"] * cfg["hidden_size"] * width / 1e9


@dataclass(frozen=True)
class Roofline:
    hw: Hardware
    model: str
    target_gb: float
    draft_gb: float | None  # None: no speculation in this run
    how: str  # where the byte counts come from

    @property
    def ar_tok_s(self) -> float:
        """Autoregressive batch-1 ceiling, tokens/s/user."""
        return self.hw.bandwidth_tbs * 1e3 / self.target_gb

    def spec_tok_s(self, tau: float) -> float:
        """DFlash batch-1 ceiling at mean acceptance length tau (bonus included), tokens/s/user."""
        return tau * self.hw.bandwidth_tbs * 1e3 / (self.target_gb + (self.draft_gb or 0.0))

    def table(self, taus: tuple[float, ...] = (3.0, 5.0, 7.0)) -> str:
        """The header every benchmark prints first: the GPU table plus this run's machine."""
        lines = [
            f"Roofline (batch-1 decode is bandwidth bound): {self.model}: target {self.target_gb:.3g} GB/step"
            + (f", draft+lm_head {self.draft_gb:.3g} GB/step" if self.draft_gb else "") + f" [{self.how}]",
            f"{'hw':<6} {'TB/s':>6} {'AR tok/s':>9}" + "".join(f" {'tau=' + format(t, 'g'):>9}" for t in taus),
        ]
        rows = list(GPUS.values())
        if self.hw.name not in GPUS:
            rows.append(self.hw)
        for hw in rows:
            r = Roofline(hw, self.model, self.target_gb, self.draft_gb, self.how)
            spec = "".join(f" {r.spec_tok_s(t):>9.0f}" for t in taus) if self.draft_gb else ""
            mark = "  <- this run (" + hw.source + ")" if hw.name == self.hw.name else ""
            lines.append(f"{hw.name:<6} {hw.bandwidth_tbs:>6.3g} {r.ar_tok_s:>9.0f}{spec}{mark}")
        return "\n".join(lines)

    def relative(self, tok_s_user: float, tau: float | None = None) -> str:
        """Where a measured batch-1 tokens/s/user stands against the ceilings of this run's hardware."""
        out = f"{tok_s_user:.1f} tok/s/user = {100 * tok_s_user / self.ar_tok_s:.1f}% of the AR ceiling " \
              f"{self.ar_tok_s:.0f} on {self.hw.name}"
        if tau and self.draft_gb:
            cap = self.spec_tok_s(tau)
            out += f"; {100 * tok_s_user / cap:.1f}% of the DFlash ceiling {cap:.0f} at tau={tau:.2f}"
        return out

    def as_dict(self) -> dict:
        return {
            "hardware": self.hw.name, "bandwidth_tbs": round(self.hw.bandwidth_tbs, 4), "source": self.hw.source,
            "target_gb": round(self.target_gb, 4),
            "draft_gb": None if self.draft_gb is None else round(self.draft_gb, 4),
            "ar_ceiling_tok_s": round(self.ar_tok_s, 2),
        }


def for_models(hw: Hardware, target: str, draft: str | None) -> Roofline:
    """Roofline for a target (+ draft): local checkpoints by file size, known hub pairs from `dflash_sglang.pairs`."""
    from dflash_sglang.pairs import PAIRS, pair_for

    local = local_weight_gb(target)
    if local is not None:
        dgb = None
        if draft is not None:
            dgb = (local_weight_gb(draft) or 0.0) + borrowed_head_gb(target)
        return Roofline(hw, Path(target).name, local, dgb, "local safetensors sizes")
    pairs = [pair_for(draft)] if draft is not None else [p for p in PAIRS.values() if p.target.repo == target]
    if pairs and pairs[0].target.decode_gb is not None:
        pair = pairs[0]
        return Roofline(hw, pair.target.repo, pair.target.decode_gb, pair.draft_gb if draft else None,
                        "dflash_sglang.pairs")
    raise KeyError(f"no weight size known for {target!r} (unknown, or unverified in dflash_sglang.pairs): pass a local "
                   f"directory")
