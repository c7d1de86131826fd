"""The drafter recipe of issue 38: logit distillation from the cached final hidden state, the acceptance-following
position weights, an exact resume, a fine-tune schedule that anneals from a low lr, distinct prompts."""
from __future__ import annotations

import json
import math
from argparse import Namespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dflash_sglang.core.draft.token_map import inverse_map, restrict_head  # noqa: E402
from dflash_sglang.train.cli import FINETUNE_LR, SCRATCH_LR, resolve_schedule  # noqa: E402
from dflash_sglang.train.objective import (  # noqa: E402
    ACCEPT_GAMMA, all_anchors, block_loss_terms, build_block_batch, distill_kl, loss_gamma, position_weights,
    teacher_rows,
)
from dflash_sglang.train.prepare import Example, build_cache  # noqa: E402
from dflash_sglang.train.shards import Sequence_, load_cache, shard_path, write_shard  # noqa: E402
from dflash_sglang.train.trainer import FrozenTarget, TrainConfig, Trainer  # noqa: E402

from test_train import HIDDEN, LAYER_IDS, MASK_ID, VOCAB, _tiny_cache, draft_cfg, tiny_target  # noqa: E402


def _regenerated_cache(tmp_path, n=8):
    """A cache of the tiny target's own greedy continuations (the path `dflash-sglang train` takes by default)."""
    target = tiny_target()
    gen = torch.Generator().manual_seed(3)
    examples = [Example(tuple(torch.randint(4, VOCAB, (5 + i % 3,), generator=gen).tolist())) for i in range(n)]
    build_cache(target, examples, tmp_path / "regen", LAYER_IDS, regenerate=True, max_new_tokens=12, eos_id=2,
                batch_size=4, progress=False)
    return target, FrozenTarget.from_model(target), load_cache(tmp_path / "regen", LAYER_IDS)


def test_default_gamma_follows_acceptance_not_the_paper():
    assert loss_gamma(16) == loss_gamma(8) == ACCEPT_GAMMA == 1.25
    w = position_weights(16, ACCEPT_GAMMA)
    # the shipped drafter reaches block position 2 in 44% of its steps, 3 in 12%
    assert float(w[2]) == pytest.approx(0.449, abs=1e-3) and float(w[3]) == pytest.approx(0.202, abs=1e-3)
    assert float(w[1] / w[1:].sum()) > 0.5 > float(position_weights(16, loss_gamma(16, paper=True))[1:].sum() ** -1)


def test_the_cache_keeps_the_targets_final_hidden_state(tmp_path):
    """Teacher logits cost one lm_head matmul: head(final_hidden[t]) is the target's distribution over token t+1."""
    target, frozen, data = _regenerated_cache(tmp_path)
    for s in data:
        assert s.final_hidden is not None and s.final_hidden.shape == (len(s.tokens), HIDDEN)
        with torch.no_grad():
            logits = target(input_ids=s.tokens[None]).logits[0, :-1]
        mine = s.final_hidden[:-1].float() @ frozen.lm_head.t()
        assert torch.allclose(mine, logits, atol=3e-2), float((mine - logits).abs().max())


def test_teacher_rows_predict_each_rows_label(tmp_path):
    """On regenerated data the teacher's argmax at every weighted block row is that row's label (greedy tokens)."""
    _, frozen, data = _regenerated_cache(tmp_path)
    anchors = [all_anchors(s.prompt_len, len(s.tokens)) for s in data]
    batch = build_block_batch([s.tokens for s in data], anchors, 4, MASK_ID, ACCEPT_GAMMA)
    final = torch.nn.utils.rnn.pad_sequence([s.final_hidden.float() for s in data], batch_first=True)
    teacher = teacher_rows(final, batch.block_pos) @ frozen.lm_head.t()
    sel = batch.weights > 0
    assert int(sel.sum()) > 100
    assert torch.equal(teacher[sel].argmax(-1), batch.labels[sel])


def test_kl_term_is_the_renormalised_kl_over_the_drafted_vocabulary():
    gen = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(6, VOCAB, generator=gen), torch.randn(6, VOCAB, generator=gen)
    assert torch.allclose(distill_kl(teacher, teacher), torch.zeros(6), atol=1e-6)
    p = teacher.softmax(-1)
    want = (p * (p.log() - draft.log_softmax(-1))).sum(-1)
    assert torch.allclose(distill_kl(draft, teacher), want, atol=1e-5)
    p2 = (teacher / 2).softmax(-1)
    assert torch.allclose(distill_kl(draft, teacher, 2.0), 4 * (p2 * (p2.log() - (draft / 2).log_softmax(-1))).sum(-1),
                          atol=1e-5)
    # through block_loss_terms, with a token map: the KL of the teacher renormalised over the K mapped ids
    token_map = torch.arange(10, 40)
    tokens = [torch.randint(0, VOCAB, (20,), generator=gen) for _ in range(2)]
    batch = build_block_batch(tokens, [all_anchors(5, 20)] * 2, 4, MASK_ID, ACCEPT_GAMMA)
    hidden = torch.randn(*batch.labels.shape, HIDDEN, generator=gen, requires_grad=True)
    teacher_h = torch.randn(*batch.labels.shape, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    terms = block_loss_terms(hidden, restrict_head(head, token_map), batch, lambda h, w: h @ w.t(),
                             inverse_map(token_map, VOCAB), teacher_h)
    sel = batch.weights > 0
    d, t = hidden[sel] @ head[token_map].t(), teacher_h[sel] @ head[token_map].t()
    pt = t.softmax(-1)
    kl = (pt * (pt.log() - d.log_softmax(-1))).sum(-1)
    w = batch.weights[sel]
    assert float(terms.kl_sum.detach()) == pytest.approx(float((kl * w).sum().detach()), rel=1e-4)
    assert float(terms.kl_weight_sum) == pytest.approx(float(w.sum()))  # every weighted row, in-map label or not
    assert float(terms.mixed(0.3)) == pytest.approx(float(0.7 * terms.loss + 0.3 * terms.kl), rel=1e-6)
    assert terms.mixed(0.0) is terms.loss or torch.equal(terms.mixed(0.0), terms.loss)
    terms.mixed(1.0).backward()  # the gradient reaches the draft, never the (frozen) teacher
    assert hidden.grad is not None and float(hidden.grad.abs().sum()) > 0


def test_distillation_lowers_the_held_out_kl(tmp_path):
    _, frozen, data = _regenerated_cache(tmp_path, n=12)
    train, held_out = data[:8], data[8:]
    tcfg = TrainConfig(max_steps=30, batch_size=4, num_anchors=8, lr=5e-3, seed=0, save_every=30, bf16=False,
                       output_norm_init=1.0, distill_weight=1.0)
    trainer = Trainer(draft_cfg(), tcfg, frozen, train, tmp_path / "out", val_data=held_out)
    before = trainer.validate()
    trainer.train(progress=False)
    after = trainer.validate()
    assert after["kl"] < 0.8 * before["kl"], (before, after)


def test_a_cache_without_final_hidden_trains_on_ce_and_is_refused_for_distillation(tmp_path):
    """Caches written before the final hidden state was stored stay readable; a distilling run names the shard."""
    frozen, data = _tiny_cache(tmp_path, n=8)
    old = tmp_path / "old"
    old.mkdir()
    write_shard(shard_path(old, 0), [Sequence_(s.tokens, s.prompt_len, s.features) for s in data], LAYER_IDS)
    legacy = load_cache(old, LAYER_IDS)
    assert all(s.final_hidden is None for s in legacy)
    tcfg = TrainConfig(max_steps=2, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=2, bf16=False)
    with pytest.raises(ValueError, match=r"shard_00000\.safetensors: this feature cache has no final_hidden.*"
                                         r"--distill-weight 0"):
        Trainer(draft_cfg(), tcfg, frozen, legacy, tmp_path / "a").train(progress=False)
    ce_only = TrainConfig(max_steps=2, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=2, bf16=False,
                          distill_weight=0.0)
    Trainer(draft_cfg(), ce_only, frozen, legacy, tmp_path / "b").train(progress=False)
    assert (tmp_path / "b" / "model.safetensors").exists()


@pytest.mark.parametrize("distill_weight", [0.0, 0.5], ids=["ce", "distill"])
def test_k_steps_resume_k_steps_is_bit_identical_to_2k_steps(tmp_path, distill_weight):
    """The optimizer moments and the schedule (warm-up + cosine) come back exactly from the checkpoint."""
    frozen, data = _tiny_cache(tmp_path, n=10)
    k = 5
    tcfg = TrainConfig(max_steps=2 * k, batch_size=4, num_anchors=6, lr=3e-3, warmup_ratio=0.3, seed=0,
                       save_every=100, bf16=False, distill_weight=distill_weight)
    whole = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "whole")
    whole.train(progress=False)
    first = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "split")
    assert first.train(progress=False, stop_at=k)["paused"] and first.step == k
    assert not (tmp_path / "split" / "model.safetensors").exists()
    second = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "split")
    assert second.maybe_resume() and second.step == k
    assert second.sched.get_last_lr() == first.sched.get_last_lr()
    second.train(progress=False)
    assert second.step == whole.step == 2 * k
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(whole.opt.state.values(), second.opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def _lrs(tcfg: TrainConfig, frozen, data, out) -> list[float]:
    """The lr every optimizer step of the schedule uses (the schedule alone: no training needed)."""
    trainer = Trainer(draft_cfg(), tcfg, frozen, data, out)
    lrs = []
    for _ in range(trainer.total_steps):
        lrs.append(trainer.opt.param_groups[0]["lr"])
        trainer.opt.step()
        trainer.sched.step()
    return lrs


def test_a_finetune_anneals_from_a_low_lr_and_scratch_warms_up(tmp_path):
    frozen, data = _tiny_cache(tmp_path, n=8)
    lr, warmup = resolve_schedule("dflash_sglang/assets/smollm2_135m_dflash", None, None)
    assert (lr, warmup) == (FINETUNE_LR, 0.0) and FINETUNE_LR <= 2e-4
    tune = _lrs(TrainConfig(max_steps=50, lr=lr, warmup_ratio=warmup, bf16=False), frozen, data, tmp_path / "t")
    assert tune[0] == pytest.approx(FINETUNE_LR) and max(tune) == pytest.approx(FINETUNE_LR)
    assert all(b <= a for a, b in zip(tune, tune[1:])) and tune[-1] < 0.15 * FINETUNE_LR
    assert resolve_schedule("target", None, None) == (SCRATCH_LR, 0.04)
    scratch = _lrs(TrainConfig(max_steps=50, lr=SCRATCH_LR, warmup_ratio=0.04, bf16=False), frozen, data,
                   tmp_path / "s")
    assert scratch[0] < scratch[1] and max(scratch) == pytest.approx(SCRATCH_LR)
    assert resolve_schedule("some/dir", 6e-4, 0.04) == (6e-4, 0.04)  # explicit flags win (with a warning)
    with pytest.raises(ValueError, match="--warmup-ratio"):
        resolve_schedule("target", None, 1.5)


def _tiny_target_dir(tmp_path):
    from factories import save_chat_target

    return save_chat_target(tmp_path)


def test_cli_refuses_bad_recipe_flags_before_reading_the_target(tmp_path, capsys):
    from dflash_sglang.cli import main

    for flags, message in ((["--distill-weight", "2"], "--distill-weight must lie in [0, 1]"),
                           (["--distill-temperature", "0"], "--distill-temperature be > 0"),
                           (["--warmup-ratio", "1"], "--warmup-ratio in [0, 1)"),
                           (["--skip-samples", "-1"], "--skip-samples must be >= 0")):
        assert main(["train", "--target", "nowhere", "--out", str(tmp_path), *flags]) != 0
        assert message in capsys.readouterr().err


def test_cli_finetune_starts_at_the_low_lr_and_distills(tmp_path):
    """`train --init DIR` (a drafter, no optimizer state): the first step's lr is FINETUNE_LR, never a warm-up."""
    from dflash_sglang.cli import main

    target_dir, _ = _tiny_target_dir(tmp_path)
    convs = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"question number {i}"}]}
             for i in range(12)]
    data = tmp_path / "sg.json"
    data.write_text(json.dumps(convs))
    common = ["train", "--target", str(target_dir), "--data", str(data), "--num-samples", "6", "--val-samples", "2",
              "--max-new-tokens", "6", "--gen-batch-size", "4", "--num-layers", "1", "--num-features", "2",
              "--mask-token-id", "95", "--batch-size", "2", "--num-anchors", "4", "--device", "cpu", "--no-bf16",
              "--cache-dir", str(tmp_path / "cache")]
    assert main([*common, "--out", str(tmp_path / "first"), "--init", "random", "--max-steps", "2"]) == 0
    assert main([*common, "--out", str(tmp_path / "tuned"), "--init", str(tmp_path / "first"), "--max-steps", "6",
                 "--skip-prepare"]) == 0
    records = [json.loads(x) for x in (tmp_path / "tuned" / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]  # the lr after each step
    assert len(lrs) == 6 and lrs[0] <= FINETUNE_LR and all(b <= a for a, b in zip(lrs, lrs[1:]))
    summary = json.loads((tmp_path / "tuned" / "train_summary.json").read_text())
    assert summary["lr"] == FINETUNE_LR and summary["warmup_ratio"] == 0.0 and summary["distill_weight"] == 0.5
    assert "kl" in summary["final"]["val"] and math.isfinite(summary["final"]["val"]["kl"])


def test_training_prompts_are_distinct_and_skip_the_first_ones(tmp_path):
    """`--skip-samples N`: prompts after the first N train-split ones; a repeated prompt (ShareGPT's 'continue'
    parts) is kept once, and one among the skipped ones not at all."""
    from dflash_sglang.testbed.data import load_split, make_prompts
    from dflash_sglang.train.cli import _examples

    _, tok = _tiny_target_dir(tmp_path)
    texts = [f"question {i}" if i % 3 else "please continue" for i in range(30)]
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([{"id": f"c{i}_0", "conversations": [{"from": "human", "value": t}]}
                                for i, t in enumerate(texts)]))
    raw = [p.ids for p in make_prompts(load_split("train", data), tok, None)]
    args = Namespace(data=str(data), skip_samples=4, num_samples=6, val_samples=3, max_prompt_tokens=256,
                     no_regenerate=False, max_new_tokens=8)
    train, val = _examples(args, tok)
    got = [e.prompt_ids for e in train + val]
    want = []
    for ids in raw[4:]:
        if ids not in raw[:4] and ids not in want:
            want.append(ids)
    assert got == want[:9] and len(set(got)) == 9 and len(train) == 6 and len(val) == 3

