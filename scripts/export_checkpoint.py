#!/usr/bin/env python3
"""Export a training checkpoint (`OUT/checkpoints/step_*.pt`) of a running or stopped `train` run as a draft directory.

    python scripts/export_checkpoint.py work_tmp/cpu_run --config dflash_sglang/assets/smollm2_135m_dflash \
        --out work_tmp/cpu_run_export

A run exports its drafter only when its schedule ends; this writes the latest (or --step) checkpoint's weights the
same way (`save_drafter`: bf16 model.safetensors, config.json, and token_map.safetensors when the run used
--draft-vocab), so a long CPU run can be decoded and compared while it goes on. --config: a draft directory with
the run's config.json (the --init checkpoint of a continued run, or an earlier export of the run). Checkpoints
are this project's own torch.save files, read with weights_only=True. Last stdout line: JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_sglang.core.draft.checkpoint import save_drafter  # noqa: E402
from dflash_sglang.core.draft.config import DraftConfig  # noqa: E402
from dflash_sglang.core.draft.drafter import DFlashDrafter  # noqa: E402
from dflash_sglang.core.draft.token_map import check_token_map  # noqa: E402
from dflash_sglang.train.trainer import CKPT_DIR  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the training output directory (holds checkpoints/)")
    ap.add_argument("--config", type=Path, required=True, help="draft directory whose config.json the run trains")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--step", type=int, default=None, help="default: the latest checkpoint")
    args = ap.parse_args(argv)
    ckpts = sorted((args.run / CKPT_DIR).glob("step_*.pt"))
    if args.step is not None:
        ckpts = [c for c in ckpts if c.name == f"step_{args.step:07d}.pt"]
    if not ckpts:
        print(f"{args.run / CKPT_DIR}: no checkpoint{'' if args.step is None else f' of step {args.step}'}",
              file=sys.stderr)
        return 2
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=True)
    cfg = DraftConfig.load(args.config)
    model = DFlashDrafter(cfg)
    model.load_state_dict(state["model"], strict=True)
    token_map = state.get("token_map")
    model.token_map = None if token_map is None else check_token_map(token_map, cfg.vocab_size, str(ckpts[-1]))
    save_drafter(model, args.out)
    print(json.dumps({"script": "export_checkpoint", "checkpoint": str(ckpts[-1]), "step": state["step"],
                      "out": str(args.out), "draft_vocab": cfg.vocab_size if token_map is None else len(token_map)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
