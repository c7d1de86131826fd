"""The CPU rehearsal (`bash scripts/gpu_train.sh --device cpu`, run by CI): the whole window end to end at tiny size.
It makes a stand-in GGUF with the real one's metadata and tokenizer and prepares it into 1 MiB calls. Every call but
the last only receives; the last call's window runs with a failing git first on PATH; the returned drafter is
reassembled and compared bit for bit with the trained one.

Why: the device path runs only in a session that is lent a GPU, a few minutes at a time. The rehearsal runs the same
code on the CPU first (carried folders, store, join, conversion, training, report, reassembly), so a window's device
minutes are not spent finding a bug that the CPU could have shown.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dflash_sglang.bench.gpu.context import Budget
from dflash_sglang.bench.gpu.device import git_trap
from dflash_sglang.bench.gpu.train.carry import MIB, carried_folders, reassemble, receive
from dflash_sglang.bench.gpu.train.plan import REPO, SIZES, Places, prepare
from dflash_sglang.bench.gpu.train.window import Window


def standin_gguf(real: Path, dest: Path, hidden: int = 64, layers: int = 6, ffn: int = 128) -> Path:
    """A tiny llama GGUF with the real one's metadata and tokenizer (so the same chat template and prompts), Q4_1
    random weights: the conversion, regeneration and training paths at CPU size (~3.7 MB)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    src = GGUFReader(real)
    heads, kv_heads = 4, 2
    dims = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": ffn,
            "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
            "llama.rope.dimension_count": hidden // heads}
    dest.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(dest), arch="llama")
    for name, f in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, dims.get(name, f.contents()), f.types[0],
                            f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)

    def q41(name: str, shape: tuple[int, int]) -> None:
        w.add_tensor(name, quants.quantize(rng.normal(0, 0.3, shape).astype(np.float32), GGMLQuantizationType.Q4_1),
                     raw_dtype=GGMLQuantizationType.Q4_1)

    vocab, kv = len(src.fields["tokenizer.ggml.tokens"].data), hidden // heads * kv_heads
    q41("token_embd.weight", (vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            q41(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def rehearse(places: Places, started_s: float) -> int:
    """prepare (a stand-in GGUF in 1 MiB calls) -> receive each call but the last -> the last call's window, its
    device half under a failing git -> reassemble, bit-exact against what was trained."""
    from dflash_sglang.testbed.target import gguf_path
    from dflash_sglang.bench.gpu.wheels import tree_bytes

    t0 = time.monotonic()
    for p in (places.store, places.work, places.out):
        shutil.rmtree(p, ignore_errors=True)
    real = gguf_path()
    standin = places.carry / "cache" / real.name
    if not standin.is_file():
        standin_gguf(real, standin)
    manifest = prepare("cpu", places, standin, tree_bytes())
    print(f"=== prepare: {manifest['calls']} calls ({manifest['stream']['bytes'] / MIB:.2f} MiB of xz) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    folders = carried_folders(places.carry)
    env = git_trap(places.work.parent / "git_trap")
    saved, os.environ["PATH"] = os.environ["PATH"], env["PATH"]  # the in-process device half too
    try:
        for folder in folders[:-1]:  # the calls before the last: their parts into the store, nothing else
            print(f"=== receive: {', '.join(receive([folder], places.store))}", flush=True)
        size = SIZES["cpu"]
        window = Window("cpu", places, Budget(size.budget_s - started_s - (time.monotonic() - t0)), size, "target",
                        0.5, started_s, env)
        rc = window.run(folders[-1:])
    finally:
        os.environ["PATH"] = saved
    called = (places.work.parent / "git_trap" / "called")
    window.phase("no git on the device path", None, lambda: (
        "a failing git first on PATH", f"FAIL: {called.read_text().strip()}" if called.is_file() else "pass"))
    window.phase("reassemble", None, lambda: check_reassembly(places))
    print((places.out / "train.md").read_text())
    return max(rc, int(window.table.status() == "failed"))


def check_reassembly(places: Places) -> tuple[str, str]:
    """The rehearsal's last phase: the returned parts reassembled, their model.safetensors the trained one's bytes."""
    dest = reassemble(places.out, places.work.parent / "reassembled")
    new, old = ((d / "model.safetensors").read_bytes() for d in (dest, places.work / "drafter"))
    return (f"model.safetensors {len(new)} bytes in {dest.relative_to(REPO)}",
            "pass" if new == old else "FAIL: the reassembled model.safetensors differs from the trained one")
