"""Target verify of a draft block or tree inside SGLang, and acceptance with the core rules.

The verify is SGLang's own TARGET_VERIFY forward (all rows get logits; features captured at the draft's
layer ids), planned exactly like the builtin DFLASH does it. A chain is causal over the committed prefix
plus the block. A tree passes its ancestor mask (adapter/step/tree.py): as the verify input's
`custom_mask` on GPU backends, through `TreeMaskAttention` on CPU. SGLang's torch_native backend (the CPU
path) has no TARGET_VERIFY planning: it reads the rows as an extend on top of the prefix, so we give it
those lengths, and its attention is ours (`TreeMaskAttention`, chains with their causal mask): its own extend
attention pads the query to the whole prefix.

Acceptance is core's (core/speculate.py `accept`); `sampling_params` translates SGLang's sampling state for it.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflash_sglang.core.step.accept import HostHints, SamplingParams

from .tree import TreeMaskAttention, flat_custom_mask

if TYPE_CHECKING:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker


def masked_verify_graphs(settings) -> bool:
    """Whether the target's TARGET_VERIFY CUDA graphs are captured with a custom mask: opt-in
    (`--speculative-dflash-tree-cuda-graph`), CUDA, tree rows configured (k > 1, resolved at start-up).

    SGLang captures DFLASH verify graphs without a mask on FlashInfer / Triton, so a tree verify runs eagerly unless
    the capture takes the mask buffers (the plugin's hook on `resolve_dflash_verify_mask_policy` asks for them from
    this setting). Then every verify that may replay a graph passes a mask, chains included (a lower-triangular
    tree). Not yet validated on a GPU, hence off by default.
    """
    return settings.tree_cuda_graph and settings.device.startswith("cuda") and settings.has_tree_rows


def verify_mask(tree_mask: Tensor | None, bs: int, n: int, masked_graphs: bool, device) -> Tensor | None:
    """The [bs, n, n] bool mask a verify of n rows per request passes to a GPU backend: the tree's, a chain's causal
    one when the verify graphs were captured with mask buffers, else None (a plain causal chain)."""
    return tree_mask if tree_mask is not None or not masked_graphs else _causal(bs, n, device)


def run_target_verify(
    target_worker: TpModelWorker, batch: ScheduleBatch, ids: Tensor, positions: Tensor, slots: Tensor,
    tree_mask: Tensor | None = None, masked_graphs: bool = False, eager: bool = False,
    tree_links: tuple[Tensor, Tensor] | None = None,
) -> tuple[LogitsProcessorOutput, bool]:
    """TARGET_VERIFY forward of `ids` [bs, n] (n verify rows per request) at `positions` [bs, n], writing target KV to
    `slots` [bs, n].

    `batch.seq_lens` holds the committed lengths (the rows start there). tree_mask [bs, n, n] bool (None: a
    causal chain) restricts row i to the rows it marks; the rows' KV must then sit at req_to_token columns
    seq_len .. seq_len + n - 1 in row order. Mutates batch.input_ids / spec_info / forward_mode /
    out_cache_loc the way SGLang's own verify does; the scheduler's forward isolation restores them.
    Returns (logits output with next_token_logits [bs*n, V] and hidden_states [bs*n, n_features*H],
    can_run_cuda_graph). eager: never replay a CUDA graph (forward hooks must run). tree_links: a hybrid target's
    (first child, next sibling) [bs, n] int64 for its linear layers' tree kernels (adapter/step/hybrid.py).
    """
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, n = ids.shape
    runner = target_worker.model_runner
    cpu_backend = isinstance(runner.attn_backend, TorchNativeAttnBackend)
    verify_input = DFlashVerifyInput(
        draft_token=ids.reshape(-1),
        positions=positions.reshape(-1),
        draft_token_num=n,
        custom_mask=None,  # a chain: plain causal attention
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    if tree_links is not None:  # (read by SGLang's linear-attention backend under these names)
        verify_input.retrieve_next_token, verify_input.retrieve_next_sibling = tree_links
    seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
    gpu_mask = None if cpu_backend else verify_mask(tree_mask, bs, n, masked_graphs, ids.device)
    if gpu_mask is not None:
        prefix_sum = int(seq_lens_cpu.sum()) if seq_lens_cpu is not None else int(batch.seq_lens.sum())
        verify_input.custom_mask = flat_custom_mask(batch.seq_lens, gpu_mask, prefix_sum)
    batch.out_cache_loc = slots.reshape(-1)
    # Host-side length bounds used for planning: committed prefix + the verify rows (as the builtin does).
    if seq_lens_cpu is not None:
        batch.seq_lens_cpu = seq_lens_cpu + n
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    # SGLang 0.5.17 captures the DFLASH verify CUDA graph without a custom mask, so a tree verify runs eagerly,
    # unless the graphs were captured with mask buffers (masked_verify_graphs).
    eager = eager or (tree_mask is not None and not masked_graphs)
    with _without_verify_graph(runner) if eager else contextlib.nullcontext():
        try:
            forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
        context = contextlib.nullcontext()
        if cpu_backend:
            prefix = forward_batch.seq_lens
            forward_batch.extend_prefix_lens = prefix
            forward_batch.extend_seq_lens = torch.full_like(prefix, n)
            forward_batch.seq_lens = prefix + n
            # RadixAttention calls the backend of the active ForwardContext. Chains too: SGLang's torch_native extend
            # attends a query padded to the whole prefix (an L x L attention per request and layer, most of a verify's
            # time), ours only the verify rows (n x L); one row is exactly its decode attention.
            mask = tree_mask if tree_mask is not None else _causal(bs, n, ids.device)
            masked = TreeMaskAttention(runner.attn_backend, mask, prefix, chain=tree_mask is None)
            context = forward_context(ForwardContext(attn_backend=masked))
        forward_batch.mark_forward_metadata_ready()
        with context:
            out = target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    return out.logits_output, bool(out.can_run_cuda_graph)


PLAIN_STEP_ENV = "DFLASH_PLAIN_STEP"  # "decode": plain steps as SGLang's DECODE forward (an implementation switch)


def decode_serves_plain_steps(runner, hybrid: bool, attention_dp: bool, switch: str | None = None) -> bool:
    """Whether a plain step (one row per request, no drafts) runs as SGLang's own DECODE forward rather than a verify
    of one row: only when asked (switch: `PLAIN_STEP_ENV`'s value, `verify` by default, or `decode`), and where the
    target replays no CUDA graphs (SGLang captures the target's graphs for TARGET_VERIFY in a speculative server;
    CPU, --disable-cuda-graph), its state is not recurrent (a hybrid target's state is committed per verify row) and
    no DP attention group must run the other groups' forward mode. Why the verify is the default: on CPU its one row
    runs our attention over the prefix (step/tree.py `TreeMaskAttention`), which the py-spy step profile measured at
    17.8 ms of target forward per token against 20.8 for SGLang's decode forward (docs/benchmarks.md, "The
    controller's floor"); on GPU the target's graphs are captured for the verify."""
    if switch not in (None, "", "decode", "verify"):
        raise ValueError(f"{PLAIN_STEP_ENV}={switch!r}: expected 'verify' (the default) or 'decode'")
    return (switch == "decode" and getattr(runner, "decode_cuda_graph_runner", None) is None and not hybrid
            and not attention_dp)


def run_target_decode(target_worker: TpModelWorker, batch: ScheduleBatch, ids: Tensor, slots: Tensor):
    """A plain step as plain decoding runs it: SGLang's DECODE forward of `ids` [bs, 1] (the bonus tokens) at the
    committed lengths, writing target KV to `slots` [bs, 1], the draft's target layers captured (the drafter's upkeep
    reads them), no sampling (core's acceptance samples the one row as it does any verify row). Returns the logits
    output: next_token_logits [bs, V], hidden_states [bs, n_features*H]. Mutates batch.input_ids / spec_info /
    forward_mode / out_cache_loc as `run_target_verify` does; its lengths are restored."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    committed = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum
    batch.input_ids, batch.out_cache_loc, batch.spec_info = ids.reshape(-1), slots.reshape(-1), None
    batch.forward_mode = ForwardMode.DECODE
    # a decode forward's lengths count the token it writes (its position is the committed length)
    batch.seq_lens = committed[0] + 1
    if committed[1] is not None:
        batch.seq_lens_cpu = committed[1] + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    else:
        batch.seq_lens_sum = int(batch.seq_lens.sum())
    try:
        out = target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL,
                                                     is_verify=True)  # (is_verify: no sampling)
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = committed
    return out.logits_output


def _causal(bs: int, n: int, device) -> Tensor:
    """[bs, n, n] bool: a chain's n verify rows, each attending to itself and the rows before it."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(bs, n, n)


@contextlib.contextmanager
def _without_verify_graph(runner):
    """Hide the target's decode CUDA-graph runner for one forward (prepare_for_verify and the model runner
    both replay a graph whenever it is present and able)."""
    graphs = runner.decode_cuda_graph_runner
    runner.decode_cuda_graph_runner = None
    try:
        yield
    finally:
        runner.decode_cuda_graph_runner = graphs


def grammar_rows(batch: ScheduleBatch, proposal):
    """The verify rows of a grammar-constrained batch as SGLang's `GrammarTree` (a host copy, taken before the
    verify), or None."""
    if not batch.has_grammar:
        return None
    from sglang.srt.speculative.spec_utils import GrammarTree

    tree = proposal.tree
    if tree is None:
        return GrammarTree.from_linear_chain(proposal.ids)
    return GrammarTree.from_device(tree.retrive_next_token, tree.retrive_next_sibling, tree.tokens)


def bias_and_grammar(logits: Tensor, batch: ScheduleBatch, grammar, grammar_barrier) -> None:
    """logits [bs, n, V] (penalized already) adjusted in place as plain decoding would sample from them: logit bias
    (the same at every verify row of a request), then each row of a grammar-constrained request masked by the grammar
    state its draft path reaches (`grammar`: `grammar_rows`; rows past a draft the grammar rejects stay unmasked:
    acceptance never reaches them). The scheduler advances each request's grammar by the tokens the step commits.
    (Custom logit processors are refused per request.)"""
    from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask

    sampling_info = batch.sampling_info
    bias = getattr(sampling_info, "logit_bias", None) if sampling_info is not None else None
    if bias is not None:
        logits.add_(bias[:, None, :].to(logits.dtype))
    if grammar is not None:
        flat = logits.view(-1, logits.shape[-1])
        mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar, sampling_info=sampling_info,
                                        device=flat.device, barrier=grammar_barrier)
        if mask is not None:
            mask.apply(flat)


def sampling_params(sampling_info, bs: int, reqs=None) -> SamplingParams | None:
    """SGLang's per-request SamplingBatchInfo -> core SamplingParams (min-p where a request asks for it), or None
    when every request is greedy (core's accept then takes the greedy path with no host sync). reqs: the batch's
    requests, whose host-side params give core the `HostHints` (which rows sample, whether any asks for top-p, the
    largest top-k), so a mixed batch verifies its greedy rows greedily and sorts the vocabulary only for top-p.

    SGLang encodes greedy as top_k == 1 (temperature 0 is rewritten to top_k 1) and "no top-k" as a
    huge top_k.
    """
    if sampling_info is None or sampling_info.is_all_greedy:
        return None
    hints = None
    if reqs is not None:
        vocab = sampling_info.vocab_size
        params = [r.sampling_params for r in reqs]
        hints = HostHints.of([0.0 if p.top_k <= 1 else 1.0 for p in params],  # (only greedy vs sampling matters)
                             [0 if p.top_k >= vocab else int(p.top_k) for p in params], [p.top_p for p in params],
                             sampling_info.temperatures.device)
    top_k = sampling_info.top_ks.reshape(bs).to(torch.int64)
    greedy = top_k <= 1
    vocab = sampling_info.vocab_size
    temperature = torch.where(greedy, 0.0, sampling_info.temperatures.reshape(bs).float())
    top_k = torch.where((top_k >= vocab) | greedy, 0, top_k)
    min_p = sampling_info.min_ps.reshape(bs).float() if getattr(sampling_info, "need_min_p_sampling", False) else None
    return SamplingParams(temperature, top_k, sampling_info.top_ps.reshape(bs).float(), min_p, hints)
