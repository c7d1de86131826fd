#!/usr/bin/env python3
"""Draft KV memory options (fp8 / bf16 / the model dtype) compared on the SmolLM2 testbed pair.

    python scripts/bench_draft_memory.py tau --prompts 32 --new-tokens 64          # reference decoder, not timed
    python scripts/bench_draft_memory.py window --windows 32,128,512,full          # tau vs draft window W
    python scripts/bench_draft_memory.py plan --budget-mib 64 --prompt-tokens 256   # capacity per option + the
                                                                                    # timed CPU Engine command
    python scripts/bench_draft_memory.py capacity --budget-gib 40                   # a draft window's layouts at
                                                                                    # 8k-32k contexts (Qwen3-8B)

See `dflash_sglang/bench/memory/draft_memory.py`. Last stdout line: JSON. `tau` exits 1 if any arm's greedy output
differs from plain decoding; `capacity` if its arithmetic and SGLang's own sizing differ.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_sglang.bench.memory.draft_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
