"""Target verify of a draft block or tree inside SGLang, and acceptance with the core rules.

The verify is SGLang's own TARGET_VERIFY forward (all rows get logits; features captured at the draft's
layer ids), planned exactly like the builtin DFLASH does it. A chain is causal over the committed prefix
plus the block. A tree passes its ancestor mask (adapter/tree_attention.py): as the verify input's
`custom_mask` on GPU backends, through `TreeMaskAttention` on CPU. SGLang's torch_native backend (the CPU
path) has no TARGET_VERIFY planning: it reads the rows as an extend on top of the prefix, so we give it
those lengths.

Acceptance is `dflash_sglang.core.accept` for a chain (greedy longest-prefix match, or lossless rejection
sampling of point-mass drafts against the target's temperature/top-k/top-p(/min-p) distribution) and the
`dflash_sglang.ops` tree verification (kernel on CUDA, core reference on CPU) for a tree.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflash_sglang import ops
from dflash_sglang.core.accept import AcceptResult, SamplingParams, greedy_accept, rejection_accept, target_probs
from dflash_sglang.core.tree import DraftTree
from dflash_sglang.core.tree_verify import TreeAcceptResult

from .tree_attention import TreeMaskAttention, flat_custom_mask

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
    return settings.tree_cuda_graph and settings.device.startswith("cuda") and settings.topk > 1


def verify_mask(tree_mask: Tensor | None, bs: int, width: int, masked_graphs: bool, device) -> Tensor | None:
    """The [bs, width, width] bool mask a verify passes to a GPU backend: the tree's, a chain's causal one when the
    verify graphs were captured with mask buffers, else None (a plain causal chain)."""
    if tree_mask is not None or not masked_graphs:
        return tree_mask
    return torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(bs, width, width)


def run_target_verify(
    target_worker: TpModelWorker, batch: ScheduleBatch, ids: Tensor, positions: Tensor, slots: Tensor,
    tree_mask: Tensor | None = None, masked_graphs: bool = False,
) -> tuple[LogitsProcessorOutput, bool]:
    """TARGET_VERIFY forward of `ids` [bs, T] at `positions` [bs, T], writing target KV to `slots` [bs, T].

    `batch.seq_lens` holds the committed lengths (the rows start there). tree_mask [bs, T, T] bool (None: a
    causal chain) restricts row i to the rows it marks; the rows' KV must then sit at req_to_token columns
    seq_len .. seq_len + T - 1 in row order. Mutates batch.input_ids / spec_info / forward_mode /
    out_cache_loc the way SGLang's own verify does; the scheduler's forward isolation restores them.
    Returns (logits output with next_token_logits [bs*T, V] and hidden_states [bs*T, n_features*H],
    can_run_cuda_graph).
    """
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, width = ids.shape
    runner = target_worker.model_runner
    cpu_backend = isinstance(runner.attn_backend, TorchNativeAttnBackend)
    verify_input = DFlashVerifyInput(
        draft_token=ids.reshape(-1),
        positions=positions.reshape(-1),
        draft_token_num=width,
        custom_mask=None,  # a chain: plain causal attention
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
    gpu_mask = None if cpu_backend else verify_mask(tree_mask, bs, width, masked_graphs, ids.device)
    if gpu_mask is not None:
        prefix_sum = int(seq_lens_cpu.sum()) if seq_lens_cpu is not None else int(batch.seq_lens.sum())
        verify_input.custom_mask = flat_custom_mask(batch.seq_lens, gpu_mask, prefix_sum)
    batch.out_cache_loc = slots.reshape(-1)
    # Host-side length bounds used for planning: committed prefix + the verify rows (as the builtin does).
    if seq_lens_cpu is not None:
        batch.seq_lens_cpu = seq_lens_cpu + width
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    # SGLang 0.5.17 captures the DFLASH verify CUDA graph without a custom mask, so a tree verify runs eagerly,
    # unless the graphs were captured with mask buffers (masked_verify_graphs).
    eager = _without_verify_graph(runner) if tree_mask is not None and not masked_graphs else contextlib.nullcontext()
    with eager:
        try:
            forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
        context = contextlib.nullcontext()
        if cpu_backend:
            prefix = forward_batch.seq_lens
            forward_batch.extend_prefix_lens = prefix
            forward_batch.extend_seq_lens = torch.full_like(prefix, width)
            forward_batch.seq_lens = prefix + width
            if tree_mask is not None:  # RadixAttention calls the backend of the active ForwardContext
                masked = TreeMaskAttention(runner.attn_backend, tree_mask, prefix)
                context = forward_context(ForwardContext(attn_backend=masked))
        forward_batch.mark_forward_metadata_ready()
        with context:
            out = target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    return out.logits_output, bool(out.can_run_cuda_graph)


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


def sampling_params(sampling_info, bs: int) -> SamplingParams | None:
    """SGLang's per-request SamplingBatchInfo -> core SamplingParams, or None when every request is greedy.

    SGLang encodes greedy as top_k == 1 (temperature 0 is rewritten to top_k 1) and "no top-k" as a
    huge top_k.
    """
    if sampling_info is None or sampling_info.is_all_greedy:
        return None
    top_k = sampling_info.top_ks.reshape(bs).to(torch.int64)
    greedy = top_k <= 1
    vocab = sampling_info.vocab_size
    temperature = torch.where(greedy, 0.0, sampling_info.temperatures.reshape(bs).float())
    top_k = torch.where((top_k >= vocab) | greedy, 0, top_k)
    return SamplingParams(temperature, top_k, sampling_info.top_ps.reshape(bs).float())


def _apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's max, renormalise. probs [bs, B, V]."""
    floor = min_p[:, None, None] * probs.amax(-1, keepdim=True)
    kept = torch.where(probs >= floor, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def verify_probs(logits: Tensor, params: SamplingParams, sampling_info=None) -> Tensor:
    """logits [bs, T, V] -> target probabilities [bs, T, V] float32 (core.accept.target_probs, then min-p)."""
    probs = target_probs(logits, params)
    if sampling_info is not None and getattr(sampling_info, "need_min_p_sampling", False):
        probs = _apply_min_p(probs, sampling_info.min_ps.reshape(-1).float())
    return probs


def accept_block(
    drafts: Tensor, logits: Tensor, params: SamplingParams | None, sampling_info=None
) -> AcceptResult:
    """drafts [bs, B-1] int64, logits [bs, B, V] (row j predicts the token after block row j).

    params None: greedy. Otherwise rejection sampling with uniforms from torch's default generator
    (seeded by SGLang's --random-seed).
    """
    if params is None:
        return greedy_accept(drafts, logits.argmax(-1))
    probs = verify_probs(logits, params, sampling_info)
    bs, n_draft = drafts.shape
    u = torch.rand(bs, n_draft + 1, device=logits.device)
    return rejection_accept(drafts, probs, u[:, :n_draft], u[:, n_draft])


def accept_tree(
    tree: DraftTree, logits: Tensor, params: SamplingParams | None, out_cache_loc: Tensor, sampling_info=None
) -> TreeAcceptResult:
    """tree of N nodes, logits [bs, N, V] (row i predicts the token after node i), out_cache_loc [bs, N] int64
    KV slot of each node. Greedy when params is None, else lossless tree sampling with uniforms from torch's
    default generator. The result carries commit_loc / free_loc (the accepted path's slots, the others')."""
    if params is None:
        return ops.verify_tree_greedy(tree, logits.argmax(-1), out_cache_loc)
    probs = verify_probs(logits, params, sampling_info).contiguous()
    bs, n = tree.tokens.shape
    u = torch.rand(bs, n + 1, device=logits.device)
    return ops.verify_tree_sampling(tree, probs, u[:, :n].contiguous(), u[:, n].contiguous(), out_cache_loc)
