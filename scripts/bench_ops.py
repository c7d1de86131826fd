"""Per-op latency of the dflash CUDA ops vs their plain-PyTorch references vs upstream SGLang kernels.

What: the per-step ops of a DFlash tree step, at batch 1..256 for one draft shape (default block 16, so D = 15
positions, top-K 4, N = 32 nodes, vocab 151936):
  tree_inputs       the verify rows' ids, positions (seq_len + depth) and KV slots for the target
  build_tree        best-first tree from the drafter's per-position top-K
  verify_greedy     greedy walk of the tree against the target's argmax
  verify_sampling   lossless sampling walk + bonus draw from the final node's residual
  verify_chain      verify_greedy on a K = 1 chain of B nodes (what upstream DFLASH verifies)
Why: each runs once per decode step between the drafter and the target forward, so its time adds straight
to the step; they should cost microseconds, and the sampling verify is bounded below by reading one V-float
row per request (the "floor" column: bs * V * 4 bytes at peak HBM bandwidth, when torch reports it).
Columns, medians over --repeats:
  kernel_us    GPU time per call: a CUDA graph replays --calls back-to-back calls (as the decode loop runs them)
  eager_us     wall time per call from Python, synchronised (argument checks + ctypes launch + kernel)
  ref_us       the core/ reference on the same tensors, synchronised
  upstream_us  SGLang's kernel for the same job when importable (named in the `upstream` column); build_tree
               has none (upstream DFLASH drafts a chain; EAGLE's tree comes from a multi-step draft).
Without CUDA only the references run (on CPU, default vocab 4096) and the header says so.
`--dispatch` also measures the per-call overhead of torch.library.custom_op vs a direct call (ops/_lib.py NOTE).
The last stdout line is JSON.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time

import torch

from dflash_sglang import ops
from dflash_sglang.core.step import block as ref_block
from dflash_sglang.core.step import tree as ref_tree


def wall_us(fn, repeats: int, cuda: bool) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def graph_us(fn, calls: int, repeats: int) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()  # warm-up: library build / Triton compile, outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def make_inputs(bs: int, a, device) -> dict:
    """Random draft outputs; targets that accept along first children (long walks: the slow case)."""
    g = torch.Generator().manual_seed(bs)
    depth = a.block - 1
    val = torch.log_softmax(torch.randn(bs, depth, 64, generator=g), -1).topk(a.topk, -1).values
    idx = torch.randint(0, a.vocab, (bs, depth, a.topk), generator=g)
    root = torch.randint(0, a.vocab, (bs,), generator=g)
    tree = ref_tree.build_tree(root, idx, val, a.nodes)
    first = tree.retrive_next_token
    argmax = torch.where(first >= 0, tree.tokens.gather(1, first.clamp_min(0)), 0)
    seq, table = torch.randint(0, 2048, (bs,), generator=g), torch.arange(bs * 4096, dtype=torch.int32).view(bs, 4096)
    loc = ref_block.build_tree_inputs(tree.tokens, tree.depth, seq, table, torch.arange(bs)).out_cache_loc
    draft = torch.randint(0, a.vocab, (bs, depth), generator=g)
    chain = ref_tree.build_tree(root, draft[..., None], torch.zeros(bs, depth, 1), a.block)
    chain_target = torch.cat([draft, root[:, None]], 1)
    chain_target = torch.where(torch.rand(bs, a.block, generator=g) < 0.9, chain_target, -1)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(seq + a.block, 0)
    x = dict(root=root, idx=idx, val=val, argmax=argmax, seq=seq, table=table, pool=torch.arange(bs), loc=loc,
             coins=torch.rand(bs, a.nodes, generator=g), u=torch.rand(bs, generator=g), chain_target=chain_target,
             kv_indptr=kv_indptr, kv_indices=torch.empty(int(kv_indptr[-1]), dtype=torch.int32))
    x = {k: v.to(device) for k, v in x.items()}
    x["tree"], x["chain"] = (ref_tree.DraftTree(*(getattr(t, f).to(device) for f in ops.tree._TREE_FIELDS),
                                                t.max_depth) for t in (tree, chain))
    probs = torch.rand(bs, a.nodes, a.vocab, device=device)  # 0.3 spread over the vocab, 0.7 on the first child
    probs *= 0.3 / probs.sum(-1, keepdim=True)
    probs.scatter_add_(2, x["argmax"][..., None], torch.full((bs, a.nodes, 1), 0.7, device=device))
    x["probs"] = probs
    return x


def upstream_calls(x: dict, a, bs: int) -> dict:
    """name -> (label, fn) for the SGLang kernels that do the same job, when importable here."""
    calls = {}
    dev = x["root"].device
    try:
        from sglang.kernels.ops.speculative import dflash as up

        cand = x["chain"].tokens  # [bonus, drafts...]: upstream's candidates layout
        acc = [torch.empty(bs, dtype=torch.int32, device=dev) for _ in range(2)]
        bonus, new_len = torch.empty(bs, dtype=torch.int64, device=dev), torch.empty(bs, dtype=torch.int64, device=dev)
        toks = torch.empty(bs, a.block, dtype=torch.int64, device=dev)
        accept_args = (cand, x["chain_target"], *acc, bonus, toks, x["seq"], new_len)
        calls["verify_chain"] = ("sglang dflash accept_bonus (triton)",
                                 lambda: up._compute_dflash_accept_bonus_triton_unchecked(*accept_args))
    except Exception as e:  # noqa: BLE001 - any import/runtime failure just means "not comparable here"
        print(f"# upstream dflash kernels unavailable: {type(e).__name__}: {e}")
    tree = x["tree"]
    predicts = torch.empty(bs * a.nodes, dtype=torch.int32, device=dev)
    accept_index = torch.empty(bs, tree.max_depth + 1, dtype=torch.int32, device=dev)
    accept_num = torch.empty(bs, dtype=torch.int32, device=dev)
    links = (tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling)
    try:
        from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_kernel_triton as vt

        calls["verify_greedy"] = ("sglang eagle verify_tree_greedy (triton)", lambda: vt[(bs,)](
            predicts, accept_index, accept_num, tree.tokens, *links, x["argmax"], batch_size=bs,
            num_speculative_tokens=tree.max_depth + 1, num_draft_tokens=a.nodes))
    except Exception as e:  # noqa: BLE001
        print(f"# upstream EAGLE tree kernels unavailable: {type(e).__name__}: {e}")
    try:
        from sgl_kernel import tree_speculative_sampling_target_only as ts

        draft_probs = torch.zeros_like(x["probs"])
        calls["verify_sampling"] = ("sgl_kernel tree_speculative_sampling_target_only", lambda: ts(
            predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=tree.tokens,
            retrive_index=links[0], retrive_next_token=links[1], retrive_next_sibling=links[2],
            uniform_samples=x["coins"], uniform_samples_for_final_sampling=x["u"], target_probs=x["probs"],
            draft_probs=draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True))
    except Exception as e:  # noqa: BLE001
        print(f"# sgl_kernel tree sampling unavailable: {type(e).__name__}: {e}")
    return calls


def op_calls(x: dict, a, backend: str) -> dict:
    """name -> zero-argument call of our op; for "cuda" the outputs are preallocated (out=) so it can be captured."""
    tree, chain = x["tree"], x["chain"]
    fns = {
        "tree_inputs": lambda **kw: ops.build_tree_inputs(tree.tokens, tree.depth, x["seq"], x["table"], x["pool"],
                                                          **kw),
        "build_tree": lambda **kw: ops.build_tree(x["root"], x["idx"], x["val"], a.nodes, **kw),
        "verify_greedy": lambda **kw: ops.verify_tree_greedy(tree, x["argmax"], x["loc"], **kw),
        "verify_sampling": lambda **kw: ops.verify_tree_sampling(tree, x["probs"], x["coins"], x["u"], x["loc"], **kw),
        "verify_chain": lambda **kw: ops.verify_tree_greedy(chain, x["chain_target"], **kw),
        # the draft pass's key rows (contexts 0..2047 + the block); its output buffer is always preallocated
        "draft_layout": lambda out=None, **kw: ops.draft_kv_indices(
            x["kv_indptr"], x["pool"], x["table"], x["table"].numel(), a.block,
            out=x["kv_indices"] if out is None else out, **kw),
    }
    if backend != "cuda":
        return {name: functools.partial(fn, backend=backend) for name, fn in fns.items()}
    return {name: functools.partial(fn, backend="cuda", out=fn(backend="cuda")) for name, fn in fns.items()}


def dispatch_overhead(repeats: int = 20000) -> dict:
    """Per-call cost of the ways a wrapper can reach a kernel launch, without the kernel."""
    x = torch.zeros(4, dtype=torch.int64)

    @torch.library.custom_op("dflash_bench::noop", mutates_args=("a",))
    def noop(a: torch.Tensor) -> None:
        pass

    def plain(a: torch.Tensor) -> None:
        pass

    getpid = ctypes.CDLL(None).getpid

    def per_call(fn) -> float:
        for _ in range(1000):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6

    return {"python_call_us": per_call(lambda: plain(x)), "custom_op_us": per_call(lambda: noop(x)),
            "ctypes_call_us": per_call(getpid)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,4,16,64,256")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--vocab", type=int, default=None, help="default 151936 on CUDA, 4096 on CPU")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    p.add_argument("--dispatch", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    a.vocab = a.vocab or (151936 if cuda else 4096)
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    name = torch.cuda.get_device_name() if cuda else "cpu (references only: no CUDA device)"
    print(f"# device: {name}; block {a.block} (D={a.block - 1}), top-K {a.topk}, N {a.nodes}, vocab {a.vocab}")
    peak = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        peak = 2 * clock * 1e3 * width / 8 if clock and width else None  # DDR: bytes/s
        print(f"# peak HBM bandwidth: {peak / 1e12:.2f} TB/s" if peak else "# peak HBM bandwidth: unknown")
    rows = []
    header = ("op", "bs", "kernel_us", "eager_us", "ref_us", "floor_us", "upstream_us")
    print(f"{header[0]:<16}" + "".join(f"{h:>{w}}" for h, w in zip(header[1:], (5, 11, 10, 10, 10, 13))) + "  upstream")
    for bs in (int(b) for b in a.batch.split(",")):
        x = make_inputs(bs, a, device)
        refs = op_calls(x, a, "reference")
        kernels = op_calls(x, a, "cuda") if cuda else {}
        upstream = upstream_calls(x, a, bs) if cuda else {}
        for op in refs:
            row = {"op": op, "bs": bs, "ref_us": wall_us(refs[op], max(3, a.repeats // 10), cuda)}
            if cuda:
                row["kernel_us"] = graph_us(kernels[op], a.calls, a.repeats)
                row["eager_us"] = wall_us(kernels[op], a.repeats, cuda)
                if peak and op == "verify_sampling":
                    row["floor_us"] = bs * a.vocab * 4 / peak * 1e6
                if op in upstream:
                    label, fn = upstream[op]
                    row["upstream"], row["upstream_us"] = label, graph_us(fn, a.calls, a.repeats)
            rows.append(row)
            f = lambda k: f"{row[k]:.1f}" if k in row else "-"  # noqa: E731
            print(f"{op:<16}{bs:>5}{f('kernel_us'):>11}{f('eager_us'):>10}{f('ref_us'):>10}{f('floor_us'):>10}"
                  f"{f('upstream_us'):>13}  {row.get('upstream', '')}")
        del x
    result = {"device": name, "block": a.block, "topk": a.topk, "nodes": a.nodes, "vocab": a.vocab, "rows": rows}
    if a.dispatch:
        result["dispatch"] = dispatch_overhead()
        print("# dispatch overhead per call: " + ", ".join(f"{k} {v:.2f}" for k, v in result["dispatch"].items()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
