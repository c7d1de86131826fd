import pytest

from dflash_sglang.core.tree import max_tree_nodes
from dflash_sglang.core.adaptive import DEFAULT_TABLE, ENV_TABLE, AdaptivePolicy, SpecShape


@pytest.mark.parametrize("budget", [None, 1, 7, 64, 300, 2048])
@pytest.mark.parametrize("max_depth", [None, 1, 3, 7, 15])
def test_never_exceeds_budget(budget, max_depth):
    policy = AdaptivePolicy.parse(DEFAULT_TABLE, token_budget=budget, max_depth=max_depth)
    for bs in range(1, 600):
        if budget is not None and bs > budget:
            with pytest.raises(ValueError, match="token budget"):
                policy.choose(bs)
            continue
        s = policy.choose(bs)
        assert s.nodes >= 1 and s.topk >= 1
        if budget is not None:
            assert bs * s.nodes <= budget
        if max_depth is not None:
            assert s.nodes <= (max_depth + 1 if s.is_chain else max_tree_nodes(max_depth, s.topk))


def test_default_shrinks_with_concurrency():
    policy = AdaptivePolicy.parse(DEFAULT_TABLE)
    sizes = [policy.choose(bs).nodes for bs in (1, 2, 4, 8, 16, 32, 64, 128, 512)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert policy.choose(1) == SpecShape(64, 4) and policy.choose(100).is_chain


def test_env_override_and_errors(monkeypatch):
    monkeypatch.setenv(ENV_TABLE, "2:8x2,inf:1x1")
    p = AdaptivePolicy.from_env()
    assert p.choose(2) == SpecShape(8, 2) and p.choose(3) == SpecShape(1, 1)
    for bad, match in [("8:16", "cannot parse row"), ("8:16x1", "end with 'inf'"), ("inf:4x1,8:2x1", "ascend"),
                       ("inf:2x2", "bad adaptive shape")]:
        with pytest.raises(ValueError, match=match):
            AdaptivePolicy.parse(bad)
