"""The reference decoder is lossless: greedy == plain HF greedy; sampling == the target's distribution."""
import itertools
import weakref

import pytest
import torch

from dflash_sglang.core.draft.config import recurrent_layers
from dflash_sglang.core.reference import ReferenceDecoder, StepTimes
from dflash_sglang.core.shape.adaptive import AdaptivePolicy, SpecShape
from dflash_sglang.core.shape.goodput import Decision, GoodputConfig, GoodputController
from factories import (HYBRID_ARCHS, STEP_COST, draft_config_for, mixed_prompts, sampled_fit_pvalue, tiny_drafter,
                       tiny_target)

CHAINS = [dict(block=b) for b in (2, 3, 5, 8, 16)]
TREES = [dict(block=16, tree=SpecShape(n, k)) for n, k in ((8, 2), (16, 4), (32, 4))]
ADAPTIVE = [dict(block=16, policy=AdaptivePolicy.parse("2:24x3,3:8x2,inf:5x1"))]
# the goodput controller (core/shape/goodput.py), a fresh one per case: its warm-up alone runs chains of 16, 1 and 6
# rows
GOODPUT = [dict(block=16, goodput=16), dict(block=8, goodput=16)]  # the second: chains capped to the block


# HF greedy continuations per target (a module-scoped pair's target serves every spec of its module: each prompt's
# continuation computed once, not once per spec), dropped with the target
_HF_GREEDY: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def hf_greedy(target, prompt, n):
    key = (tuple(prompt), n)
    cache = _HF_GREEDY.setdefault(target, {})
    if key not in cache:
        out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        cache[key] = out[0, len(prompt):].tolist()
    return list(cache[key])


# A reduced draft vocabulary (core/draft/token_map.py): the 6 ids the llama target emits most often, as build_token_map
# picks them; its greedy outputs also hold 1 and 4, which can never be drafted.
TOKEN_MAP = (0, 2, 3, 5, 6, 7)


# (target seed, drafter seed) per architecture: vocab 8, so that a random drafter agrees with the target often enough to
# exercise partial acceptance; picked so that every block size sees rejections and long accepts (mean acceptance
# ~1.6-2 for llama / qwen3; ~1.2 for the hybrid targets, whose random Gated DeltaNet layers are less predictable)
SEEDS = {"llama": (2, 2), "qwen3": (2, 2), "gemma4": (0, 1), "qwen3_5": (3, 5), "qwen3_next": (2, 5)}


# gemma4: a Gemma 4 target (scaled embedding, soft-capped logits) with a Gemma 4-style draft (factories.GEMMA4_DRAFT)
@pytest.fixture(scope="module", params=["llama", "qwen3", "llama+token_map", "gemma4", *HYBRID_ARCHS])
def pair(request):
    arch, _, mapped = request.param.partition("+")
    target_seed, drafter_seed = SEEDS[arch]
    target = tiny_target(arch, vocab=8, seed=target_seed)
    drafter = tiny_drafter(draft_config_for(target, block_size=16), seed=drafter_seed)
    if mapped:
        drafter.token_map = torch.tensor(TOKEN_MAP)
    return target, drafter


@pytest.mark.parametrize("spec", CHAINS + TREES + ADAPTIVE + GOODPUT, ids=str)
def test_greedy_is_token_identical(pair, spec):
    target, drafter = pair
    prompts = mixed_prompts(8, lengths=(3, 9, 1, 14, 6))
    dec = ReferenceDecoder(target, drafter)
    block = spec["block"]
    times = StepTimes()
    ctrl = (GoodputController(GoodputConfig(max_nodes=spec["goodput"], max_depth=block - 1, max_topk=4))
            if "goodput" in spec else None)
    outs = dec.generate(prompts, max_new_tokens=24, block_size=block, tree=spec.get("tree"), policy=spec.get("policy"),
                        times=times, controller=ctrl, step_cost=STEP_COST)  # (the controller's choices: not the load's)
    # one timed step per batched decode step (the longest-running request took part in each)
    assert times.steps == max(len(o.accept_lengths) for o in outs) and times.verify > 0 and times.other > 0
    for prompt, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(target, prompt, 24)
        assert all(1 <= a <= block for a in out.accept_lengths)
        assert sum(out.accept_lengths) + 1 >= len(out.tokens)  # prefill emits one token, each step >= 1
    steps = [a for o in outs for a in o.accept_lengths]
    # the test only means something if both rejections and multi-token acceptances happened (a hybrid target's state
    # is rolled back at every step that rejects a draft; its random drafts are accepted less often)
    longest = 2 if recurrent_layers(target.config) else min(3, block)
    assert min(steps) == 1 and max(steps) >= longest, steps
    assert dec.plain_generate(prompts, 24) == [o.tokens for o in outs]
    if ctrl is not None:  # the controller chose the steps: several shapes, no chain past the block, all observed
        assert len(ctrl.counts) >= 2 and max(s.nodes for s in ctrl.counts if s.is_chain) <= block, ctrl.counts
        assert ctrl.steps == sum(ctrl.counts.values()) == times.steps and ctrl.cost.ready


def test_controller_observes_each_step_with_its_wall_seconds(pair, monkeypatch):
    """The controller's shapes take precedence over a policy and a tree; every step is observed after it ran, with
    its chain length, the drafts accepted per running request and its seconds from its start (before choose) to the
    next step's start: the step's bookkeeping (emitting, dropping finished requests) included, the last step's up to
    its own end. A fake clock: a step's draft/verify/accept takes 1 s, dropping finished requests 0.25 s."""
    from dflash_sglang.core import reference

    target, drafter = pair
    now = [0.0]
    monkeypatch.setattr(reference.time, "perf_counter", lambda: now[0])
    dec = ReferenceDecoder(target, drafter)
    spec_step, drop = dec._spec_step, dec._drop_finished

    def timed(fn, seconds):
        def run(*a, **k):
            now[0] += seconds
            return fn(*a, **k)
        return run

    monkeypatch.setattr(dec, "_spec_step", timed(spec_step, 1.0))
    monkeypatch.setattr(dec, "_drop_finished", timed(drop, 0.25))
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    seen = []
    observe = ctrl.observe
    monkeypatch.setattr(ctrl, "observe", lambda shape, acc, sec, ranks: (
        seen.append((shape.nodes, list(acc), sec, ranks)), observe(shape, acc, sec, ranks)))
    outs = dec.generate(mixed_prompts(8, lengths=(3, 9, 5)), 16, block_size=16, tree=SpecShape(8, 2),
                        policy=AdaptivePolicy.parse("inf:24x3"), controller=ctrl)
    steps = max(len(o.accept_lengths) for o in outs)
    per = GoodputConfig(max_nodes=16).warmup_per_shape
    warmup = [16] * per + [1] * per + [6] * per
    assert len(seen) == steps >= 4 and [n for n, _, _, _ in seen][:len(warmup)] == warmup[:steps]
    assert all(sec == 1.25 for _, _, sec, _ in seen)
    assert all(0 <= a <= n - 1 for n, acc, _, _ in seen for a in acc)
    assert [len(acc) for _, acc, _, _ in seen] == [sum(len(o.accept_lengths) > k for o in outs) for k in range(steps)]
    assert sum(len(acc) + sum(acc) for _, acc, _, _ in seen) == sum(sum(o.accept_lengths) for o in outs)
    # the drafter's ranks of the committed tokens: none for a plain step; for a chain (greedy) the accepted drafts
    # were its best tokens, and the token the target put where a draft was rejected was not
    for n, acc, _, ranks in seen:
        assert (ranks is None) == (n == 1)
        for a, path in zip(acc, ranks or []):
            assert path[:a] == [1] * a and len(path) <= min(a + 1, n)
            assert len(path) == a or path[a] > 1


def test_a_fixed_step_cost_replaces_the_clock(pair, monkeypatch):
    """With `step_cost` the controller observes each step's fixed cost at its batch size, whatever the clock says
    (here one that runs away), so its choices follow acceptance alone."""
    from dflash_sglang.core import reference

    target, drafter = pair
    ticks = iter(range(10**6))
    monkeypatch.setattr(reference.time, "perf_counter", lambda: float(next(ticks)) ** 3)
    ctrl, seen = GoodputController(GoodputConfig(max_nodes=16)), []
    observe = ctrl.observe
    monkeypatch.setattr(ctrl, "observe", lambda shape, acc, sec, ranks: (
        seen.append((shape, len(acc), sec)), observe(shape, acc, sec, ranks)))
    ReferenceDecoder(target, drafter).generate(mixed_prompts(8, lengths=(3, 9, 5)), 16, block_size=16,
                                               controller=ctrl, step_cost=STEP_COST)
    assert len(seen) >= 4 and all(sec == STEP_COST.seconds(shape, bs) for shape, bs, sec in seen), seen

def test_eos_and_max_tokens_inside_a_block(pair):
    target, drafter = pair
    prompts = mixed_prompts(8, lengths=(4, 7))
    dec = ReferenceDecoder(target, drafter)
    ref = dec.plain_generate(prompts, 30)
    eos = ref[0][5]
    outs = dec.generate(prompts, max_new_tokens=30, block_size=8, eos_token_id=eos)
    for r, o in zip(ref, outs):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert o.tokens == r[:cut]  # nothing emitted past EOS even when the block ran further
    assert [len(o.tokens) for o in dec.generate(prompts, max_new_tokens=7, block_size=16)] == [7, 7]


def _exact_joint(target, prompt, n, vocab, min_p=0.0):
    """Exact probability of every n-token continuation under the target at temperature 1 (with min-p: tokens
    under min_p x the step's largest probability dropped and the rest renormalised)."""
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            p = torch.softmax(target(ids).logits[0].double(), -1)
        p = torch.where(p >= min_p * p.amax(-1, keepdim=True), p, 0.0)
        p = p / p.sum(-1, keepdim=True)
        probs[seq] = float(torch.prod(torch.stack([p[len(prompt) - 1 + i, t] for i, t in enumerate(seq)])))
    return probs


class ScriptedController:
    """The controller interface `generate` drives (choose / observe), choosing a fixed cycle of shapes."""

    def __init__(self, shapes: list[SpecShape]) -> None:
        self.shapes, self.counts, self.cfg = shapes, {}, GoodputConfig(max_nodes=max(s.nodes for s in shapes))

    def choose(self, bs: int) -> Decision:
        shape = self.shapes[sum(self.counts.values()) % len(self.shapes)]
        return Decision(shape, "best")

    def observe(self, shape, accepted, seconds, ranks=None) -> None:
        assert ranks is None or len(ranks) == len(accepted)
        self.counts[shape] = self.counts.get(shape, 0) + 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_steps_defer_the_drafters_upkeep_without_changing_a_token_or_an_acceptance(arch, monkeypatch):
    """A plain step leaves its token's drafter context K/V pending; the next drafted step (or a finished request)
    computes them in one pass. Mixed lengths, runs of plain steps between drafted ones, requests finishing in
    between: the outputs are plain decoding's, and every step's acceptance and the drafter context at every drafted
    step are what computing the K/V at every step gives."""
    target = tiny_target(arch, vocab=8, seed=SEEDS[arch][0])
    drafter = tiny_drafter(draft_config_for(target, block_size=4), seed=SEEDS[arch][1])
    prompts = mixed_prompts(8, lengths=(3, 9, 1, 14, 6, 2), seed=3)
    shapes = [SpecShape(1, 1)] * 3 + [SpecShape(4, 1)] + [SpecShape(1, 1)] * 2 + [SpecShape(3, 1)]
    contexts: dict[bool, list] = {True: [], False: []}

    def run(defer: bool):
        dec = ReferenceDecoder(target, drafter)
        dec.defer_plain_upkeep = defer
        scores = dec._scores

        def recording(batch, *args):  # the drafter context each drafted step reads
            contexts[defer].append([(k.clone(), v.clone()) for k, v in batch.ctx_kv])
            return scores(batch, *args)

        monkeypatch.setattr(dec, "_scores", recording)
        # max_new_tokens differ per request through EOS: some finish while others still run plain steps
        return dec.generate(prompts, max_new_tokens=14, block_size=4, controller=ScriptedController(shapes),
                            eos_token_id=5)

    deferred, every_step = run(True), run(False)
    plain = ReferenceDecoder(target, drafter).plain_generate(prompts, max_new_tokens=14, eos_token_id=5)
    assert [o.tokens for o in deferred] == plain == [o.tokens for o in every_step]
    assert [o.accept_lengths for o in deferred] == [o.accept_lengths for o in every_step]
    assert any(a > 1 for o in deferred for a in o.accept_lengths)  # drafts accepted: the context matters
    assert len(contexts[True]) == len(contexts[False]) >= 3
    for mine, theirs in zip(contexts[True], contexts[False]):
        for (k, v), (k2, v2) in zip(mine, theirs):
            torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-6)


# goodput: None, or how many of a goodput controller's warm-up decisions (chains of 4, 1, 3 rows, one step each)
# are spent before the run: 0 -> a drafted step then a plain step; 1 -> a plain step then a chain of 3;
# "scripted": a tree, a plain step and a chain in turn
@pytest.mark.parametrize("arch,block,tree,token_map,min_p,goodput", [
    ("llama", 4, None, None, 0.0, None), ("qwen3", 3, None, None, 0.0, None),
    ("llama", 4, SpecShape(7, 3), None, 0.0, None),
    ("llama", 4, None, (0, 2, 3), 0.0, None), ("llama", 4, SpecShape(7, 3), (1, 2, 4), 0.0, None),
    ("llama", 4, None, None, 0.3, None), ("llama", 4, SpecShape(7, 3), None, 0.3, None),
    ("llama", 4, None, None, 0.0, 0), ("llama", 4, None, None, 0.0, 1), ("llama", 4, None, None, 0.0, "scripted"),
    # hybrid targets: each node verified from its own path's recurrent state, the accepted one committed
    ("qwen3_5", 4, None, None, 0.0, None), ("qwen3_next", 4, SpecShape(7, 3), None, 0.0, None),
    ("qwen3_5", 4, None, None, 0.0, "scripted"),
    ("gemma4", 4, None, None, 0.0, None), ("gemma4", 4, SpecShape(7, 3), None, 0.0, None),
])
def test_sampling_matches_target_distribution(arch, block, tree, token_map, min_p, goodput):
    """Sampled continuations follow the target's exact distribution, whatever the verify shape: chains, trees, a
    reduced draft vocabulary, min-p, and the goodput controller switching between drafted and plain steps."""

    vocab, n_new, n_samples = 5, 3, 12000
    target = tiny_target(arch, vocab=vocab, seed=4)
    drafter = tiny_drafter(draft_config_for(target, block_size=block), seed=5)
    if token_map is not None:  # a reduced draft vocabulary: tokens outside it are only ever sampled by the target
        drafter.token_map = torch.tensor(token_map)
    prompt = [1, 3, 2]
    exact = _exact_joint(target, prompt, n_new, vocab, min_p)
    if min_p:  # the filter must bite, or this case tests nothing min-p specific
        assert sum(v == 0 for v in exact.values()) > 0
    dec = ReferenceDecoder(target, drafter)
    # mixed lengths: padded companions in the same batch must not disturb the sampled rows
    prompts = [prompt] * n_samples + [[2] * 7, [4]]
    ctrl = None
    if goodput == "scripted":  # a tree, a plain step and a chain in turn, as the controller may mix them
        ctrl = ScriptedController([SpecShape(7, 3), SpecShape(1, 1), SpecShape(3, 1)])
    elif goodput is not None:
        ctrl = GoodputController(GoodputConfig(max_nodes=block, warmup_per_shape=1))
        for _ in range(goodput):
            ctrl.choose(1)
    outs = dec.generate(prompts, max_new_tokens=n_new, block_size=block, temperature=1.0, seed=11, tree=tree,
                        min_p=min_p, controller=ctrl)
    if ctrl is not None:  # a plain step and a drafted one both ran (most requests need two steps for 3 tokens)
        assert SpecShape(1, 1) in ctrl.counts and len(ctrl.counts) >= 2, ctrl.counts
    outs = outs[:n_samples]
    steps = [a for o in outs for a in o.accept_lengths]
    assert max(steps) >= 2  # some drafts accepted, so acceptance is actually under test
    # (nothing min-p or the target rules out is ever sampled)
    assert sampled_fit_pvalue([tuple(o.tokens) for o in outs], exact) > 1e-3


def test_top_k_top_p_sampling_stays_in_support():
    target = tiny_target("llama", vocab=8, seed=6)
    drafter = tiny_drafter(draft_config_for(target, block_size=4), seed=7)
    dec = ReferenceDecoder(target, drafter)
    outs = dec.generate([[1, 2, 3]] * 200, max_new_tokens=4, block_size=4, temperature=0.7, top_k=2, seed=3)
    plain = dec.plain_generate([[1, 2, 3]] * 200, max_new_tokens=4, temperature=0.7, top_k=2, seed=3)
    first_spec = {o.tokens[0] for o in outs}
    first_plain = {p[0] for p in plain}
    top2 = set(target(torch.tensor([[1, 2, 3]])).logits[0, -1].topk(2).indices.tolist())
    assert first_spec <= top2 and first_plain <= top2


def test_tree_mask_matches_per_path_forward(pair):
    """Every tree node's verify logits equal a plain forward over prompt + its root-to-node path (for a hybrid target:
    each node's recurrent state is its own path's, siblings never mix)."""
    from dflash_sglang.core.speculate import DraftLogits, propose
    from dflash_sglang.core.step.accept import SamplingParams

    target, drafter = pair
    dec = ReferenceDecoder(target, drafter)
    prompts = mixed_prompts(8, lengths=(5, 2, 11))
    params = SamplingParams.full(len(prompts))
    batch, _ = dec._prefill(prompts, params, None, capture=True)
    draft_logits = torch.randn(len(prompts), 15, 8, generator=torch.Generator().manual_seed(0))
    proposal = propose(batch.bonus, DraftLogits(draft_logits), SpecShape(12, 3))
    tree = proposal.tree
    assert int(tree.depth.max()) >= 3 and int((tree.parent == 0).sum(1).min()) >= 2  # branching and depth
    positions = batch.seq_len[:, None] + proposal.depth
    logits, _, _ = dec._verify(batch, proposal, positions)  # (hybrid targets: node by node, core/step/recurrent.py)
    for b, prompt in enumerate(prompts):
        for node in range(tree.tokens.shape[1]):
            path, j = [], node
            while j >= 0:
                path.append(int(tree.tokens[b, j]))
                j = int(tree.parent[b, j])
            ids = torch.tensor([prompt + [int(batch.bonus[b])] + path[::-1][1:]])
            with torch.no_grad():
                ref = target(ids).logits[0, -1]
            torch.testing.assert_close(logits[b, node], ref, rtol=1e-4, atol=1e-4)


def test_prompts_that_do_not_fit_the_context_are_refused_up_front(pair):
    """A verify writes up to a block past the last token: prompt + max_new_tokens + block must fit the target's
    max_position_embeddings (512 here); the error names the prompt and the numbers, before any decoding."""
    target, drafter = pair
    dec = ReferenceDecoder(target, drafter)
    fits, too_long = [1, 2, 3] * 10, [1, 2] * 240  # 30 and 480 tokens
    with pytest.raises(ValueError, match=r"prompt 1 has 480 tokens; with max_new_tokens=32 and block size 16 it "
                                         r"needs 528 positions, the target's context is 512"):
        dec.generate([fits, too_long], 32, block_size=16)
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        dec.generate([[]], 4)
    assert len(dec.generate([too_long], 16, block_size=16)[0].tokens) == 16  # exactly fits: 480 + 16 + 16
