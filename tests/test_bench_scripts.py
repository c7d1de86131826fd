"""The benchmark scripts end to end on CPU with the SmolLM2 testbed pair, at tiny settings.

The numbers these runs produce are not performance claims (2 shared CPU cores); the tests check that each script
runs, prints the roofline first, writes its CSV/PNG, records per-request acceptance, and ends with a JSON line.
One CPU SGLang server (our DFLASH worker when the adapter is installed, else no speculation) serves both server
tests; SGLang runs in subprocesses only, with the import shims of tests/sglang_shims.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_sglang.bench.serving import pareto, recipe, roofline
from dflash_sglang.bench.serving.accept import Arm, pooled, summarize
from dflash_sglang.bench.common.datasets import jsonl_prompts

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "tests" / "sglang_shims"
CPU_SERVER_ARGS = ["--device", "cpu", "--cuda-graph-backend-prefill", "disabled", "--cuda-graph-backend-decode",
                   "disabled", "--max-total-tokens", "4096", "--max-running-requests", "2", "--skip-server-warmup"]
HAS_ADAPTER = importlib.util.find_spec("dflash_sglang.adapter") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _check_png(res: dict) -> None:
    """With matplotlib installed (CI installs it) the plot must exist; without it the scripts say so and write None."""
    if HAS_MATPLOTLIB:
        assert res["png"] and Path(res["png"]).is_file() and Path(res["png"]).stat().st_size > 1000
    else:
        assert res["png"] is None


def _run(script: str, args: list[str], env: dict | None = None, timeout: int = 600) -> tuple[list[str], dict]:
    """Run scripts/<script> with niceness; returns (stdout lines, the JSON of the last line)."""
    proc = subprocess.run(["nice", sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT,
                          env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                            f"{proc.stderr[-3000:]}")
    return lines, json.loads(lines[-1])


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    from dflash_sglang.testbed import TestbedUnavailable, default_pair

    try:
        return default_pair()
    except (TestbedUnavailable, FileNotFoundError) as e:
        pytest.skip(f"testbed pair unavailable: {e}")


@pytest.fixture(scope="module")
def sglang_env() -> dict:
    """Environment for SGLang subprocesses on CPU (the import shims on the path, as a user's); skips when SGLang's
    server or benchmark client cannot be imported (the client needs HF `datasets`: .ci/install_sglang.sh)."""
    paths = [str(SHIMS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths).rstrip(os.pathsep)}
    probe = subprocess.run([sys.executable, "-c",
                            "import sglang.srt.entrypoints.http_server, sglang.benchmark.serving"],
                           env=env, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip("SGLang server/benchmark not importable on this machine (.ci/install_sglang.sh): "
                    + (probe.stderr.strip().splitlines() or ["?"])[-1])
    return env


@pytest.fixture(scope="module")
def server(pair, sglang_env, tmp_path_factory):
    """One CPU server for the testbed pair: DFLASH with our worker if the adapter is installed."""
    from dflash_sglang.bench.common.server import Server

    target, draft = pair
    arm = "ours" if HAS_ADAPTER else "none"
    argv = ["--model-path", str(target), *CPU_SERVER_ARGS]
    env = {"PYTHONPATH": sglang_env["PYTHONPATH"]}
    if arm == "ours":
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]
        env[recipe.IMPL_ENV] = "ours"
    log = tmp_path_factory.mktemp("server") / "server.log"
    with Server(argv, env, log, startup_timeout=600) as srv:
        yield arm, srv


@pytest.mark.slow
def test_bench_accept_reference(pair, tmp_path):
    target, draft = pair
    lines, res = _run("bench_accept.py", ["--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1",
                                          "--batch-size", "2", "--temperature", "0,1", "--tree-nodes", "0,6",
                                          "--tree-topk", "2", "--out", str(tmp_path)])
    assert lines[0].startswith("Roofline") and "<- this run" in "\n".join(lines[:8])
    assert res["script"] == "bench_accept" and res["backend"] == "reference" and res["rows"]
    assert {(r["temperature"], r["tree_nodes"]) for r in res["rows"]} == {(0, 0), (0, 6), (1, 0), (1, 6)}
    for r in res["rows"]:
        assert 1 <= r["tau"] <= r["block_size"] and sum(r["hist"]) == r["steps"] > 0
        assert r["verify_tokens"] == (r["tree_nodes"] or r["block_size"])
    assert res["spec_ceiling_tok_s"] and Path(res["csv"]).is_file()
    _check_png(res)


@pytest.mark.slow
def test_bench_accept_per_category_and_block_size(pair, tmp_path):
    """A local SPEED-Bench-style JSONL with two categories: one row per category x block size, with histograms."""
    rows = [{"category": "coding", "turns": ["Write a Python function that reverses a list."]},
            {"category": "writing", "turns": ["Write a haiku about the sea."]},
            {"category": "coding", "turns": ["Explain what a hash map is."]}]
    path = tmp_path / "speed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines, res = _run("bench_accept.py", ["--dataset", "speed-bench", "--dataset-path", str(path), "--num-prompts", "1",
                                          "--max-new-tokens", "6", "--threads", "1", "--block-sizes", "4,8",
                                          "--out", str(tmp_path / "out")])
    assert lines[0].startswith("Roofline")
    got = {(r["category"], r["block_size"]) for r in res["rows"]}
    assert {("coding", 4), ("coding", 8), ("writing", 4), ("writing", 8)} <= got, got
    for r in res["rows"]:
        assert sum(r["hist"]) == r["steps"] > 0 and len(r["hist"]) <= r["block_size"]
    _check_png(res)


@pytest.mark.slow
def test_bench_pareto_on_cpu_server(pair, sglang_env, server, tmp_path):
    arm, srv = server
    target, draft = pair
    lines, res = _run("bench_pareto.py", [
        "--base-url", srv.url, "--arms", arm, "--target", str(target), "--draft", str(draft),
        "--max-running-requests", "2", "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "4",
        "--apply-chat-template", "--out", str(tmp_path)], env=sglang_env)
    assert lines[0].startswith("Roofline")
    assert res["script"] == "bench_pareto" and not res["failed"] and res["max_running_requests"] == 2
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert p["completed"] == 2 and p["tok_s_gpu"] > 0 and p["tok_s_user"] > 0
    with open(res["requests_csv"]) as f:
        reqs = list(csv.DictReader(f))
    assert len(reqs) == 4  # 2 requests x 2 points; the warmup request is not recorded
    if arm == "ours":  # per-request acceptance from meta_info: completion tokens / verify steps, bonus included
        assert all(1.0 <= float(r["accept_length"]) <= 4.0 for r in reqs)
        assert all(p["accept_len_mean"] >= 1.0 for p in res["points"])
    _check_png(res)


@pytest.mark.slow
def test_bench_pareto_launches_each_arm_with_simulated_acceptance(pair, sglang_env, tmp_path):
    """No --base-url: the script launches one server per arm itself (none, then ours), on dummy weights with a
    forced acceptance length, on SGLang's random dataset; it confirms our worker from its log and checks that
    the per-request acceptance follows the simulated mean."""
    if not HAS_ADAPTER:
        pytest.skip("the ours arm needs dflash_sglang.adapter")
    target, draft = pair
    i = CPU_SERVER_ARGS.index("--max-running-requests")  # the script passes its own, to every arm
    server_args = " ".join(CPU_SERVER_ARGS[:i] + CPU_SERVER_ARGS[i + 2:])
    lines, res = _run("bench_pareto.py", [
        "--arms", "none,ours", "--target", str(target), "--draft", str(draft), "--max-running-requests", "2",
        "--server-args", server_args, "--simulate-acc-len", "3", "--dataset", "random", "--input-len", "16",
        "--output-len", "12", "--concurrency", "2", "--num-prompts", "4", "--startup-timeout", "600",
        "--out", str(tmp_path)], env=sglang_env, timeout=1200)
    assert lines[0].startswith("Roofline")
    assert res["simulated_acc_len"] == 3 and not res["failed"] and not res["skipped"], res
    assert {p["arm"] for p in res["points"]} == {"none", "ours"}
    for p in res["points"]:
        assert p["completed"] == 4 and p["tok_s_gpu"] > 0
    assert res["arms"]["ours"]["impl_confirmed"] and res["arms"]["ours"]["simulation_honoured"]
    launches = {ln.split("]")[0][1:]: ln for ln in lines if "launch_server" in ln}
    assert "--load-format dummy" in launches["none"] and "--speculative-algorithm" not in launches["none"]
    assert "SGLANG_SIMULATE_ACC_LEN=3" in launches["ours"]
    assert "--speculative-draft-load-format dummy" in launches["ours"]
    with open(res["requests_csv"]) as f:
        ours = [float(r["accept_length"]) for r in csv.DictReader(f) if r["arm"] == "ours"]
    assert len(ours) == 4 and all(1.0 <= a <= 12 for a in ours)
    _check_png(res)


@pytest.mark.slow
def test_bench_accept_server_backend(pair, sglang_env, server, tmp_path):
    arm, srv = server
    if arm != "ours":
        pytest.skip("the server backend needs a DFLASH server (dflash_sglang.adapter is not installed)")
    target, draft = pair
    lines, res = _run("bench_accept.py", ["--backend", "server", "--base-url", srv.url, "--target", str(target),
                                          "--draft", str(draft), "--num-prompts", "2", "--max-new-tokens", "8",
                                          "--concurrency", "2", "--out", str(tmp_path)], env=sglang_env)
    assert lines[0].startswith("Roofline")
    (row,) = res["rows"]
    assert 1 <= row["tau"] <= row["block_size"] and row["steps"] > 0


@pytest.mark.slow
def test_sglang_bench_serving_on_a_dflash_server(pair, sglang_env, server, tmp_path):
    """SGLang's own benchmark client as the README runs it against a DFLASH server on the embedded pair: the dataset
    file from the one-liner (`python -m dflash_sglang.bench.common.datasets sharegpt-json`: the packaged ShareGPT JSON
    is cut off mid-record, which the client rejects), every request served, and an accept length printed."""
    arm, srv = server
    if arm != "ours":
        pytest.skip("an accept length needs a DFLASH server (dflash_sglang.adapter is not installed)")
    target, _ = pair
    path = subprocess.run([sys.executable, "-m", "dflash_sglang.bench.common.datasets", "sharegpt-json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    assert Path(path).is_file() and isinstance(json.loads(Path(path).read_text()), list), path
    proc = subprocess.run([sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url",
                           srv.url, "--dataset-name", "sharegpt", "--dataset-path", path, "--tokenizer", str(target),
                           "--num-prompts", "8", "--sharegpt-output-len", "16", "--max-concurrency", "4",
                           "--output-file", str(tmp_path / "bench_serving.jsonl")],
                          cwd=ROOT, env=sglang_env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^Successful requests: +8 *$", out, re.M), out[-3000:]  # (the client pads its columns)
    accept = re.search(r"^Accept length: +([\d.]+) *$", out, re.M)
    assert accept and float(accept[1]) >= 1.0, out[-3000:]


# ------------------------------------------------------------------ fast checks, no server


def test_bench_package_does_not_import_sglang():
    code = ("import sys, dflash_sglang.bench.serving.pareto, dflash_sglang.bench.serving.accept, "
            "dflash_sglang.bench.serving.recipe, "
            "dflash_sglang.pairs; assert not [m for m in sys.modules if m.split('.')[0] == 'sglang']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_roofline_ceilings():
    roof = roofline.for_models(roofline.GPUS["h100"], "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    assert roof.ar_tok_s == pytest.approx(3350 / 15.1)
    assert roof.spec_tok_s(6.5) == pytest.approx(6.5 * 3350 / (15.1 + roof.draft_gb))
    assert roof.spec_tok_s(1.0) < roof.ar_tok_s  # tau 1 only adds draft cost
    table = roof.table()
    assert table.splitlines()[0].startswith("Roofline") and "<- this run" in table
    cpu = roofline.hardware("cpu", cpu_bandwidth_tbs=0.02)
    assert cpu.name == "cpu" and "stated" in cpu.source and roofline.measure_cpu_bandwidth(mb=8, repeats=2) > 0
    with pytest.raises(ValueError, match="unknown hardware"):
        roofline.hardware("a100")


def test_arm_server_args_share_everything_but_the_worker():
    args = pareto.build_parser().parse_args(["--recipe", "qwen3-8b:h100", "--max-running-requests", "16",
                                             "--simulate-acc-len", "3.5"])
    ours, builtin, none = (pareto.server_args_for(args, a) for a in ("ours", "builtin", "none"))
    at = ours[0].index("--speculative-draft-attention-backend") + 1
    # The drafter's attention backend is the one flag that differs: each worker gets the backend it runs.
    builtin_backend = recipe.load("qwen3-8b").on("h100").draft_attention_backend
    assert ours[0][at] == recipe.OURS_DRAFT_BACKEND and builtin[0][at] == builtin_backend
    assert ours[0][:at] + ours[0][at + 1:] == builtin[0][:at] + builtin[0][at + 1:]
    assert ours[1]["DFLASH_SGLANG_IMPL"] == "ours" and builtin[1]["DFLASH_SGLANG_IMPL"] == "builtin"
    for argv, env in (ours, builtin):
        assert argv.count("--max-running-requests") == 1 and argv[argv.index("--max-running-requests") + 1] == "16"
        assert env["SGLANG_SIMULATE_ACC_LEN"] == "3.5" and env["SGLANG_SIMULATE_ACC_METHOD"] == "match-expected"
        assert "--speculative-draft-load-format" in argv and argv[argv.index("--load-format") + 1] == "dummy"
    assert "--speculative-algorithm" not in none[0] and "SGLANG_SIMULATE_ACC_LEN" not in none[1]


def test_ours_arm_is_skipped_on_a_recipe_table_our_worker_refuses(tmp_path):
    text = recipe.load("qwen3-coder-30b-a3b").path.read_text()
    table = text.index("\n", text.index("[hw.h100]")) + 1
    refused = tmp_path / "refused.toml"
    refused.write_text(text[:table] + 'builtin_only = "a target with recurrent layers"\n' + text[table:])
    args = pareto.build_parser().parse_args(["--recipe", f"{refused}:h100"])
    why = pareto.skip_reason(args, "ours")
    assert why is not None and "field 'builtin_only'" in why
    assert pareto.skip_reason(args, "builtin") is None
    assert pareto.skip_reason(pareto.build_parser().parse_args(["--recipe", "qwen3-8b:h100"]), "ours") is None


def test_simulated_acceptance_needs_the_declared_contract(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "dflash_sglang.adapter", types.ModuleType("dflash_sglang.adapter"))
    ok, why = pareto.ours_simulation_support()
    assert not ok and "SIMULATED_ACCEPTANCE" in why
    declared = types.ModuleType("dflash_sglang.adapter")
    declared.SIMULATED_ACCEPTANCE = True
    monkeypatch.setitem(sys.modules, "dflash_sglang.adapter", declared)
    assert pareto.ours_simulation_support() == (True, "")


def test_client_args_for_each_dataset(tmp_path):
    base = ["--target", "t", "--draft", "d", "--max-running-requests", "4"]
    speed = tmp_path / "speed.jsonl"
    speed.write_text(json.dumps({"category": "coding", "turns": ["write a sort"]}) + "\n")
    a = pareto.build_parser().parse_args(base + ["--dataset", "speed-bench", "--dataset-path", str(speed),
                                                 "--output-len", "64"])
    argv = pareto.client_args(a, "http://h:1", "t", 8, tmp_path / "o.jsonl")
    assert argv[argv.index("--dataset-name") + 1] == "speed-bench" and "--speed-bench-output-len" in argv
    assert argv[argv.index("--max-concurrency") + 1] == "8" and argv[argv.index("--num-prompts") + 1] == "256"
    a = pareto.build_parser().parse_args(base + ["--dataset", "random", "--input-len", "32", "--output-len", "8"])
    argv = pareto.client_args(a, "http://h:1", "t", 1, tmp_path / "o.jsonl")
    assert argv[argv.index("--random-input-len") + 1] == "32" and "--warmup-requests" in argv
    assert jsonl_prompts(speed)[0].category == "coding"


def test_accept_summary_invariants():
    b4, b8, tree = Arm(4), Arm(8), Arm(8, 1.0, 16)
    steps = {("math", b4): [1, 4, 4, 2, 3], ("chat", b4): [1, 1, 2], ("math", b8): [8, 1], ("math", tree): [3, 5]}
    rows = summarize("d", steps)
    for r in rows:
        assert sum(r["hist"]) == r["steps"] and len(r["hist"]) == r["block_size"] and 1 <= r["tau"] <= r["block_size"]
    pool = pooled(rows)
    assert set(pool) == {"b4 T0 chain", "b8 T0 chain", "b8 T1 tree16"}
    assert pool["b4 T0 chain"]["steps"] == 8 and pool["b4 T0 chain"]["tau"] == pytest.approx(18 / 8)
    assert pool["b4 T0 chain"]["hist"] == [3, 2, 1, 2] and pool["b8 T0 chain"]["hist"][-1] == 1
    assert [r["verify_tokens"] for r in rows if r["tree_nodes"]] == [16]


def test_count_draft_ops():
    """The eager op count of our draft pass and commit: every batch size counted; the commit is batched (the same
    op count for 2 and 8 requests, so no per-request loop crept in)."""
    _, out = _run("count_draft_ops.py", ["--batch-sizes", "2,8", "--context", "20"])
    assert [r["bs"] for r in out["rows"]] == [2, 8]
    assert all(r["draft_ops"] > 0 and r["commit_ops"] > 0 for r in out["rows"])
    assert out["rows"][0]["commit_ops"] == out["rows"][1]["commit_ops"]
    # with draft graphs, what stays eager around the replays is small and does not grow with the batch
    for row in out["rows"]:
        assert row["graph_draft_ops"] < row["draft_ops"] / 3 and row["graph_commit_ops"] < row["commit_ops"] / 5
    assert out["rows"][0]["graph_draft_ops"] == out["rows"][1]["graph_draft_ops"]


@pytest.mark.slow
def test_drafter_accuracy_of_the_shipped_drafter(pair):
    """Teacher-forced accuracy by block position on the shipped drafter's own train prompts: a trained drafter
    gets a real share of position 1 right (a random or mis-loaded one gets ~0), and accuracy falls with depth."""
    _, out = _run("drafter_accuracy.py", ["--split", "train", "--num-prompts", "4", "--max-new-tokens", "24",
                                          "--batch-size", "4", "--threads", "1"])
    acc = out["acc"]
    assert out["script"] == "drafter_accuracy" and out["prompts"] == 4 and len(acc) == 16 and acc[0] == 0.0
    assert out["labels"] > 4 * 15 and acc[1] > 0.25 and acc[1] > acc[8] and out["tau_est"] > 1.2


def test_bench_draft_block(pair, tmp_path):
    """The drafter pass by block length: one row per (draft, batch size, block), layer and head times measured, and
    with --dflash2 a derived DFlash2 draft's too, its selector walk timed."""
    lines, res = _run("bench_draft_block.py", ["--block-sizes", "2,4", "--batch-sizes", "1,2", "--context", "16",
                                               "--repeats", "2", "--threads", "1", "--dflash2", "--selector-rank", "8",
                                               "--selector-top-k", "4", "--out", str(tmp_path)])
    shapes = [(1, 2), (1, 4), (2, 2), (2, 4)]
    assert [(r["draft"], r["bs"], r["block"]) for r in res["rows"]] == [(d, *s) for d in ("dflash", "dflash2")
                                                                        for s in shapes]
    assert all(r["layers_ms"] > 0 and r["head_ms"] > 0 for r in res["rows"]) and len(lines) == 9
    assert all((r["selector_ms"] is not None and r["selector_ms"] > 0) == (r["draft"] == "dflash2")
               for r in res["rows"])
    assert (tmp_path / "dflash2" / "config.json").is_file()


def test_free_ports_lie_below_the_ephemeral_range_with_their_offsets_free(monkeypatch):
    """A server's port is chosen where no outgoing connection's local port can take it (below the ephemeral range),
    distinct, and free at every port the server derives from it: a candidate taken at any offset is passed over."""
    import socket

    from dflash_sglang.bench.common import server
    from dflash_sglang.bench.common.server import ephemeral_low, free_port, free_ports

    offsets = (0, 1, 233, 241)
    ports = free_ports(20, offsets)
    assert len(set(ports)) == 20
    assert all(10000 <= p and p + max(offsets) < ephemeral_low() for p in ports)
    for p in ports:
        for off in offsets:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + off))  # (free: raises otherwise)
    assert free_port() < ephemeral_low()
    # the candidates come in this order: the first is held at +233, the second itself, the third twice
    first, second, third = ports[:3]
    candidates = iter([first, second, third, third, ports[3]])

    class Scripted:
        def randrange(self, *_):
            return next(candidates)

    monkeypatch.setattr(server.random, "SystemRandom", Scripted)
    held = [socket.socket(), socket.socket()]
    try:
        held[0].bind(("127.0.0.1", first + 233))
        held[1].bind(("127.0.0.1", second))
        assert free_ports(2, offsets) == [third, ports[3]]
    finally:
        for sock in held:
            sock.close()
