"""Stages 2 and 4: DFLASH Engines against the plain Engine on the same target, greedy and sampled.

Each Engine is tests/test_sglang_e2e.py's child (its scenario: 40 greedy prompts of mixed lengths, then with `sampled`
the SAMPLED requests whose 3-token continuations are tested against the target's exact distribution), run by that
file's `run_children`, one thread per Engine so that one Engine's failure is its own row. The verdicts are the e2e
tests' own: on CPU (float32) greedy outputs identical to plain; on CUDA (bfloat16, where speculative and plain
decoding run different kernels) `assert_close_to_plain_bf16` (identical, or first leaving plain where plain's top two
tokens nearly tie); and drafts accepted at all. Sampled: on CPU `assert_target_distribution` (the target's exact
float32 distribution); on CUDA a homogeneity test against the plain CUDA Engine's own samples of the same requests
(`two_sample_pvalue`): the bf16 Engine samples from bf16 logits, whose distribution differs from the float32 one by
rounding, most at a top-p or top-k boundary, so an exact test against float32 could fail a lossless worker; plain
decoding on the same GPU is exactly the distribution a lossless worker must reproduce.

Stage 2: the controller (no shape flag), a pinned chain and a tree, each with target and draft CUDA graphs on (the
defaults) and off (`disable_cuda_graph`); on CPU the draft graphs' static buffers stand for "on". Stage 4: the
experimental features, each against plain: a DFlash2 draft (derived, testbed/dflash2.py), fp8 draft KV (the draft pool
alone where SGLang has `--speculative-draft-kv-cache-dtype`, else both pools under `--kv-cache-dtype`), the draft
window, a Gated DeltaNet hybrid target (CUDA only: SGLang's linear-attention kernels are Triton), a soft-capped Gemma
4-style draft.
"""
from __future__ import annotations

import threading
from pathlib import Path

from dflash_sglang.bench.gpu.context import Context, Table
from dflash_sglang.bench.serving.pareto import OURS_LOG_MARKER
from dflash_sglang.bench.gpu.targets import gemma4_draft, tests_importable, tiny_pair

# Per sampled comparison on CUDA (4 settings x up to 6 Engines a session): 24 x 1e-4, a 0.24% chance that a correct
# worker reads FAIL in a window, while a distribution off by a few percent of its mass still fails at 600-1000 samples
SAMPLED_P_MIN = 1e-4
ENGINE_S = {"cuda": 60.0, "cpu": 70.0}  # one wave of parallel Engines: start, scenario, shutdown (estimates)
REHEARSED = ("dflash2",)  # stage 4's features the CPU rehearsal runs
COLUMNS = ["engine", "graphs", "greedy", "sampled", "accept len", "seconds", "verdict"]


def _e2e():
    tests_importable()
    import test_sglang_e2e as e2e

    return e2e


def device_job(ctx: Context, job: dict) -> dict:
    """A job of tests/test_sglang_e2e.py run_child on this device: CUDA in bf16 with FlashInfer, the plain Engine asked
    for its top-2 logprobs (the near-tie margins)."""
    job = {"full": False, **job}
    if job["spec"]:  # dflash_sglang's loggers at DEBUG: our worker's start-up line in the log (`judge`)
        job["env"] = {**_e2e().debug_env(Path(job["root"])), **job.get("env", {})}
    if ctx.cuda:
        job.update(device="cuda", dtype="bfloat16", attention_backend="flashinfer")
        job["engine_kwargs"] = {"cuda_graph_max_bs_decode": 48, **job.get("engine_kwargs", {})}
        job.setdefault("sampled", True)  # plain too: the sampled checks compare with its samples
        if not job["spec"]:
            job["top2"] = True
    return job


def graphs_kwargs(ctx: Context, on: bool) -> dict:
    """Target and draft CUDA graphs on (SGLang's default; the draft's follow the target's) or off; on CPU the draft
    graphs' static buffers, or eager."""
    if ctx.cuda:
        return {} if on else {"disable_cuda_graph": True}
    return {"speculative_dflash_draft_graphs": "static" if on else "eager"}


def run_jobs(ctx: Context, jobs: list[dict]) -> dict[str, dict | str]:
    """Every job's result (or the failure's first line), Engines in parallel, each bounded by the budget left."""
    e2e = _e2e()
    results: dict[str, dict | str] = {}
    timeout = ctx.timeout(ENGINE_S[ctx.device])  # (later stages' reserve kept: one slow wave cannot starve them)

    def one(job: dict) -> None:
        try:
            results[job["name"]] = e2e.run_children([job], timeout=timeout, shims=not ctx.cuda)[job["name"]]
        except BaseException as e:  # pytest.fail raises a BaseException: the child failed; its log has the tail
            first = str(e).splitlines()[0] if str(e) else ""
            results[job["name"]] = (f"skipped: budget (killed at its wave's timeout, {timeout:.0f} s)"
                                    if "(timeout)" in first else f"{type(e).__name__}: {first}")

    threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def judge(ctx: Context, res: dict | str, plain: dict | str, root: Path, log: Path | None = None) -> dict:
    """One row's greedy / sampled / accept cells and verdict for a DFLASH job's result against its plain Engine's.
    `log`: the job's log, which must show our worker's start-up line (a plugin that failed to load leaves SGLang's
    builtin DFLASH serving, which would pass for ours)."""
    e2e = _e2e()
    if isinstance(res, str) and res.startswith("skipped"):
        return {"verdict": res}
    if isinstance(res, str) or isinstance(plain, str):
        return {"verdict": f"FAIL: {res if isinstance(res, str) else 'plain: ' + plain}"}
    if log is not None and OURS_LOG_MARKER not in log.read_text(errors="replace"):
        return {"verdict": f"FAIL: our worker did not start (no '{OURS_LOG_MARKER}' line in {log.name})"}
    spec, base = res["greedy"], plain["greedy"]
    same = sum(a["ids"] == b["ids"] for a, b in zip(spec, base))
    row = {"greedy": f"{same}/{len(base)} identical", "seconds": round(sum(res["timings"].values()), 1)}
    fails = []
    try:
        if ctx.cuda:
            e2e.assert_close_to_plain_bf16(spec, base)
            row["greedy"] += f", {len(e2e.bf16_divergences(spec, base))} at near-ties"
        elif same != len(base):
            fails.append(f"greedy: {len(base) - same} requests differ from plain")
    except AssertionError as e:
        fails.append(f"greedy: {str(e).splitlines()[0][:120]}")
    steps = sum(r["meta"].get("spec_verify_ct", 0) for r in spec)
    row["accept len"] = round(sum(r["meta"]["completion_tokens"] for r in spec) / max(steps, 1), 2)
    if steps >= len(spec) * (e2e.GREEDY_NEW - 1):
        fails.append("no draft was accepted (the comparison means little)")
    sampled = []
    for key, n, settings in e2e.SAMPLED:
        if f"sampled_{key}" not in res:
            continue
        if ctx.cuda:  # against the plain CUDA Engine's own samples (module docstring: why not the CPU distribution)
            if f"sampled_{key}" not in plain:
                fails.append(f"sampled {key}: the plain Engine has no samples to compare with")
                continue
            p = two_sample_pvalue(res[f"sampled_{key}"], plain[f"sampled_{key}"])
            ok = p > SAMPLED_P_MIN
            sampled.append(f"{key} p={p:.2g}")
            if not ok:
                fails.append(f"sampled {key}: differs from plain's samples (homogeneity p = {p:.2g})")
            continue
        try:
            e2e.assert_target_distribution(res[f"sampled_{key}"], root, n, settings)
            sampled.append(f"{key} ok")
        except AssertionError as e:
            sampled.append(f"{key} FAIL")
            fails.append(f"sampled {key}: chi-square {str(e)[:60]}")
    row["sampled"] = ", ".join(sampled) if sampled else "-"
    row["verdict"] = "FAIL: " + "; ".join(fails) if fails else "pass"
    return row


def two_sample_pvalue(a: list[list[int]], b: list[list[int]]) -> float:
    """The chi-square homogeneity test's p-value that two sets of sampled continuations come from one distribution
    (a 2 x K table over the continuations seen; those whose expected count is under 5 in either row pooled into one
    cell, dropped if that cell is itself that small)."""
    import torch

    cats = sorted({tuple(s) for s in a} | {tuple(s) for s in b})
    counts = torch.tensor([[sum(tuple(s) == c for s in side) for c in cats] for side in (a, b)], dtype=torch.float64)
    n_rows, n = counts.sum(1, keepdim=True), counts.sum()
    expected = n_rows * counts.sum(0, keepdim=True) / n
    rare = (expected < 5).any(0)
    if rare.any():
        pooled = counts[:, rare].sum(1, keepdim=True)
        counts = torch.cat([counts[:, ~rare]] + ([pooled] if (n_rows * pooled.sum() / n >= 5).all() else []), 1)
        n_rows, n = counts.sum(1, keepdim=True), counts.sum()
        expected = n_rows * counts.sum(0, keepdim=True) / n
    dof = counts.shape[1] - 1
    if dof < 1:
        return 1.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def stage_identity(ctx: Context) -> Table:
    """Stage 2: the controller, a pinned chain and a tree, graphs on and off, against plain."""
    e2e = _e2e()
    table = Table("Stage 2: SGLang Engine on " + ctx.device + ": DFLASH vs plain", COLUMNS)
    root = tiny_pair(ctx.work / "pair", 256 if ctx.cuda else 32)
    modes = {"controller": {"env": e2e.FIXED_COST}, "chain": {"block": e2e.BLOCK},
             "tree": {"block": e2e.TREE_NODES, "topk": e2e.TREE_TOPK}}
    cells = [(m, on) for m in modes for on in (True, False)]
    if not ctx.cuda:  # the rehearsal: the controller alone (the CPU e2e suite runs every mode against plain)
        cells = [("controller", True)]
    jobs = [device_job(ctx, dict(name="plain", root=str(root), spec=False, out=str(root / "plain.json")))]
    for mode, on in cells:
        name = f"{mode}_{'graphs' if on else 'eager'}"
        jobs.append(device_job(ctx, dict(name=name, root=str(root), spec=True, out=str(root / f"{name}.json"),
                                         **modes[mode], engine_kwargs=graphs_kwargs(ctx, on))))
    if not ctx.budget.fits(ENGINE_S[ctx.device]):
        table.add(engine="all", verdict=ctx.budget.skip_reason(ENGINE_S[ctx.device]))
        return table
    results = run_jobs(ctx, jobs)
    ctx.cache["plain"] = results["plain"]
    for mode, on in cells:
        name = f"{mode}_{'graphs' if on else 'eager'}"
        table.add(engine=mode, graphs="on" if on else "off",
                  **judge(ctx, results[name], results["plain"], root, root / f"{name}.log"))
    table.notes.append(f"tiny llama pair (vocab {e2e.VOCAB}, block {e2e.BLOCK}), {len(e2e.greedy_prompts())} greedy "
                       f"prompts x {e2e.GREEDY_NEW} tokens" + (", bf16, FlashInfer" if ctx.cuda else ", float32"))
    return table


def stage_experimental(ctx: Context) -> Table:
    """Stage 4: each experimental feature against plain (on the same target and KV settings)."""
    e2e = _e2e()
    hidden = 256 if ctx.cuda else 32
    table = Table("Stage 4: experimental features vs plain (" + ctx.device + ")", ["feature"] + COLUMNS[2:])
    root = tiny_pair(ctx.work / "pair", hidden)
    experimental = {"speculative_dflash_experimental": True}
    static = {} if ctx.cuda else {"speculative_dflash_draft_graphs": "static"}
    cells: dict[str, tuple[dict, str, Path]] = {  # feature -> (job, its plain job's name, its target root)
        "dflash2": (dict(draft=str(e2e.write_dflash2_draft(root)), env=e2e.FIXED_COST,
                         engine_kwargs={**experimental, **static}), "plain", root),
        "gemma4_draft": (dict(draft=str(gemma4_draft(root, hidden)), block=e2e.BLOCK,
                              engine_kwargs=dict(experimental)), "plain", root),
        "window": (dict(block=e2e.BLOCK, chunk=32, engine_kwargs={"speculative_draft_window_size": e2e.BLOCK,
                                                                  "disable_radix_cache": True}), "plain", root),
    }
    fp8 = {job["name"]: job for job in e2e.fp8_jobs(root)}
    if "fp8_draft" in fp8:  # the draft pool alone (0.5.18 on)
        cells["fp8_draft_kv"] = (dict(block=e2e.BLOCK, engine_kwargs=fp8["fp8_draft"]["engine_kwargs"]), "plain", root)
    else:  # 0.5.17: both pools under --kv-cache-dtype, against plain with the same target KV
        cells["fp8_kv"] = (dict(block=e2e.BLOCK, engine_kwargs=fp8["fp8_kv"]["engine_kwargs"]), "fp8_plain", root)
    if not ctx.cuda:  # the rehearsal: one feature (tests/test_sglang_e2e.py runs DFlash2, fp8 and the window on CPU)
        for name in [n for n in cells if n not in REHEARSED]:
            table.add(feature=name, verdict="skipped: the CPU rehearsal runs " + " and ".join(REHEARSED))
            del cells[name]
    if ctx.cuda:
        hybrid = tiny_pair(ctx.work / "hybrid", hidden, arch="qwen3_5")
        cells["hybrid_chain"] = (dict(block=e2e.BLOCK, engine_kwargs=dict(experimental)), "hybrid_plain", hybrid)
        cells["hybrid_tree"] = (dict(block=e2e.TREE_NODES, topk=e2e.TREE_TOPK, engine_kwargs=dict(experimental)),
                                "hybrid_plain", hybrid)
    else:
        table.add(feature="hybrid (Gated DeltaNet)",
                  verdict="skipped: needs CUDA (SGLang's linear attention is Triton)")
    plains = {"plain": (root, {}), "fp8_plain": (root, fp8.get("fp8_kv_plain", {}).get("engine_kwargs", {})),
              "hybrid_plain": (ctx.work / "hybrid", {})}
    jobs, wanted = [], {plain for _, plain, _ in cells.values()}
    for name in wanted - ({"plain"} if isinstance(ctx.cache.get("plain"), dict) else set()):
        proot, kwargs = plains[name]
        jobs.append(device_job(ctx, dict(name=name, root=str(proot), spec=False, out=str(proot / f"{name}.json"),
                                         engine_kwargs=dict(kwargs))))
    for name, (job, _, troot) in cells.items():
        jobs.append(device_job(ctx, dict(name=name, root=str(troot), spec=True, out=str(troot / f"{name}.json"),
                                         **job)))
    if not ctx.budget.fits(ENGINE_S[ctx.device]):
        table.add(feature="all", verdict=ctx.budget.skip_reason(ENGINE_S[ctx.device]))
        return table
    results = {"plain": ctx.cache.get("plain"), **run_jobs(ctx, jobs)}
    for name, (_, plain, troot) in cells.items():
        table.add(feature=name, **judge(ctx, results[name], results[plain], troot, troot / f"{name}.log"))
    return table
