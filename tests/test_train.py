"""Training recipe on a tiny random Llama target: the mask, the loss weights, loss decrease, resume, export."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dflash_sglang.core.draft.checkpoint import load_drafter  # noqa: E402
from dflash_sglang.core.draft.config import DraftConfig  # noqa: E402
from dflash_sglang.core.draft.drafter import DFlashDrafter  # noqa: E402
from dflash_sglang.train.objective import (  # noqa: E402
    all_anchors, block_loss_terms, build_block_batch, loss_gamma, position_weights, sample_anchors,
)
from dflash_sglang.train.prepare import Example, build_cache, forward_features, generate_with_features  # noqa: E402
from dflash_sglang.train.shards import Sequence_, load_cache  # noqa: E402
from dflash_sglang.train.trainer import FrozenTarget, TrainConfig, Trainer  # noqa: E402

VOCAB, HIDDEN, MASK_ID = 97, 32, 3
LAYER_IDS = (0, 2)


def tiny_target(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg).eval()


def draft_cfg(block: int = 4) -> DraftConfig:
    return DraftConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=MASK_ID,
                       target_layer_ids=LAYER_IDS, block_size=block, num_target_layers=4)


def test_position_weights_follow_paper_decay():
    w = position_weights(16, loss_gamma(16, paper=True))
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[2:], torch.exp(-torch.arange(1, 15) / 7.0))
    assert loss_gamma(8, paper=True) == 4.0


def test_anchors_lie_in_the_response_and_leave_a_label():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=5, seq_len=12, n=100, gen=gen)
    assert a.tolist() == list(range(5, 11))  # every candidate once, sorted
    assert len(sample_anchors(5, 6, 4, gen)) == 0  # no room for a label


def test_validation_anchors_are_every_candidate_or_evenly_spaced():
    assert all_anchors(5, 12).tolist() == list(range(5, 11))  # the candidates sample_anchors draws from
    assert all_anchors(5, 6).numel() == 0
    spaced = all_anchors(10, 212, limit=5)  # 201 candidates: 10 .. 210
    assert spaced.tolist() == [10, 60, 110, 160, 210]


def test_training_mask_layout():
    tokens = torch.arange(10, 20)  # T = 10
    batch = build_block_batch([tokens], [torch.tensor([3, 6])], block_size=4, mask_token_id=MASK_ID, gamma=4.0)
    t, big_b = 10, 4
    m = batch.mask[0]
    for b, anchor in enumerate((3, 6)):
        rows = m[b * big_b : (b + 1) * big_b]
        ctx = rows[:, :t]
        assert ctx[:, :anchor].all() and not ctx[:, anchor:].any(), "context strictly before the anchor"
        own = rows[:, t + b * big_b : t + (b + 1) * big_b]
        assert own.all(), "own block, bidirectional"
        assert rows[:, t:].sum() == big_b * big_b, "no other block is visible"
    assert batch.block_ids[0].tolist() == [13, MASK_ID, MASK_ID, MASK_ID, 16, MASK_ID, MASK_ID, MASK_ID]
    assert batch.block_pos[0].tolist() == [3, 4, 5, 6, 6, 7, 8, 9]
    assert batch.labels[0].tolist() == [13, 14, 15, 16, 16, 17, 18, 19]  # token at anchor + k
    assert batch.weights[0, 0] == 0 and batch.weights[0, 4] == 0 and (batch.weights[0, [1, 2, 3]] > 0).all()


def _block_batch_loop(tokens, anchors, big_b, mask_id, gamma):
    """The per-block definition build_block_batch vectorises (its earlier implementation)."""
    bs, t_max, n_max = len(tokens), max(len(t) for t in tokens), max(1, max(len(a) for a in anchors))
    q, w_pos, k = n_max * big_b, position_weights(big_b, gamma), torch.arange(big_b)
    block_ids = torch.full((bs, q), mask_id, dtype=torch.long)
    block_pos, labels = torch.zeros(bs, q, dtype=torch.long), torch.zeros(bs, q, dtype=torch.long)
    weights, mask = torch.zeros(bs, q), torch.zeros(bs, q, t_max + q, dtype=torch.bool)
    for r, (tok, anc) in enumerate(zip(tokens, anchors)):
        for b, a in enumerate(anc.tolist()):
            sl, pos = slice(b * big_b, (b + 1) * big_b), a + k
            inside = pos < len(tok)
            block_ids[r, b * big_b] = tok[a]
            block_pos[r, sl] = pos
            labels[r, sl] = torch.where(inside, tok[pos.clamp_max(len(tok) - 1)], 0)
            weights[r, sl] = w_pos * inside
            mask[r, sl, :a] = True
            mask[r, sl, t_max + b * big_b: t_max + (b + 1) * big_b] = True
        for b in range(len(anc), n_max):
            mask[r, b * big_b: (b + 1) * big_b, t_max + b * big_b] = True
    return block_ids, block_pos, labels, weights, mask


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_block_batch_equals_the_per_block_definition(seed):
    """Mixed lengths, anchor counts 0..n (unused slots), anchors near the end (labels past the sequence end)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(4, VOCAB, (int(n),), generator=gen) for n in torch.randint(3, 40, (5,), generator=gen)]
    anchors = [sample_anchors(int(torch.randint(0, len(t), (1,), generator=gen)), len(t), int(n), gen)
               for t, n in zip(tokens, torch.randint(0, 9, (5,), generator=gen))]
    got = build_block_batch(tokens, anchors, 4, MASK_ID, 2.5)
    want = _block_batch_loop(tokens, anchors, 4, MASK_ID, 2.5)
    for name, g, w in zip(("block_ids", "block_pos", "labels", "weights", "mask"),
                          (got.block_ids, got.block_pos, got.labels, got.weights, got.mask), want):
        assert torch.equal(g, w), name
    assert torch.equal(got.ctx_pos[0], torch.arange(max(len(t) for t in tokens)))


def test_block_outputs_ignore_future_context_and_other_blocks():
    """Through the real drafter: block b's outputs depend on nothing the mask hides."""
    torch.manual_seed(0)
    cfg = draft_cfg()
    model = DFlashDrafter(cfg).eval()
    tokens = torch.randint(4, VOCAB, (12,))
    batch = build_block_batch([tokens], [torch.tensor([4, 8])], 4, MASK_ID, 4.0)
    emb = torch.nn.Embedding(VOCAB, HIDDEN)
    feats = torch.randn(1, 12, HIDDEN * len(LAYER_IDS))

    def block0(feats, block_ids):
        with torch.no_grad():
            kv = model.context_kv(model.fuse(feats), batch.ctx_pos)
            h = model(emb(block_ids), batch.block_pos, kv, batch.ctx_pos, mask=batch.mask)
        return h[0, :4]

    base = block0(feats, batch.block_ids)
    f2 = feats.clone()
    f2[:, 4:] = torch.randn_like(f2[:, 4:])  # the anchor's own feature and everything after it
    ids2 = batch.block_ids.clone()
    ids2[0, 4] = (ids2[0, 4] + 1) % VOCAB  # the other block's anchor token
    assert torch.allclose(block0(f2, ids2), base, atol=1e-5)
    f3 = feats.clone()
    f3[:, 3] += 1.0  # the last context row before the anchor is visible
    assert not torch.allclose(block0(f3, batch.block_ids), base, atol=1e-5)


def test_generation_features_match_a_full_forward():
    target = tiny_target()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    seqs = generate_with_features(target, prompts, LAYER_IDS, max_new_tokens=6, eos_id=2)
    ref = forward_features(target, [Example(tuple(s.tokens[: s.prompt_len].tolist()),
                                            tuple(s.tokens[s.prompt_len:].tolist())) for s in seqs], LAYER_IDS, 2)
    for s, r, p in zip(seqs, ref, prompts):
        assert s.tokens[: len(p)].tolist() == p and s.prompt_len == len(p)
        assert torch.allclose(s.features[:-1].float(), r.features[:-1].float(), atol=2e-2)
        # greedy continuation equals the target's own argmax chain
        with torch.no_grad():
            nxt = target(input_ids=s.tokens[None]).logits[0].argmax(-1)
        assert torch.equal(nxt[len(p) - 1 : -1], s.tokens[len(p):])


def _tiny_cache(tmp_path, n=16):
    target = tiny_target()
    gen = torch.Generator().manual_seed(1)
    # Periodic sequences: learnable from the context features in a few dozen steps.
    examples = []
    for i in range(n):
        period = torch.randint(4, VOCAB, (3,), generator=gen).tolist()
        seq = (period * 12)[: 24 + i % 5]
        examples.append(Example(tuple(seq[:6]), tuple(seq[6:])))
    build_cache(target, examples, tmp_path / "cache", LAYER_IDS, regenerate=False, max_new_tokens=0, eos_id=2,
                batch_size=8, progress=False)
    return FrozenTarget.from_model(target), load_cache(tmp_path / "cache", LAYER_IDS)


def test_loss_terms_add_up_over_forwards(tmp_path):
    """Validation sums BlockLossTerms over chunks of sequences: two forwards give the one-forward numbers."""
    frozen, data = _tiny_cache(tmp_path, n=6)
    model = DFlashDrafter(draft_cfg()).eval()

    def terms(seqs):
        anchors = [all_anchors(s.prompt_len, len(s.tokens)) for s in seqs]
        batch = build_block_batch([s.tokens for s in seqs], anchors, 4, MASK_ID, 4.0)
        feats = torch.nn.utils.rnn.pad_sequence([s.features.float() for s in seqs], batch_first=True)
        with torch.no_grad():
            kv = model.context_kv(model.fuse(feats), batch.ctx_pos)
            h = model(frozen.embed[batch.block_ids], batch.block_pos, kv, batch.ctx_pos, mask=batch.mask)
            return block_loss_terms(h, frozen.lm_head, batch, model.logits)

    whole, parts = terms(data), terms(data[:2]) + terms(data[2:])
    assert torch.equal(whole.hits, parts.hits) and torch.equal(whole.counts, parts.counts)
    assert whole.counts[0] == 0 and whole.counts[1] == sum(len(s.tokens) - 1 - s.prompt_len for s in data)
    assert torch.allclose(whole.ce_sum, parts.ce_sum, rtol=1e-5) and torch.allclose(whole.loss, parts.loss, rtol=1e-5)


def test_held_out_validation_is_logged_and_leaves_training_unchanged(tmp_path):
    """Held-out numbers at the start, at every checkpoint and at the end; training itself is the same run."""
    frozen, data = _tiny_cache(tmp_path, n=16)
    train, held_out = data[:12], data[12:]
    tcfg = TrainConfig(epochs=20, batch_size=4, num_anchors=8, lr=5e-3, seed=0, save_every=25, bf16=False,
                       output_norm_init=1.0)
    plain = Trainer(draft_cfg(), tcfg, frozen, train, tmp_path / "plain")
    plain.train(progress=False)
    checked = Trainer(draft_cfg(), tcfg, frozen, train, tmp_path / "checked", val_data=held_out)
    last = checked.train(progress=False)
    for a, b in zip(plain.model.state_dict().values(), checked.model.state_dict().values()):
        assert torch.equal(a, b)
    records = [json.loads(line) for line in (tmp_path / "checked" / "train_log.jsonl").read_text().splitlines()]
    vals = [r for r in records if "val" in r and "loss" not in r]
    assert [r["step"] for r in vals] == [0, 25, 50, 60]
    assert last["val"] == vals[-1]["val"] and "val" not in json.loads(
        (tmp_path / "plain" / "train_log.jsonl").read_text().splitlines()[-1])
    first, end = vals[0]["val"], vals[-1]["val"]
    assert end["loss"] < 0.9 * first["loss"] and end["tau_est"] > first["tau_est"]
    labels = sum(len(s.tokens) - 1 - s.prompt_len for s in held_out)  # every anchor, block position 1
    assert end["labels"] > labels and end["acc"][0] == 0.0


@pytest.mark.parametrize("draft_vocab", [0, 24], ids=["full-vocab", "token-map"])
def test_loss_decreases_and_export_loads(tmp_path, draft_vocab):
    """Also with a reduced head (`--draft-vocab 24`: the 24 most frequent response tokens of the 39 the data
    holds, so some labels are misses); the export carries its token map."""
    from dflash_sglang.train.cli import draft_token_map

    frozen, data = _tiny_cache(tmp_path)
    token_map = draft_token_map(data, draft_vocab, VOCAB)
    # unit output norm: the tiny target's embeddings are small, so logits start small anyway
    tcfg = TrainConfig(epochs=20, batch_size=4, num_anchors=8, lr=5e-3, seed=0, save_every=1000, bf16=False,
                       output_norm_init=1.0)
    trainer = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "out", token_map=token_map)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = float(trainer.loss_on(data, gen)[0])
    trainer.train(progress=False)
    with torch.no_grad():
        after = float(trainer.loss_on(data, torch.Generator().manual_seed(0))[0])
    assert after < 0.9 * before, (before, after)
    loaded = load_drafter(tmp_path / "out")
    assert loaded.cfg.mask_token_id == MASK_ID and loaded.cfg.target_layer_ids == LAYER_IDS
    if draft_vocab:
        assert trainer.head.shape == (draft_vocab, HIDDEN) and torch.equal(loaded.token_map, token_map)
    else:
        assert trainer.head is frozen.lm_head and loaded.token_map is None


def test_reduced_head_loss_leaves_out_labels_outside_the_map_and_counts_them_as_misses():
    """block_loss_terms with a token map: CE is the restricted softmax's over the in-map labels only (weight_sum
    too), while every labelled row still counts, so accuracy is comparable with the full head's."""
    from dflash_sglang.core.draft.token_map import inverse_map, restrict_head

    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(4, VOCAB, (30,), generator=gen) for _ in range(3)]
    batch = build_block_batch(tokens, [torch.tensor([2, 9, 20])] * 3, 4, MASK_ID, 4.0)
    hidden, head = torch.randn(3, 12, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    token_map = batch.labels[batch.weights > 0].unique()[::2].contiguous()  # about half of the labels are outside
    logits_fn = lambda h, w: h @ w.t()  # noqa: E731
    full = block_loss_terms(hidden, head, batch, logits_fn)
    mapped = block_loss_terms(hidden, restrict_head(head, token_map), batch, logits_fn, inverse_map(token_map, VOCAB))
    sel = batch.weights > 0
    y, w, logits = batch.labels[sel], batch.weights[sel], hidden[sel] @ head[token_map].t()
    inside = torch.isin(y, token_map)
    assert 0 < int(inside.sum()) < len(y)
    assert torch.equal(mapped.counts, full.counts) and float(mapped.weight_sum) == pytest.approx(float(w[inside].sum()))
    ce = torch.nn.functional.cross_entropy(logits[inside], torch.searchsorted(token_map, y[inside]), reduction="none")
    assert float(mapped.ce_sum) == pytest.approx(float((ce * w[inside]).sum()), rel=1e-5)
    hits = token_map[logits.argmax(-1)] == y
    assert float(mapped.hits.sum()) == float(hits.sum()) and bool((mapped.hits <= mapped.counts).all())


def test_a_resumed_run_keeps_its_checkpoints_token_map(tmp_path):
    frozen, data = _tiny_cache(tmp_path, n=8)
    tcfg = TrainConfig(max_steps=4, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=2, bf16=False)
    first = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "out", token_map=torch.arange(4, 36))
    first.train(progress=False, time_budget_s=0.0)  # one step, checkpoint, export
    moved = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "out", token_map=torch.arange(5, 37))
    assert moved.maybe_resume() and torch.equal(moved.model.token_map, torch.arange(4, 36))
    assert moved.head.shape == (32, HIDDEN) and int(moved.label_map[4]) == 0
    for other, asked in ((torch.arange(4, 20), "16"), (None, "full")):
        with pytest.raises(ValueError, match=rf"trained with draft vocabulary 32, this run asks for {asked}"):
            Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "out", token_map=other).maybe_resume()


def test_resume_continues_the_same_run(tmp_path):
    frozen, data = _tiny_cache(tmp_path, n=10)
    data, held_out = data[:8], data[8:]
    tcfg = TrainConfig(epochs=3, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=2, bf16=False)
    full = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "full", val_data=held_out)
    full.train(progress=False)
    for killed_after in (1, 2):  # a zero time budget stops (checkpoint + export) after one step
        part = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "part", val_data=held_out)
        assert part.maybe_resume() == (killed_after > 1)
        part.train(progress=False, time_budget_s=0.0)
        assert part.step == killed_after
    resumed = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "part", val_data=held_out)
    assert resumed.maybe_resume() and resumed.step == 2
    resumed.train(progress=False)
    assert resumed.step == full.step == 6

    def val_steps(run: str) -> list[int]:
        records = map(json.loads, (tmp_path / run / "train_log.jsonl").read_text().splitlines())
        return [r["step"] for r in records if "loss" not in r]

    # The killed runs' held-out records (steps 0, 1 and 2; the second resume started at the validated step 1) and
    # the resumed run's: each step once, as in the uninterrupted run (plus the step-1 stop).
    assert val_steps("full") == [0, 2, 4, 6] and val_steps("part") == [0, 1, 2, 4, 6]
    for (n, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_sigterm_checkpoints_the_current_step_and_validation_runs_every_val_every(tmp_path, monkeypatch):
    """The standing job (scripts/train_job.sh stop, or a session's end) sends SIGTERM: the step in progress is
    finished and checkpointed, nothing is exported, the process exits 143; a resume goes on from that step with the
    saved schedule (no new warm-up). Held-out passes: at the start, every val_every steps and at the end only."""
    import os
    import signal

    import dflash_sglang.train.trainer as trainer_mod

    frozen, data = _tiny_cache(tmp_path, n=10)
    data, held_out = data[:8], data[8:]
    tcfg = TrainConfig(max_steps=8, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=1, val_every=4,
                       bf16=False, warmup_ratio=0.5)
    run = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "run", val_data=held_out)
    real_step = trainer_mod.Trainer.loss_on

    def loss_on(self, seqs, gen):  # SIGTERM arrives while step 3 runs
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, seqs, gen)

    monkeypatch.setattr(trainer_mod.Trainer, "loss_on", loss_on)
    with pytest.raises(SystemExit) as stopped:
        run.train(progress=False)
    monkeypatch.undo()
    assert stopped.value.code == 128 + signal.SIGTERM and run.step == 3
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt"))[-1] == "step_0000003.pt"
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was put back
    resumed = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "run", val_data=held_out)
    assert resumed.maybe_resume() and resumed.step == 3
    assert resumed.sched.get_last_lr()[0] == pytest.approx(run.sched.get_last_lr()[0])  # no new warm-up
    resumed.train(progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    # step 0 at the start; the resumed launch validates step 3 (its start), then 4 and 8 (val_every, the end)
    assert [r["step"] for r in records if "loss" not in r] == [0, 3, 4, 8]


def test_init_from_a_checkpoint_continues_it(tmp_path):
    """--init DIR: a new run starts from the checkpoint's weights, so its loss starts where that run ended."""
    from dflash_sglang.train.warm_start import check_init_checkpoint, load_init_weights

    frozen, data = _tiny_cache(tmp_path)
    tcfg = TrainConfig(epochs=20, batch_size=4, num_anchors=8, lr=5e-3, seed=0, save_every=1000, bf16=False,
                       output_norm_init=1.0)
    first = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "first")
    first.train(progress=False)  # exports tmp_path / "first" (bf16 weights)
    check_init_checkpoint(tmp_path / "first", draft_cfg())
    fresh = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "second")
    with torch.no_grad():
        fresh_loss = float(fresh.loss_on(data, torch.Generator().manual_seed(0))[0])
    load_init_weights(fresh.model, tmp_path / "first")
    saved = load_drafter(tmp_path / "first", dtype=torch.float32).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in fresh.model.state_dict().items())
    with torch.no_grad():
        continued = float(fresh.loss_on(data, torch.Generator().manual_seed(0))[0])
        trained = float(first.loss_on(data, torch.Generator().manual_seed(0))[0])
    assert continued < 0.9 * fresh_loss and continued == pytest.approx(trained, rel=0.05)


def test_init_checkpoint_must_be_the_trained_drafter(tmp_path):
    from dflash_sglang.core.draft.checkpoint import save_drafter
    from dflash_sglang.core.draft.config import CheckpointError
    from dflash_sglang.train.warm_start import check_init_checkpoint

    save_drafter(DFlashDrafter(draft_cfg(block=8)), tmp_path / "b8")
    with pytest.raises(CheckpointError, match=r"b8/config.json: field 'block_size'=8 but this run trains 4"):
        check_init_checkpoint(tmp_path / "b8", draft_cfg(block=4))
    with pytest.raises(CheckpointError, match="--init .*nothing: expected 'target', 'random' or a draft checkpoint"):
        check_init_checkpoint(tmp_path / "nothing", draft_cfg())


def test_warm_start_reproduces_the_next_target_layer_on_context():
    """--init target: the first draft layer's context V equals the copied target layer's own V, and the fitted
    k_norm keeps the keys at the target's scale."""
    from dflash_sglang.train.warm_start import source_layers, warm_start_from_target

    target = tiny_target()
    ids = torch.randint(4, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in LAYER_IDS], dim=-1)[0]  # [T, n_feat * H]
    model = DFlashDrafter(draft_cfg())
    assert warm_start_from_target(model, target, feats) == source_layers(4, max(LAYER_IDS), 1) == [3]
    layer = target.model.layers[3]
    with torch.no_grad():
        x = layer.input_layernorm(hs[max(LAYER_IDS) + 1][0])
        pos = torch.arange(20)[None]
        k, v = model.context_kv(model.fuse(feats[None]), pos)[0]
        v_target = layer.self_attn.v_proj(x).view(20, 2, 8).transpose(0, 1)
        assert torch.allclose(v[0], v_target, atol=1e-5)
        k_target = layer.self_attn.k_proj(x).view(20, 2, 8)
        ratio = k.pow(2).mean().sqrt() / k_target.pow(2).mean().sqrt()  # RoPE preserves norms
        assert 0.8 < float(ratio) < 1.25, float(ratio)


def test_warm_start_refuses_mismatched_shapes():
    from dflash_sglang.train.warm_start import warm_start_from_target

    cfg = DraftConfig(**{**draft_cfg().__dict__, "intermediate_size": 48})
    with pytest.raises(ValueError, match="target layer 3 mlp.gate_proj.weight"):
        warm_start_from_target(DFlashDrafter(cfg), tiny_target(), torch.randn(4, HIDDEN * len(LAYER_IDS)))


def test_time_budget_is_fitted_on_steps_after_warmup(tmp_path, monkeypatch):
    """Slow first steps (CUDA warm-up) must not shrink the schedule: the budget is fitted to the steady step time.
    Fake clock: WARMUP_STEPS steps of 1 s, then 0.1 s per step; a 10 s budget then holds 5 + 50 steps."""
    from dflash_sglang.train import trainer as trainer_mod

    frozen, data = _tiny_cache(tmp_path, n=8)
    tcfg = TrainConfig(epochs=100, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=1000, bf16=False)
    trainer = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "out")
    assert trainer.total_steps == 200
    now = [0.0]
    monkeypatch.setattr(trainer_mod, "clock", lambda: now[0])
    real_loss_on = trainer.loss_on

    def timed_loss_on(seqs, gen):
        now[0] += 1.0 if trainer.step < trainer_mod.WARMUP_STEPS else 0.1
        return real_loss_on(seqs, gen)

    monkeypatch.setattr(trainer, "loss_on", timed_loss_on)
    trainer.train(progress=False, time_budget_s=10.0)
    assert 54 <= trainer.total_steps <= 56, trainer.total_steps  # the first 10 steps' mean would give 18
    assert trainer.step == trainer.total_steps  # the schedule ended inside the budget: no hard stop


def test_cli_holds_out_the_prompts_after_the_training_ones(tmp_path, capsys):
    """`train --val-samples 3`: the 3 train-split prompts after the --num-samples ones are prepared into CACHE/val,
    never trained on, and their numbers end in train_log.jsonl and train_summary.json."""
    from dflash_sglang.cli import main
    from dflash_sglang.testbed.data import load_split, make_prompts
    from dflash_sglang.train.shards import load_cache as load

    from factories import save_chat_target

    target_dir, tok = save_chat_target(tmp_path)
    convs = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"question number {i}"},
                                                   {"from": "gpt", "value": "an answer"}]} for i in range(40)]
    data = tmp_path / "sg.json"
    data.write_text(json.dumps(convs))
    out = tmp_path / "draft"
    rc = main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--num-samples", "6",
               "--val-samples", "3", "--max-new-tokens", "6", "--gen-batch-size", "4", "--num-layers", "1",
               "--num-features", "2", "--mask-token-id", "95", "--init", "random", "--max-steps", "3",
               "--batch-size", "2", "--num-anchors", "4", "--save-every", "2", "--device", "cpu", "--no-bf16",
               "--draft-vocab", "20"])
    assert rc == 0
    assert load_drafter(out).token_map.shape == (20,)  # the 20 most frequent regenerated response tokens
    prompts = [p.ids for p in make_prompts(load_split("train", data), tok, 9)]
    trained = sorted(tuple(s.tokens[: s.prompt_len].tolist()) for s in load(out / "cache"))
    held_out = sorted(tuple(s.tokens[: s.prompt_len].tolist()) for s in load(out / "cache" / "val"))
    assert trained == sorted(prompts[:6]) and held_out == sorted(prompts[6:9])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["sequences"] == 6 and summary["held_out"] == 3 and summary["final"]["val"]["labels"] > 0
    assert summary["draft_vocab"] == 20
    steps = [r["step"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "loss" not in r]
    assert steps == [0, 2, 3]
    capsys.readouterr()
    assert main(["train", "--target", "nowhere", "--out", str(out), "--val-samples", "-1"]) != 0
    assert "--val-samples must be >= 0, got -1" in capsys.readouterr().err  # before the target is even read
    assert main(["train", "--target", "nowhere", "--out", str(out), "--draft-vocab", "-1"]) != 0
    assert "--draft-vocab must be >= 0 (0: full vocabulary), got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expect", [({"avx2", "fma"}, False), ({"avx2", "avx512_bf16"}, True),
                                           ({"amx_bf16", "avx512f"}, True), (set(), False)])
def test_bf16_autocast_only_where_the_cpu_has_bf16_instructions(monkeypatch, flags, expect):
    """Emulated bf16 (AVX2) made a CPU training step over 14x slower than fp32: auto is off there, on for GPUs."""
    from dflash_sglang.train import trainer as trainer_mod
    from dflash_sglang.train.cli import BF16_CHOICES

    monkeypatch.setattr(trainer_mod, "cpu_flags", lambda: flags)
    assert trainer_mod.bf16_pays(torch.device("cpu")) is expect
    assert trainer_mod.bf16_pays(torch.device("cuda", 0)) is True
    frozen = FrozenTarget(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    data = [Sequence_(torch.randint(0, VOCAB, (12,)), 4, torch.randn(12, len(LAYER_IDS) * HIDDEN).half())]
    for choice, want in (("auto", expect), ("on", True), ("off", False)):
        assert Trainer(draft_cfg(), TrainConfig(bf16=BF16_CHOICES[choice]), frozen, data, "unused").bf16 is want


def _script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_curve_adds_up_cpu_over_launches():
    """scripts/train_curve.py: a resumed launch's cpu_s restarts at 0; the curve keeps counting."""
    mod = _script("train_curve")
    val = {"loss": 3.0, "tau_est": 1.5, "acc": [0.0, 0.4]}
    records = [{"step": 0, "val": val}, {"step": 1, "loss": 4.0, "cpu_s": 1800.0},
               {"step": 2, "loss": 4.0, "cpu_s": 3600.0}, {"step": 2, "val": val},
               {"step": 3, "loss": 4.0, "cpu_s": 900.0}, {"step": 4, "loss": 4.0, "cpu_s": 1800.0},  # resumed
               {"step": 4, "val": {**val, "tau_est": 1.7}}]
    assert [(p["step"], p["cpu_h"], p["tau_est"]) for p in mod.curve(records)] == [(0, 0.0, 1.5), (2, 1.0, 1.5),
                                                                                  (4, 1.5, 1.7)]


def test_a_checkpoint_exports_as_the_drafter_with_its_token_map(tmp_path, capsys):
    """scripts/export_checkpoint.py: a mid-run checkpoint becomes a draft directory load_drafter reads."""
    from dflash_sglang.core.draft.checkpoint import save_drafter

    frozen, data = _tiny_cache(tmp_path, n=8)
    tcfg = TrainConfig(max_steps=4, batch_size=4, num_anchors=4, lr=1e-3, seed=0, save_every=2, bf16=False)
    trainer = Trainer(draft_cfg(), tcfg, frozen, data, tmp_path / "run", token_map=torch.arange(4, 36))
    trainer.train(progress=False, time_budget_s=0.0)  # one step, checkpoint
    save_drafter(DFlashDrafter(draft_cfg()), tmp_path / "config_only")
    export = _script("export_checkpoint")
    assert export.main([str(tmp_path / "run"), "--config", str(tmp_path / "config_only"), "--out",
                        str(tmp_path / "exported")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 1
    loaded = load_drafter(tmp_path / "exported", dtype=torch.float32)
    assert torch.equal(loaded.token_map, torch.arange(4, 36))
    for name, weight in trainer.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], weight.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert export.main([str(tmp_path / "run"), "--config", str(tmp_path / "config_only"), "--out",
                        str(tmp_path / "x"), "--step", "7"]) == 2
