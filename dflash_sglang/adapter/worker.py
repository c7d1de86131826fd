"""`DFlashWorker`: the spec-v2 worker SGLang's scheduler drives for `--speculative-algorithm DFLASH`.

The scheduler contract (SGLang 0.5.17, the same one its builtin DFLASH worker meets):
- built as `DFlashWorker(server_args, gpu_id, ps, nccl_port, target_worker)` inside each scheduler process;
  then `alloc_memory_pool(...)`, `init_attention_backends()`, `init_cuda_graphs()`;
- `forward_batch_generation(batch, on_publish=None, grammar_barrier=None) -> GenerationBatchResult`, called
  synchronously (CPU, `--disable-overlap-schedule`) or on the overlap forward stream (GPU default);
- the relayed per-request state is SGLang's own `DFlashDraftInputV2` (bonus token + committed length), whose
  `prepare_for_decode` reserves 2*B KV slots past the committed length before every decode step;
- results: `next_token_ids` [bs*B] (row i: accepted drafts, then the bonus), `accept_lens` [bs] int32 =
  tokens committed (bonus included), `speculative_num_draft_tokens` = B as the row stride. The scheduler
  appends them and applies stop strings / EOS / max_new_tokens per request, trimming anything after the
  stop, so no extra token is ever emitted; it also counts `spec_verify_ct` etc. for the per-request
  `spec_accept_length` in meta_info.

One decode step: block `[bonus, MASK...]` -> drafter pass over the paged draft KV -> greedy drafts through
the target lm_head -> target TARGET_VERIFY over `[bonus, drafts]` (features captured) -> accept (greedy or
lossless sampling) -> publish new lengths -> commit draft K/V for the accepted rows only. Target KV of
rejected rows sits in reserved slots past the committed length and is overwritten by the next block.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

from dflash_sglang.core.block import build_block_inputs
from dflash_sglang.core.checkpoint import check_fit
from dflash_sglang.core.config import CheckpointError, DraftConfig

from .model import PagedDrafter
from .verify import accept_block, run_target_verify, sampling_params

logger = logging.getLogger(__name__)


@dataclass
class _NoDraftRunner:
    token_to_kv_pool: None = None  # no SGLang KV pool to hand to PD transfer or HiCache


@dataclass
class DraftHandle:
    """What the scheduler reads off `spec_worker.draft_worker` (SGLang assumes a draft TpModelWorker).

    Our drafter is not a TpModelWorker, so graph/weight accounting is empty and there is no draft KV pool
    for PD disaggregation or HiCache to register (both unsupported yet).
    """

    draft_runner: _NoDraftRunner = field(default_factory=_NoDraftRunner)
    graph_memory_usage: dict = field(default_factory=dict)
    graph_time_usage: dict = field(default_factory=dict)
    weight_load_time: float = 0.0

    @property
    def draft_runners(self) -> list:
        return []  # weight updates reach the target only; the draft keeps its checkpoint weights


def _draft_input(bonus: Tensor, seq_lens: Tensor) -> DFlashDraftInputV2:
    """SGLang's relay state for the next step: bonus token [bs] and committed lengths [bs]."""
    bs, device = seq_lens.numel(), seq_lens.device
    return DFlashDraftInputV2(
        topk_p=torch.empty((bs, 0), device=device),
        topk_index=torch.empty((bs, 0), dtype=torch.int64, device=device),
        bonus_tokens=bonus.to(torch.int64),
        new_seq_lens=seq_lens.to(torch.int64),
        hidden_states=torch.empty((bs, 0), device=device),
    )


def _extend_positions(batch: ScheduleBatch, device) -> Tensor:
    """Absolute positions of the tokens of an extend batch, in `out_cache_loc` order."""
    spans = [torch.arange(p, p + n, device=device) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64, device=device)


class DFlashWorker(BaseSpecWorker):
    """DFlash speculative decoding: one drafter pass per block, chain verify, lossless accept."""

    def __init__(self, server_args, gpu_id: int, ps, nccl_port: int, target_worker) -> None:
        super().__init__()
        self.server_args = server_args
        self.gpu_id, self.ps, self.nccl_port = gpu_id, ps, nccl_port
        self._target_worker = target_worker
        self._draft_worker = DraftHandle()  # the drafter is not a TpModelWorker: see self.drafter
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        self.block_size = int(server_args.speculative_num_draft_tokens)
        self.draft_dir = server_args.speculative_draft_model_path
        self.drafter: PagedDrafter | None = None  # set by alloc_memory_pool (needs the slot count)
        self._check_fit()

    def _check_fit(self) -> None:
        source = f"{self.draft_dir}/config.json"
        self.cfg = DraftConfig.load(self.draft_dir)
        check_fit(self.cfg, self.model_runner.model_config.hf_config, draft_source=source)
        captured = self.model_runner.spec_aux_config.dflash_target_layer_ids
        if captured is not None and tuple(captured) != self.cfg.target_layer_ids:
            raise CheckpointError(
                f"{source}: field 'dflash_config.target_layer_ids'={list(self.cfg.target_layer_ids)} but SGLang "
                f"captures target layers {list(captured)}"
            )

    # ------------------------------------------------------------------ scheduler lifecycle
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        target_pool = self.model_runner.token_to_kv_pool
        rows = int(target_pool.size) + int(target_pool.page_size)
        self.drafter = PagedDrafter.load(self.draft_dir, rows, self.model_runner.dtype, self.device)
        logger.info(
            "DFLASH (dflash-sglang): block_size=%d, draft layers=%d, target layer ids=%s, draft KV %.1f MiB",
            self.block_size, self.cfg.num_hidden_layers, list(self.cfg.target_layer_ids),
            self.drafter.pool.nbytes() / 2**20,
        )

    def init_attention_backends(self) -> None:
        pass  # the drafter's attention needs no SGLang backend state

    def init_cuda_graphs(self) -> None:
        pass  # eager (CUDA graphs for the draft and verify steps are not implemented yet)

    def __getattr__(self, name):
        # Everything else the scheduler asks of its model worker is the target's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ------------------------------------------------------------------ hot path
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._prefill(batch, on_publish)
        if batch.forward_mode.is_idle():
            return self._idle(on_publish)
        return self._decode(batch, on_publish)

    def _prefill(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """Target prefill with feature capture; the prompt's draft K/V are written right away (a radix-cache
        hit of this prompt may be scheduled before this request decodes)."""
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DFLASH: the target returned no captured features (is its architecture supported?)")
        self.drafter.commit(hidden, _extend_positions(batch, hidden.device), batch.out_cache_loc)
        out.logits_output.hidden_states = None  # keep the scheduler from copying features to the host
        out.next_draft_input = _draft_input(out.next_token_ids, batch.seq_lens)
        return out

    def _idle(self, on_publish) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            next_token_ids=empty,
            accept_lens=empty.to(torch.int32),
            next_draft_input=_draft_input(empty, empty),
            speculative_num_draft_tokens=self.block_size,
            new_seq_lens=empty,
        )

    def _decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        state = batch.spec_info
        assert isinstance(state, DFlashDraftInputV2), "the scheduler relays DFlashDraftInputV2 between steps"
        block, seq_lens = self.block_size, batch.seq_lens
        req_to_token = self.req_to_token_pool.req_to_token
        inputs = build_block_inputs(
            state.bonus_tokens, seq_lens, block, self.cfg.mask_token_id, req_to_token, batch.req_pool_indices
        )
        drafts = self._draft(inputs.input_ids, inputs.positions, seq_lens, batch.req_pool_indices)

        verify_ids = torch.cat([inputs.input_ids[:, :1], drafts], dim=1)
        logits_output, can_run_cuda_graph = run_target_verify(
            self.target_worker, batch, verify_ids, inputs.positions, inputs.out_cache_loc
        )
        bs = seq_lens.numel()
        logits = logits_output.next_token_logits.view(bs, block, -1)
        sampling_info = batch.sampling_info
        if sampling_info is not None:
            from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

            # Penalties / logit bias / custom processors: the same bias at every block row (as the builtin).
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits_output.next_token_logits, sampling_info=sampling_info, draft_token_num=block
            )
        result = accept_block(drafts, logits, sampling_params(sampling_info, bs), sampling_info)

        commit_lens = (result.accept_len + 1).to(torch.int32)
        new_seq_lens = seq_lens + commit_lens.to(seq_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)  # as early as possible: the scheduler prepares the next batch meanwhile

        keep = torch.arange(block, device=self.device)[None] < commit_lens[:, None]
        features = logits_output.hidden_states.view(bs, block, -1)
        self.drafter.commit(features[keep], inputs.positions[keep], inputs.out_cache_loc[keep])
        logits_output.hidden_states = None

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=result.out_tokens.clamp_min(0).reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=_draft_input(result.bonus, new_seq_lens),
            speculative_num_draft_tokens=block,
            new_seq_lens=new_seq_lens,
        )

    def _draft(self, block_ids: Tensor, positions: Tensor, seq_lens: Tensor, req_pool_indices: Tensor) -> Tensor:
        """block_ids / positions [bs, B] -> greedy drafts [bs, B-1] from one drafter pass."""
        target = self.model_runner.model
        embeds = target.get_input_embeddings()(block_ids)
        if self.cfg.input_embedding_scale != 1.0:
            embeds = embeds * self.cfg.input_embedding_scale
        width = int(seq_lens.max()) if seq_lens.numel() else 0
        rows = req_pool_indices.to(torch.int64)[:, None]
        ctx_slots = self.req_to_token_pool.req_to_token[rows, torch.arange(width, device=self.device)].to(torch.int64)
        hidden = self.drafter.draft(embeds, positions, ctx_slots, seq_lens.to(torch.int64))
        lm_head = target.lm_head.weight[: self.cfg.vocab_size]
        return self.drafter.propose(hidden, lm_head)
