"""DFlash2 drafts: the authors' drafts on random-weight checkpoints of the published layout (PyPI `dflash` 0.1.0,
DFlash2DraftModel and dflash_generate, as the oracle), and lossless in the reference decoder: greedy output identical to
plain decoding, sampled output distributed exactly as the target's, for selector chains and selector trees."""
import time
from dataclasses import replace

import pytest
import torch

from dflash_sglang.core.draft.checkpoint import load_drafter, save_drafter
from dflash_sglang.core.draft.drafter import dense_attend
from dflash_sglang.core.draft.selector import SelectorScores
from dflash_sglang.core.reference import ReferenceDecoder
from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController
from dflash_sglang.core.step.vocab_parallel import NOT_RANKED, VocabShard, local_top, merge_top
from factories import DFLASH2_DRAFT, STEP_COST, draft_config_for, mixed_prompts, sampled_fit_pvalue, tiny_drafter, \
    tiny_target
from test_reference import TOKEN_MAP, _exact_joint, hf_greedy

# a second layout: causal sliding layers then a full one (the z-lab rule when is_causal is unset), 3-tap convolutions,
# raw logits
CAUSAL_SLIDING = {**DFLASH2_DRAFT, "is_causal": None, "layer_types": ("sliding_attention", "full_attention"),
                  "output_multiplier": 1.0, "final_logit_softcapping": None,
                  "dflash2": replace(DFLASH2_DRAFT["dflash2"], conv_kernel_size=3)}
LAYOUTS = {"published": DFLASH2_DRAFT, "causal-sliding": CAUSAL_SLIDING}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def authors():
    return pytest.importorskip("dflash.model", reason="the DFlash authors' package is the oracle for DFlash2 drafts "
                                                       "(scripts/setup.sh installs dflash==0.1.0 --no-deps)")


def _both(authors, tmp, target, layout, block=8, seed=3):
    """Our drafter and the authors' DFlash2DraftModel, each loaded from one checkpoint that we wrote."""
    draft_dir = save_drafter(tiny_drafter(draft_config_for(target, block_size=block, **layout), seed=seed), tmp,
                             dtype=torch.float32)
    return load_drafter(draft_dir), authors.DFlash2DraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()


def _pass(ours, theirs, target, bs=3, ctx=10, block=8):
    """One drafter pass of both over the same context features (longer than the sliding window) and block
    [anchor, MASK x (block-1)]: (our hidden, their hidden) [bs, block-1, H] at positions 1.., the anchors [bs]."""
    g = torch.Generator().manual_seed(0)
    cfg = ours.cfg
    feats = torch.randn(bs, ctx, cfg.n_features * cfg.hidden_size, generator=g)
    ids = torch.full((bs, block), cfg.mask_token_id)
    ids[:, 0] = torch.randint(0, cfg.vocab_size - 1, (bs,), generator=g)
    embeds = target.get_input_embeddings()(ids)
    pos = torch.arange(ctx + block).expand(bs, -1)
    theirs_h = theirs(target_hidden=feats, noise_embedding=embeds, position_ids=pos)[:, 1:]
    ours_h = ours(embeds, pos[:, ctx:], ours.context_kv(ours.fuse(feats), pos[:, :ctx]), pos[:, :ctx])[:, 1:]
    return ours_h, theirs_h, ids[:, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_drafts_equal_the_authors(authors, tmp_path, layout):
    """The authors' model loads our checkpoint; the same hidden states (convolutions, windowed bidirectional or causal
    layers), the same logits (output_multiplier, soft-capping) and the same greedy walk of the selector."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    ours, theirs = _both(authors, tmp_path, target, LAYOUTS[layout])
    ours_h, theirs_h, anchor = _pass(ours, theirs, target)
    torch.testing.assert_close(ours_h, theirs_h, rtol=1e-5, atol=1e-5)
    logits = ours.logits(ours_h, target.lm_head.weight)
    torch.testing.assert_close(logits, theirs.compute_logits(theirs_h, target.lm_head), rtol=1e-5, atol=1e-5)
    walk = SelectorScores.of(ours.candidate_selector, ours_h, logits, anchor, torch.zeros(3)).walk(7)
    assert torch.equal(walk, theirs.propose(theirs_h, anchor, target.lm_head, 0.0)[0])
    assert (walk != logits.argmax(-1)).any()  # the pair term decided some drafts


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_sampled_walk_draws_from_the_authors_q(authors, tmp_path, monkeypatch, temperature):
    """Sampling, position by position, from the same q as the authors' walk given the same predecessors: their walk is
    made to draw our drafts (their candidate order is their top-k's), and each position's q over the vocabulary, zero
    outside its candidates, is compared."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    ours, theirs = _both(authors, tmp_path, target, DFLASH2_DRAFT)
    ours_h, theirs_h, anchor = _pass(ours, theirs, target)
    logits = ours.logits(ours_h, target.lm_head.weight)
    scores = SelectorScores.of(ours.candidate_selector, ours_h, logits, anchor, torch.full((3,), temperature),
                               torch.Generator().manual_seed(1))
    drafts, q = scores.walk(7), scores.chain_q(7)
    slots = torch.topk(theirs.compute_logits(theirs_h, target.lm_head), 4, dim=-1, sorted=False).indices
    draws = []

    def draw_ours(probs):  # the authors' draw at the next position: the slot of our draft among their candidates
        hit = slots[:, len(draws)] == drafts[:, len(draws), None]
        draws.append(probs)
        assert hit.any(-1).all(), "our draft is one of their candidates"
        return hit.int().argmax(-1)

    monkeypatch.setattr(authors, "_sample_probs", draw_ours)
    path, candidates, q_rows = theirs.propose(theirs_h, anchor, target.lm_head, temperature)
    assert torch.equal(path, drafts) and torch.equal(candidates, slots)
    dense = torch.zeros(2, 3, 7, 16)
    dense[0].scatter_(-1, q.tokens, q.probs)
    dense[1].scatter_(-1, candidates, q_rows)
    torch.testing.assert_close(dense[0], dense[1], rtol=1e-5, atol=1e-6)
    greedy = SelectorScores.of(ours.candidate_selector, ours_h, logits, anchor, torch.zeros(3)).walk(7)
    assert (drafts != greedy).any()  # the walk did sample


def test_acceptance_lengths_match_dflash_generate(authors, tmp_path, monkeypatch):
    """Greedy, one request at a time: the same tokens and the same accepted length at every step as the authors'
    dflash_generate, up to where it shortens its last blocks to the tokens left (our blocks keep their size)."""
    monkeypatch.setattr(authors, "_cuda_time", time.perf_counter)  # (its timer synchronises CUDA)
    target = tiny_target("qwen3", vocab=8, seed=2)
    ours, theirs = _both(authors, tmp_path, target, DFLASH2_DRAFT, seed=15)
    dec, n_new, block, compared = ReferenceDecoder(target, ours), 24, 8, []
    for prompt in mixed_prompts(8, lengths=(3, 9, 1, 14, 6)):
        stats = authors.dflash_generate(theirs, target, torch.tensor([prompt]), n_new, None, return_stats=True)
        out = dec.generate([prompt], n_new, block_size=block)[0]
        assert out.tokens == stats.output_ids[0, len(prompt):].tolist()
        start, limit = len(prompt), len(prompt) + n_new
        for ours_len, theirs_len in zip(out.accept_lengths, stats.acceptance_lengths):
            if limit - start <= block:  # their block is cut here
                break
            compared.append((ours_len, theirs_len))
            start += theirs_len
    assert all(a == b for a, b in compared), compared
    assert len(compared) >= 40 and min(a for a, _ in compared) == 1 and max(a for a, _ in compared) >= 3


@pytest.fixture(scope="module", params=["qwen3", "llama", "llama+token_map"])
def pair(request):
    arch, _, mapped = request.param.partition("+")
    target = tiny_target(arch, vocab=8, seed=2)
    drafter = tiny_drafter(draft_config_for(target, block_size=8, **DFLASH2_DRAFT), seed=15)
    if mapped:  # a reduced draft vocabulary: the selector's candidates come from its ids
        drafter.token_map = torch.tensor(TOKEN_MAP)
    return target, drafter


@pytest.mark.parametrize("spec", [dict(block=2), dict(block=3), dict(block=8), dict(block=8, tree=SpecShape(8, 2)),
                                  dict(block=8, tree=SpecShape(12, 4)), dict(block=8, goodput=16)], ids=str)
def test_greedy_is_token_identical(pair, spec):
    """Selector chains (the walk), selector trees (children scored after their parent's token) and the goodput
    controller switching between them, priced by the selector's ranks: the plain greedy tokens every time."""
    target, drafter = pair
    prompts = mixed_prompts(8, lengths=(3, 9, 1, 14, 6))
    dec = ReferenceDecoder(target, drafter)
    ctrl = (GoodputController(GoodputConfig(max_nodes=spec["goodput"], max_depth=spec["block"] - 1, max_topk=4))
            if "goodput" in spec else None)
    outs = dec.generate(prompts, 24, block_size=spec["block"], tree=spec.get("tree"), controller=ctrl,
                        step_cost=STEP_COST)
    for prompt, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(target, prompt, 24)
    steps = [a for o in outs for a in o.accept_lengths]
    assert min(steps) == 1 and max(steps) >= (2 if spec["block"] <= 3 else 3), steps  # rejections and long accepts
    if ctrl is not None:
        assert len(ctrl.counts) >= 2, ctrl.counts


# vocab 5 and 3 candidates per position: the selector never drafts two of the tokens (q is zero there)
SAMPLED = {**DFLASH2_DRAFT, "dflash2": replace(DFLASH2_DRAFT["dflash2"], selector_top_k=3)}


@pytest.mark.parametrize("arch,block,tree,min_p", [
    ("llama", 4, None, 0.0), ("qwen3", 3, None, 0.0), ("llama", 4, None, 0.3), ("llama", 4, SpecShape(7, 3), 0.0),
])
def test_sampling_matches_target_distribution(arch, block, tree, min_p):
    """Chains drafted by the selector's sampled walk, accepted against its q given each chosen predecessor, and
    selector trees (point masses): the sampled continuations follow the target's exact distribution."""
    vocab, n_new, n_samples = 5, 3, 12000
    target = tiny_target(arch, vocab=vocab, seed=4)
    drafter = tiny_drafter(draft_config_for(target, block_size=block, **SAMPLED), seed=5)
    prompt = [1, 3, 2]
    exact = _exact_joint(target, prompt, n_new, vocab, min_p)
    outs = ReferenceDecoder(target, drafter).generate([prompt] * n_samples + [[2] * 7, [4]], n_new, block_size=block,
                                                      temperature=1.0, seed=11, tree=tree, min_p=min_p)[:n_samples]
    assert max(a for o in outs for a in o.accept_lengths) >= 2
    assert sampled_fit_pvalue([tuple(o.tokens) for o in outs], exact) > 1e-3


def test_served_weight_bytes_count_the_codebooks(tmp_path):
    """What the worker loads before SGLang sizes its KV pools (adapter/draft/model.py `load_draft_weights`) and counts
    (`weight_bytes`): every tensor of the checkpoint at the model dtype, the selector's two [V, r] codebooks among
    them; random weights of the same config (--speculative-draft-load-format dummy) cost the same."""
    pytest.importorskip("sglang", reason="the SGLang adapter")
    from dflash_sglang.adapter.draft.model import load_draft_weights, weight_bytes
    from dflash_sglang.core.draft.safetensors_header import read_header

    target = tiny_target("qwen3", vocab=16, seed=2)
    cfg = draft_config_for(target, block_size=8, **DFLASH2_DRAFT)
    draft_dir = save_drafter(tiny_drafter(cfg, seed=3), tmp_path / "d2", dtype=torch.bfloat16)
    stored = sum(e.data_offsets[1] - e.data_offsets[0] for e in read_header(draft_dir / "model.safetensors"))
    books = 2 * cfg.vocab_size * cfg.dflash2.selector_rank * 2
    for dummy in (False, True):
        assert weight_bytes(load_draft_weights(draft_dir, torch.bfloat16, "cpu", dummy)) == (stored, books)
    assert weight_bytes(tiny_drafter(draft_config_for(target, block_size=8), seed=3))[1] == 0  # a DFlash v1 draft


def test_selector_ranks_follow_the_path():
    """A committed token's rank is by its score after the path's previous token: the greedy walk's tokens rank 1, a
    token that is no candidate is not ranked."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    drafter = tiny_drafter(draft_config_for(target, block_size=8, **DFLASH2_DRAFT), seed=3)
    hidden, anchor = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 5])
    logits = drafter.logits(hidden, target.lm_head.weight)
    scores = SelectorScores.of(drafter.candidate_selector, hidden, logits, anchor, torch.zeros(2))
    walk = scores.walk(7)
    assert scores.ranks(walk).eq(1).all()
    outsider = logits[:, 2].argmin(-1)  # the least likely token at position 3: never among its 4 candidates
    assert scores.ranks(torch.cat([walk[:, :2], outsider[:, None]], 1))[:, 2].eq(NOT_RANKED).all()
    second = scores.candidates.children(walk[:, 0], torch.ones(2, dtype=torch.long), 2)[0][:, 1]
    assert scores.ranks(torch.stack([walk[:, 0], second], 1))[:, 1].eq(2).all()


def test_walk_mixes_greedy_and_sampled_rows():
    """One batch, one greedy request and one sampled: the greedy row walks the argmax with a one-hot q, the sampled row
    draws each draft from its q (a distribution over the 4 candidates, the draft among them)."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    drafter = tiny_drafter(draft_config_for(target, block_size=8, **DFLASH2_DRAFT), seed=3)
    hidden = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(0)).expand(2, 7, 32)
    logits = drafter.logits(hidden, target.lm_head.weight)
    mixed = SelectorScores.of(drafter.candidate_selector, hidden, logits, torch.tensor([3, 3]),
                              torch.tensor([0.0, 1.0]), torch.Generator().manual_seed(2))
    greedy = SelectorScores.of(drafter.candidate_selector, hidden, logits, torch.tensor([3]), torch.zeros(1))
    drafts, q = mixed.walk(7), mixed.chain_q(7)
    assert torch.equal(drafts[0], greedy.walk(7)[0]) and q.probs[0].max(-1).values.eq(1).all()
    torch.testing.assert_close(q.probs[1].sum(-1), torch.ones(7))
    assert (q.of(drafts)[1] > 0).all() and (q.probs[1] < 1).all()


def test_convolutions_stay_within_a_block():
    """Blocks laid along one row (training's layout) draft as each block alone when the pass knows the block length;
    a DFlash2 drafter refuses to guess it."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    drafter = tiny_drafter(draft_config_for(target, block_size=8, **DFLASH2_DRAFT), seed=3)
    g = torch.Generator().manual_seed(0)
    ctx, blocks = torch.randn(1, 6, 32, generator=g), torch.randn(1, 16, 32, generator=g)
    ctx_pos, pos = torch.arange(6)[None], torch.cat([torch.arange(6, 14), torch.arange(6, 14)])[None]
    kv = drafter.context_kv(ctx, ctx_pos)
    mask = torch.zeros(1, 16, 22, dtype=torch.bool)
    mask[:, :, :6] = True
    mask[:, :8, 6:14] = mask[:, 8:, 14:] = True
    both = drafter(blocks, pos, kv, ctx_pos, mask=mask, block=8)
    for i in range(2):
        alone = drafter(blocks[:, 8 * i: 8 * i + 8], pos[:, :8], kv, ctx_pos)
        torch.testing.assert_close(both[:, 8 * i: 8 * i + 8], alone, rtol=1e-5, atol=1e-5)
    attends = [dense_attend(layer_kv, mask[:, None], drafter.attention, 0.5) for layer_kv in kv]
    with pytest.raises(ValueError, match="DFlash2 drafter: run_layers needs `block`"):
        drafter.run_layers(blocks, pos, attends)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mapped", [False, True], ids=["vocab", "token_map"])
def test_candidates_merged_over_vocab_shards_equal_one_process(ranks, mapped):
    """Tensor parallelism: each rank's top-k of its lm_head shard, merged (core/step/vocab_parallel.py `merge_top`, as
    adapter/scale/tp.py runs it over the ranks), gives the candidates of one process over the whole vocabulary (or token
    map) exactly, ties included (logits on a bf16-like grid), so the walk, its q and the tree are the same."""
    target = tiny_target("qwen3", vocab=16, seed=2)
    drafter = tiny_drafter(draft_config_for(target, block_size=8, **DFLASH2_DRAFT), seed=3)
    token_map = torch.tensor(TOKEN_MAP) if mapped else None
    ids = token_map if mapped else torch.arange(16)
    hidden, anchor = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 5, 1])
    logits = (drafter.logits(hidden, target.lm_head.weight[ids]) * 2).round() / 2  # [3, 7, len(ids)], ties
    per = -(-16 // ranks)

    def merged(_, k):  # what adapter/scale/tp.py DraftVocab.top_logits answers on every rank
        parts = []
        for r in range(ranks):
            inside = (ids >= r * per) & (ids < (r + 1) * per)
            shard = VocabShard(r * per, int(inside.sum()), ids[inside] if mapped else None)
            parts.append(local_top(logits[..., inside], shard, k))
        return merge_top(torch.stack([t for t, _ in parts]), torch.stack([v for _, v in parts]), k)

    temperature = torch.tensor([0.0, 0.8, 1.5])
    one, split = (SelectorScores.of(drafter.candidate_selector, hidden, logits, anchor, temperature,
                                    torch.Generator().manual_seed(4), token_map, top)
                  for top in (None, merged))
    assert torch.equal(one.candidates.tokens, split.candidates.tokens)
    assert torch.equal(one.candidates.unary, split.candidates.unary)
    assert (one.candidates.unary[..., :-1] == one.candidates.unary[..., 1:]).any()  # ties among the candidates
    assert torch.equal(one.walk(7), split.walk(7)) and torch.equal(one.chain_q(7).probs, split.chain_q(7).probs)
    trees = [s.tree(anchor, 10, 3) for s in (one, split)]
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parent, trees[1].parent)
