import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash_sglang.cli import main
from factories import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _edit_config(draft, fn):
    cfg = json.loads((draft / "config.json").read_text())
    fn(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))


def _flatten(cfg):
    cfg.update(cfg.pop("dflash_config"))  # the newer z-lab layout: DFlash fields at the top level


def _drop_norm(draft):
    sd = load_file(draft / "model.safetensors")
    sd.pop("norm.weight")
    save_file(sd, str(draft / "model.safetensors"))


@pytest.mark.parametrize("layout,fmt", [(None, "zlab"), (_flatten, "zlab-flat")], ids=["zlab", "zlab-flat"])
def test_inspect_ok(pair, tmp_path, capsys, layout, fmt):
    target, draft = pair
    if layout is not None:
        draft = shutil.copytree(draft, tmp_path / "draft")
        _edit_config(draft, layout)
    assert main(["inspect", str(draft), "--target", str(target)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits_target"] and out["tensors"] == 25 and out["config"]["target_layer_ids"] == [1, 2, 3]
    assert out["format"] == out["config"]["source_format"] == fmt


@pytest.mark.parametrize(
    "mutate,match",
    [
        (_drop_norm, "model.safetensors: missing tensor 'norm.weight'"),
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-7]),
         "(truncated file)"),
        (lambda d: _edit_config(d, lambda c: c["dflash_config"].update(selector_rank=8)),
         "config.json: field 'dflash_config.selector_rank' is a DFlash2 field, but 'architectures' does not name"),
        (lambda d: _edit_config(d, lambda c: c.update(num_selector_layers=2)),
         "config.json: field 'num_selector_layers' is a feature dflash-sglang does not serve"),
    ],
    ids=["missing-tensor", "truncated", "dflash2-field", "unserved"],
)
def test_inspect_bad_checkpoint_one_line(pair, tmp_path, capsys, mutate, match):
    _, draft = pair
    bad = shutil.copytree(draft, tmp_path / "bad")
    mutate(bad)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err and str(bad) in err


def test_inspect_target_mismatch(pair, tmp_path, capsys):
    _, draft = pair
    other, _ = save_tiny_pair(tmp_path, vocab=64)
    assert main(["inspect", str(draft), "--target", str(other)]) == 2
    assert "'vocab_size'=96 does not match the target's vocab_size=64" in capsys.readouterr().err


@pytest.mark.parametrize("shape,block,controlled", [
    (["--block-size", "4"], 4, False),  # a fixed chain of 4
    (["--fixed"], 8, False),  # a fixed chain of the checkpoint's block
    (["--block-size", "4", "--tree-nodes", "12", "--tree-topk", "3"], 4, False),
    (["--block-size", "4", "--adaptive", "--adaptive-table", "2:8x2,inf:4x1"], 4, False),
    ([], 8, True),  # the default: the goodput controller (chains of 1 .. the checkpoint's block, trees), as the server
    (["--adaptive", "--block-size", "4"], 4, True),  # the controller with a longest chain of 4, as the server's flag
], ids=str)
def test_generate_json_lossless(pair, tmp_path, capsys, shape, block, controlled):
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hi", "a longer prompt here", "x"]) + "\n")
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompts-file", str(prompts),
                 "--max-new-tokens", "12", "--check-lossless", "--json",
                 "--no-chat-template", "--batch-size", "2", *shape])
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["lossless"] is True and r["first_mismatch"] is None
        assert 1 <= r["mean_accept_length"] <= block and len(r["tokens"]) == 12
        assert max(r["accept_lengths"]) <= block
        assert set(r) >= {"text", "tokens", "accept_lengths", "mean_accept_length", "lossless"}
        assert ("shapes" in r) == controlled
    if controlled:  # each batch's decode steps per shape ('4': a chain, 1 a plain step; '8x4': a tree of 8 nodes over
        # top-4): no chain longer than the block, no tree larger than it
        for batch in (records[:2], records[2:]):
            shapes = batch[0]["shapes"]
            assert all(r["shapes"] == shapes for r in batch)
            assert sum(shapes.values()) == max(len(r["accept_lengths"]) for r in batch)
            assert all(re.fullmatch(r"\d+(x[24])?", s) and int(s.split("x")[0]) <= block for s in shapes), shapes
            assert min(shapes.values()) >= 1
        first = set(records[0]["shapes"])
        assert {"1", str(block)} <= first, first  # its warm-up: the longest chain and plain steps


def test_generate_text_ends_with_the_controller_state(pair, capsys):
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "hi", "--max-new-tokens", "6",
                 "--no-chat-template", "--check-lossless"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "lossless=True" in out[0]
    # what the controller chose comes first in words once it can price shapes; its state either way. No speed ratio:
    # generate times one way once
    assert out[-1].startswith(("goodput controller: steps per shape {", "goodput controller: drafting ")), out[-1]
    assert "steps per shape {" in out[-1] and "speedup" not in out[-1] and "slower" not in out[-1], out[-1]


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--prompt", "y" * 600, "--max-new-tokens", "4"], "prompt 0 has 600 tokens"),
        (["--prompt", "hi", "--max-new-tokens", "4", "--temperature", "1", "--check-lossless"],
         "needs --temperature 0"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", "hi", "--max-new-tokens", "4", "--fixed", "--tree-nodes", "8"], "--fixed verifies a chain"),
        (["--prompt", "hi", "--max-new-tokens", "4", "--adaptive-table", "inf:4x1"], "needs --adaptive"),
        (["--prompt", "hi", "--max-new-tokens", "4", "--block-size", "1"], "--block-size must be >= 2"),
    ],
)
def test_generate_bad_input(pair, capsys, extra, match):
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--no-chat-template", *extra]) == 2
    assert match in capsys.readouterr().err


def test_bad_prompts_file(pair, tmp_path, capsys):
    target, draft = pair
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{oops\n')
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompts-file", str(f),
                 "--max-new-tokens", "2"]) == 2
    assert f"{f}:2: not valid JSON" in capsys.readouterr().err
