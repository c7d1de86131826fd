"""`DFlashWorker`: the spec-v2 worker SGLang's scheduler drives for `--speculative-algorithm DFLASH`.

The scheduler contract (SGLang 0.5.17 and 0.5.23, the one its builtin DFLASH worker meets):
- built with the keywords `server_args, gpu_id, nccl_port, target_worker` (0.5.17 adds `ps`) inside each
  scheduler process; then `alloc_memory_pool(...)`, `init_attention_backends()`, `init_cuda_graphs()`. The server
  args carry our resolved `DFlashSettings` (adapter/settings.py), the only configuration this worker reads;
- `forward_batch_generation(batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None) ->
  GenerationBatchResult`, called synchronously (CPU, `--disable-overlap-schedule`) or on the overlap forward
  stream (GPU default);
- the relayed per-request state is SGLang's own `DFlashDraftInputV2` (bonus token + committed length), whose
  `prepare_for_decode` reserves 2*N KV slots past the committed length before every decode step
  (N = the declared speculative_num_draft_tokens, settings.max_nodes);
- results: `next_token_ids` [bs*N] (row i: accepted drafts, then the bonus), `accept_lens` [bs] int32 =
  tokens committed (bonus included), `speculative_num_draft_tokens` = N as the row stride. The scheduler
  appends them and applies stop strings / EOS / max_new_tokens per request, trimming anything after the
  stop, so no extra token is ever emitted; it also counts `spec_verify_ct` etc. for the per-request
  `spec_accept_length` in meta_info.

One decode step (docs/structure.md, "One decode step"): pick the step's shape (fixed by the flags, or by batch size
with --speculative-adaptive, adapter/step/shapes.py) -> block `[bonus, MASK...]` -> drafter pass over the paged draft KV
-> draft logits through the target lm_head (merged over TP ranks, adapter/scale/tp.py) -> core's `propose` (a chain of
n, or n best-first tree nodes) -> target TARGET_VERIFY over those n rows per request (features captured; a tree with
its ancestor mask) -> core's `accept` (greedy or lossless sampling; the tree ops are dflash_sglang.ops' kernels) ->
publish new lengths -> (tree: move the accepted path's KV slots to the front of the step's req_to_token window,
adapter/step/tree.py) -> commit draft K/V for every verify row. Target and draft KV of rejected rows sit in reserved
slots past the committed length, which the drafter never reads, and the next step overwrites them. Every step
returns rows of stride N = `speculative_num_draft_tokens` (the chain: N = B; adaptive: the largest shape, n <= N),
-1 padded. Where the target captures CUDA graphs, the drafter pass and the commit replay graphs captured at its
batch sizes (adapter/draft/graphs.py).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask
from torch import Tensor

from dflash_sglang import ops
from dflash_sglang.core.accept import AcceptResult, cap_commits
from dflash_sglang.core.adaptive import SpecShape
from dflash_sglang.core.config import CheckpointError
from dflash_sglang.core.selector import SelectorScores, some_row_samples
from dflash_sglang.core.speculate import DraftScores, accept, committed_ranks, draft_block, propose, rank_paths
from dflash_sglang.core.token_map import read_token_map

from ..draft.context_rows import SlotRows, WindowPool
from ..draft.graphs import DraftGraphs, default_sizes, graph_mode
from ..draft.memory import check_pool_memory
from ..draft.model import EagerDraftPass, PagedDrafter, TargetHead, load_draft_weights, weight_bytes
from ..scale.disagg import TransferredDraftPool, watch_transfers
from ..scale.dp_attention import DECODE, EXTEND, IDLE, AttentionDP
from ..scale.hicache import draft_plan as hicache_draft_plan
from ..scale.retraction import watch_retractions
from ..scale.tp import DraftVocab
from ..settings import TREE_ATTENTION_BACKENDS, UnsupportedFlagError, settings_of
from ..versions import prefill_hidden_full
from .hidden import FinalHiddenStates, decode_rows, prefill_rows
from .hybrid import HybridTarget, state_scratch_bytes
from .logprobs import attach_logprobs
from .metrics import GoodputMetrics
from .penalties import RequestPenalties
from .shapes import ShapeSchedule
from .tree import compact_path_slots, fit_rows
from .upkeep import PlainUpkeep, upkeep_steps
from .verify import masked_verify_graphs, run_target_verify, sampling_params

logger = logging.getLogger(__name__)
DEFER_ENV = "DFLASH_DEFER_PLAIN_UPKEEP"
_MIN_FREE_FOR_GRAPHS = 1 << 30  # bytes free after the target's setup below which the draft stays eager
_TREE_BACKEND_CLASSES = ("TorchNativeAttnBackend", "FlashInferAttnBackend", "TritonAttnBackend")


@dataclass
class _NoDraftRunner:
    token_to_kv_pool: None = None  # no SGLang KV pool to hand to PD transfer or HiCache


@dataclass
class DraftHandle:
    """What the scheduler reads off `spec_worker.draft_worker` (SGLang assumes a draft TpModelWorker).

    Our drafter is not a TpModelWorker, so graph/weight accounting is empty and it has no draft ModelRunner: the
    worker hands its draft KV pool to PD transfer (`primary_draft_kv_pool`) and HiCache (`init_hicache_draft_plan`).
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


@dataclass(frozen=True)
class _Accepted:
    """One decode step's verify and acceptance, chain or tree: n verify rows per request (the step's shape,
    n <= N), result rows N wide."""

    out_tokens: Tensor  # [bs, N] int64: accepted drafts, the bonus at index accept_len, then -1
    accept_len: Tensor  # [bs] int64: accepted drafts (the step commits accept_len + 1 tokens)
    bonus: Tensor  # [bs] int64: the next step's root
    positions: Tensor  # [bs, n] int64: position of each verify row
    slots: Tensor  # [bs, n] int64: KV slot each verify row was written to
    logits_output: object  # SGLang's LogitsProcessorOutput of the verify (hidden_states [bs*n, F])
    can_run_cuda_graph: bool
    tree_result: object = None  # TreeAcceptResult in tree mode: its commit/free slots reorder req_to_token
    final_hidden: Tensor | None = None  # [bs*n, H]: the target's final hidden states, when a request asks for them
    ranks: Tensor | None = None  # [bs, m] int64: the drafter's ranks of the committed tokens (goodput mode)


def _extend_positions(batch: ScheduleBatch, device) -> Tensor:
    """Absolute positions of the tokens of an extend batch, in `out_cache_loc` order."""
    spans = [torch.arange(p, p + n, device=device) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64, device=device)


class DFlashWorker(BaseSpecWorker):
    """DFlash speculative decoding: one drafter pass per block, chain verify, lossless accept."""

    # False (or DFLASH_DEFER_PLAIN_UPKEEP=0, an implementation switch for before/after timings, not a serving
    # setting): every plain step writes its draft K/V at once (adapter/step/upkeep.py)
    defer_plain_upkeep = os.environ.get(DEFER_ENV, "1").strip() != "0"

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, ps=None) -> None:
        super().__init__()
        self.server_args = server_args
        self.gpu_id, self.ps, self.nccl_port = gpu_id, ps, nccl_port
        self._target_worker = target_worker
        self._draft_worker = DraftHandle()  # the drafter is not a TpModelWorker: see self.drafter
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        self.context_len = int(self.model_runner.model_config.context_len)
        self.settings = settings_of(server_args)  # resolved and checked at start-up (adapter/boot/resolve.py)
        self.cfg = self.settings.draft
        self.block_size = self.settings.block_size
        self.max_nodes = self.settings.max_nodes  # N: the most verify rows per request = row stride of next_token_ids
        self.draft_dir = self.settings.draft_dir
        self.drafter: PagedDrafter | None = None  # set by alloc_memory_pool (needs the slot count)
        self.head: TargetHead | None = None  # the target's embedding and lm_head, borrowed by the drafter
        self.vocab: DraftVocab | None = None  # this TP rank's lm_head rows and the proposal merge over ranks
        self.graphs: DraftGraphs | None = None  # set by init_cuda_graphs (None: the draft work runs eagerly)
        self._check_captured_layers()
        # The drafter's weights now, before the scheduler sizes the KV pools: SGLang gives them the GPU memory free
        # at that point (whatever is resident is charged), so ours are counted, a DFlash2 selector's codebooks (2 x V
        # x r) included, instead of coming out of the headroom. dummy_draft (--speculative-draft-load-format dummy,
        # capacity planning): random weights of the shapes.
        self.draft_weights = load_draft_weights(self.draft_dir, self.model_runner.dtype, self.device,
                                                dummy=self.settings.dummy_draft)
        total, books = weight_bytes(self.draft_weights)
        logger.info("DFLASH (dflash-sglang): draft weights %.1f MiB%s, resident before SGLang sizes the KV pools",
                    total / 2**20, f" (DFlash2 selector codebooks {books / 2**20:.1f} MiB)" if books else "")
        # A draft window's ring pool (a ring per request slot, adapter/draft/context_rows.py) is resident now for the
        # same reason: SGLang's per-token KV sizing cannot count it (adapter/draft/memory.py). None: the pool mirrors
        # the target's slots (a window then bounds the reads only).
        self.window = WindowPool.allocate(self.settings, self.draft_weights, self.model_runner.dtype, self.device)
        self.schedule = ShapeSchedule.from_settings(self.settings)
        if (self.schedule.controller is not None and getattr(server_args, "enable_metrics", False)
                and getattr(target_worker, "tp_rank", 0) == 0):  # (rank 0 decides every rank's shape)
            model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "")
            self.schedule.metrics = GoodputMetrics({"model_name": str(model)})
        self.simulation = self.settings.simulation  # SGLANG_SIMULATE_ACC_LEN: forced commit lengths (chain only)
        self.masked_graphs = masked_verify_graphs(self.settings)  # tree verifies replay masked verify graphs
        self.penalties = RequestPenalties()  # frequency / presence / repetition / min_new_tokens, per request
        # Plain steps' draft K/V written when the drafter next needs them (adapter/step/upkeep.py): not where HiCache
        # or a PD decode server's retraction backup copies draft rows between steps. A window's ring defers at most
        # R steps (R rows per request: the pending rows of one request stay distinct, so one commit writes what a
        # commit per step would); a window over the slot rows defers as the whole context does.
        self.upkeep = PlainUpkeep(enabled=self.defer_plain_upkeep
                                  and not getattr(server_args, "enable_hierarchical_cache", False)
                                  and self.settings.disaggregation != "decode",
                                  max_steps=upkeep_steps(None if self.window is None else self.window.rows.ring))
        # A hybrid target's recurrent state: committed per verify through SGLang's machinery (adapter/step/hybrid.py).
        self.hybrid = HybridTarget.of(self.model_runner, self.settings.topk) if self.settings.hybrid else None
        # return_hidden_states (adapter/step/hidden.py), with the pool
        self.final_hidden: FinalHiddenStates | None = None
        # goodput mode: the last decode step (shape, accepted drafts [bs], the drafter's ranks of the committed tokens
        # [bs, m] or None, start time), observed at the next step's start (its tensors are ready by then, no sync of
        # their own; the time between the two starts is what the step cost the server); its time is not used after a
        # prefill or idle step in between (the interval was not its own: _interval_clean)
        self._last_step: tuple[SpecShape, Tensor, Tensor | None, float] | None = None
        self._interval_clean = False
        self._step_start = 0.0  # perf_counter at this decode step's shape choice
        # DP attention: every step agreed with the other attention-DP groups (adapter/scale/dp_attention.py)
        self.dp = AttentionDP.of(server_args)

    @property
    def speculative_num_draft_tokens(self) -> int:
        # Read off the spec worker by SGLang's metrics (the `sglang:spec_num_draft_tokens` gauge, "currently
        # active"): the last step's verify nodes per request. The row stride stays self.max_nodes.
        return self.schedule.current.nodes if self.schedule.current is not None else self.max_nodes

    @property
    def primary_draft_kv_pool(self) -> TransferredDraftPool | None:
        # SGLang 0.5.23 reads it for PD transfer (adapter/scale/disagg.py); HiCache reads hicache_draft_plan instead
        if not self.settings.disaggregation or getattr(self, "drafter", None) is None:
            return None
        pool = TransferredDraftPool(self.drafter.pool, int(self.model_runner.token_to_kv_pool.page_size))
        if self.settings.disaggregation == "decode":  # every transfer checked for draft K/V (adapter/scale/disagg.py)
            watch_transfers(pool)
        return pool

    def init_hicache_draft_plan(self) -> None:
        # SGLang (0.5.18 on) asks after alloc_memory_pool and reads `hicache_draft_plan`: our draft pool's context rows
        # offloaded with the target's KV (adapter/scale/hicache.py; SGLang's own plan reads a draft ModelRunner we lack)
        self._hicache_draft_plan = hicache_draft_plan(self.drafter, self.model_runner.token_to_kv_pool)

    @property
    def preloaded_weights_bytes(self) -> int:
        # SGLang 0.5.23 adds it to the target's weight-cache bytes when sizing the KV pool; our drafter is loaded
        # from disk, never preloaded (falling through to the target worker would count the target twice).
        return 0

    def _check_captured_layers(self) -> None:
        """The target layers SGLang captures must be the draft's (SGLang derives them from the same config)."""
        source = f"{self.draft_dir}/config.json"
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
        if self.settings.has_tree_rows and int(target_pool.page_size) != 1:
            # ServerArgs may resolve the page size after our checks; the accepted path is committed by
            # permuting req_to_token entries, which only a page size of 1 allows.
            if self.schedule.controller is None:
                raise UnsupportedFlagError(f"--page-size {target_pool.page_size}: tree verification "
                                           f"(--speculative-eagle-topk > 1) needs page size 1")
            self.schedule.chains_only(f"page size {target_pool.page_size}")
        self.final_hidden = FinalHiddenStates(self.model_runner.model)  # (the target is loaded by now)
        kernels = ops.load_kernels(self.device)  # nvcc build (cached) now, not in the first decode step
        if kernels is not None:
            logger.info("DFLASH (dflash-sglang): CUDA ops %s", kernels)
        req_slots = int(req_to_token_pool.req_to_token.shape[0])
        context_rows, pool = (self.window.serving(req_slots) if self.window is not None
                              else (SlotRows(rows, self.settings.draft_window), None))
        self.drafter = PagedDrafter.load(self.draft_dir, rows, req_slots, self.block_size, self.model_runner.dtype,
                                         self.device, dummy=self.settings.dummy_draft,
                                         attention=self.settings.draft_attention, kv_dtype=self.settings.draft_kv_dtype,
                                         weights=self.draft_weights,  # (loaded when the worker was built)
                                         context_rows=context_rows, pool=pool)
        memory = check_pool_memory(self.drafter.pool, self.settings.draft_memory, self.drafter.scratch_base,
                                   self.context_len)
        if self.settings.disaggregation == "decode":  # a retracted request's draft rows go to host with its KV
            watch_retractions(self.drafter.pool)
        target = self.model_runner.model
        # The drafter proposes over the token map of the settings (checked at start-up) or the whole vocabulary.
        token_map = read_token_map(self.settings.token_map, self.cfg.vocab_size) if self.settings.token_map else None
        self.vocab = DraftVocab(target.lm_head, self.cfg.vocab_size, token_map)
        self.head = TargetHead(target.get_input_embeddings(), self.vocab.weight, self.cfg.mask_token_id,
                               self.cfg.input_embedding_scale)
        self.eager_pass = EagerDraftPass(self.drafter, self.head, req_to_token_pool.req_to_token)
        # A DFlash2 draft's candidate selector (core/selector.py) picks its drafts; None: the drafter's argmax / top-k
        self.selector = self.drafter.drafter.candidate_selector
        if self.selector is not None:
            self.selector.check_proposable(token_map.numel() if token_map is not None else self.cfg.vocab_size)
        # A sampled selector walk's uniforms: every TP rank must draw the same ones (they walk the same chain and
        # verify the same rows); ranks run the same steps with the same batch, so a generator seeded alike on each
        # rank agrees without a collective (SGLang's default generator also serves other draws)
        seed = int(self.server_args.random_seed or 0)
        # SGLang seeds torch's default generator alike in every scheduler; the target's sampler (each prompt's first
        # token) and our accept draw from it. Under DP attention each group samples its own requests, so two groups
        # running alike batches would draw alike uniforms: the same prompt in both groups got the same tokens (the
        # chi-square of tests/test_sglang_e2e.py caught it). Each group reseeds it once, at its first forward (SGLang
        # reseeds after building the workers), with --random-seed offset by the group, and seeds its walk generator
        # so; the ranks of one group still draw alike.
        self._group_seed: int | None = None
        if self.dp is not None:
            seed += 7919 * self.dp.index
            self._group_seed = seed
        self.walk_generator = torch.Generator(self.vocab.weight.device).manual_seed(seed)
        scratch = ""
        if self.hybrid is not None:  # SGLang allocated them from the verify rows we declared (adapter/step/hybrid.py)
            scratch = f", target state per verify row {state_scratch_bytes(req_to_token_pool) / 2**20:.1f} MiB"
        rows_why = "" if self.settings.draft_window_why is None else f" ({self.settings.draft_window_why})"
        logger.info(
            "DFLASH (dflash-sglang): block_size=%d, %s, draft layers=%d, target layer ids=%s, draft attention %s, "
            "%s%s, %s%s%s", self.block_size, self.schedule.describe(), self.cfg.num_hidden_layers,
            list(self.cfg.target_layer_ids), self.drafter.backend_name, self.drafter.context_rows.describe(), rows_why,
            memory, scratch, ", verify CUDA graphs with the tree mask" if self.masked_graphs else "",
        )

    def init_attention_backends(self) -> None:
        # The drafter's attention needs no SGLang backend state. The target's backend exists by now: a tree
        # needs one that takes its mask (ServerArgs may pick the backend after our flag checks).
        backend = type(self.model_runner.attn_backend).__name__
        if not self.settings.has_tree_rows or backend in _TREE_BACKEND_CLASSES:
            return
        if self.schedule.controller is not None:  # goodput mode: trees are only candidates
            self.schedule.chains_only(f"the target attention backend {backend} takes no tree mask")
            return
        raise UnsupportedFlagError(f"--attention-backend: tree verification supports "
                                   f"{', '.join(TREE_ATTENTION_BACKENDS)} target attention, the target runs {backend}")

    def init_cuda_graphs(self) -> None:
        # Called after the target captured its graphs: ours take the target's batch sizes (adapter/draft/graphs.py).
        sizes = getattr(getattr(self.model_runner, "decode_cuda_graph_runner", None), "capture_bs", None)
        mode = graph_mode(self.device, bool(sizes), self.drafter.attention, self.settings.draft_graphs)
        if mode is None:
            logger.info("DFLASH (dflash-sglang): the draft pass and commit run eagerly")
            return
        if mode == "capture" and torch.cuda.mem_get_info(self.device)[0] < _MIN_FREE_FOR_GRAPHS:
            # as the builtin DFLASH does: too little memory is left after the target's pools and graphs
            logger.warning("DFLASH (dflash-sglang): under %d MiB of GPU memory free, the draft pass and commit run "
                           "eagerly (lower --mem-fraction-static to leave room for their CUDA graphs)",
                           _MIN_FREE_FOR_GRAPHS >> 20)
            return
        if not sizes:
            sizes = default_sizes(int(self.req_to_token_pool.req_to_token.shape[0]))
        tic = time.perf_counter()
        self.graphs = DraftGraphs(self.drafter, self.head, self.req_to_token_pool.req_to_token, sizes,
                                  self.schedule.node_counts(), self.drafter.drafter.fc.in_features,
                                  self.model_runner.dtype, capture=mode == "capture", selector=self.selector,
                                  top_logits=self.vocab.top_logits, select_in_graph=self.vocab.world_size == 1)
        logger.info("DFLASH (dflash-sglang): %s (%.1f s)", self.graphs.describe(), time.perf_counter() - tic)

    def __getattr__(self, name):
        # Everything else the scheduler asks of its model worker is the target's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ------------------------------------------------------------------ hot path
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None):
        assert pp_proxy_tensors is None, "pipeline parallelism is refused at start-up"
        if self._group_seed is not None:  # (DP attention: this group's own random stream, see __init__)
            torch.manual_seed(self._group_seed)
            self._group_seed = None
        # The local mode: under DP attention `is_extend_in_batch` says whether any group prefills this step
        if batch.forward_mode.is_extend() or (batch.is_extend_in_batch and self.dp is None):
            return self._prefill(batch, on_publish)
        if batch.forward_mode.is_idle():
            return self._idle(batch, on_publish)
        return self._decode(batch, on_publish, grammar_barrier)

    def _prefill(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """Target prefill with feature capture; the prompt's draft K/V are written right away (a radix-cache
        hit of this prompt may be scheduled before this request decodes)."""
        self._catch_up()  # (before this prompt's rows: it may reuse a finished request's slots)
        self._interval_clean = False
        if self.dp is not None:
            self.dp.apply(batch, self.dp.plan(EXTEND, None))
        with self.final_hidden.capture(batch.return_hidden_states):
            out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        features = out.logits_output.hidden_states  # [tokens, F]: the draft's target layers, captured
        if features is None:
            raise RuntimeError("DFLASH: the target returned no captured features (is its architecture supported?)")
        self.drafter.commit_extend(features, _extend_positions(batch, features.device), batch.out_cache_loc,
                                   batch.req_pool_indices, list(batch.extend_lens))
        # the features are the drafter's: the scheduler gets the final hidden states where a request asks for them
        out.logits_output.hidden_states = (prefill_rows(self.final_hidden.take(), list(batch.extend_lens),
                                                        prefill_hidden_full(batch, self.server_args))
                                           if batch.return_hidden_states else None)
        out.next_draft_input = _draft_input(out.next_token_ids, batch.seq_lens)
        return out

    def _idle(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """No request here this step (only under DP attention): the target's IDLE forward, which the other groups'
        collectives wait for, unless every group is idle."""
        self._catch_up()
        self._interval_clean = False
        if self.dp is not None:
            plan = self.dp.plan(IDLE, None)
            if plan.any_work:
                self.dp.apply(batch, plan)
                self.target_worker.forward_batch_generation(batch)
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            next_token_ids=empty,
            accept_lens=empty.to(torch.int32),
            next_draft_input=_draft_input(empty, empty),
            speculative_num_draft_tokens=self.max_nodes,
            new_seq_lens=empty,
        )

    def _decode(self, batch: ScheduleBatch, on_publish, grammar_barrier=None) -> GenerationBatchResult:
        state = batch.spec_info
        assert isinstance(state, DFlashDraftInputV2), "the scheduler relays DFlashDraftInputV2 between steps"
        seq_lens = batch.seq_lens
        if seq_lens.is_cuda:  # carried over from the previous overlap iteration, maybe made on another stream
            seq_lens.record_stream(torch.cuda.current_stream(seq_lens.device))
        shape = self._choose_shape(seq_lens.numel())
        # Near the context limit the verify rows (positions seq_len .. seq_len + n - 1) must stay inside it: the
        # target has no positions past it, and no request can commit past it anyway.
        longest = int(batch.seq_lens_cpu.max()) if batch.seq_lens_cpu is not None else int(seq_lens.max())
        shape = shape.at_most(self.context_len - longest)
        eager = False
        if self.dp is not None:  # every decoding group verifies the same shape; counts for this step's forward
            plan = self.dp.plan(DECODE, shape)
            shape, eager = plan.shape, not plan.uniform
            self.dp.apply(batch, plan)
        requests = tuple(r.rid for r in batch.reqs)  # (the batch whose plain steps may wait: adapter/step/upkeep.py)
        if self.upkeep.due(requests, drafted=shape.nodes > 1):
            self._catch_up()  # before the drafter reads the pool, or another batch writes its rows
        step = self._step(batch, state.bonus_tokens, shape, grammar_barrier, eager)
        if self.schedule.controller is not None:  # the drafts' real acceptance, before any max_new_tokens cut
            self._last_step = (shape, step.accept_len, step.ranks, self._step_start)
            self._interval_clean = True
        step = self._within_max_new_tokens(batch, step, shape.nodes)

        if self.hybrid is not None:  # the last accepted row's recurrent state goes live, before anything plans again
            self.hybrid.commit(batch, seq_lens, step.accept_len,
                               step.tree_result.accept_nodes if step.tree_result is not None else None)
        commit_lens = (step.accept_len + 1).to(torch.int32)
        new_seq_lens = seq_lens + commit_lens.to(seq_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)  # as early as possible: the scheduler prepares the next batch meanwhile

        if step.tree_result is not None:
            compact_path_slots(self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, step.tree_result)
        logits_output = step.logits_output
        accept_nodes = step.tree_result.accept_nodes if step.tree_result is not None else None
        if batch.return_logprob:
            logits = logits_output.next_token_logits.view(seq_lens.numel(), step.positions.shape[1], -1)
            attach_logprobs(batch, logits_output, logits, step.out_tokens, accept_nodes)
        # Every verify row's draft K/V goes to that row's own slot (or ring row): rejected rows land past the new
        # committed length (rows the next step rewrites), so none is filtered out (a boolean gather = a host sync).
        rows = (logits_output.hidden_states, step.positions.reshape(-1),
                self.drafter.context_rows.decode(step.positions, step.slots, batch.req_pool_indices))
        if shape.nodes == 1 and self.upkeep.enabled:  # a plain step: written when the drafter next needs it
            if self.upkeep.defer(requests, *rows, copy=step.can_run_cuda_graph):
                self._catch_up()
        elif self.graphs is None or not self.graphs.commit(*rows, bs=seq_lens.numel(), nodes=step.positions.shape[1]):
            self.drafter.commit(*rows)
        logits_output.hidden_states = (None if step.final_hidden is None else
                                       decode_rows(step.final_hidden, accept_nodes, seq_lens.numel(), self.max_nodes))

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=step.out_tokens.clamp_min(0).reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=step.can_run_cuda_graph,
            next_draft_input=_draft_input(step.bonus, new_seq_lens),
            speculative_num_draft_tokens=self.max_nodes,
            new_seq_lens=new_seq_lens,
        )

    def _catch_up(self) -> None:
        """Write the pending plain steps' draft K/V (adapter/step/upkeep.py) in one commit."""
        pending = self.upkeep.take()
        if pending is not None:
            self.drafter.commit(*pending)

    def _within_max_new_tokens(self, batch: ScheduleBatch, step: _Accepted, n: int) -> _Accepted:
        """The step with no request committing past its max_new_tokens. SGLang trims such a run when the request
        ends by length, but not when an abort already marked it (`to_finish`): the aborted answer would carry tokens
        past the limit. Host work only unless a request is within n tokens of its limit."""
        seq_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        # committed KV length = prompt + output - 1 (the newest output token, the bonus, is not in the KV yet)
        limits = [len(r.origin_input_ids) + r.sampling_params.max_new_tokens - 1
                  if r.sampling_params.max_new_tokens is not None else self.context_len for r in batch.reqs]
        left = torch.tensor(limits, dtype=torch.int64) - seq_cpu.to(torch.int64)
        if int(left.min()) >= n:
            return step
        capped = cap_commits(AcceptResult(step.accept_len, step.out_tokens, step.bonus),
                             left.to(step.accept_len.device, non_blocking=True))
        return replace(step, out_tokens=capped.out_tokens, accept_len=capped.accept_len, bonus=capped.bonus)

    def _choose_shape(self, bs: int) -> SpecShape:
        """This step's shape; in goodput mode the previous step is observed first (acceptance and wall time), and
        TP rank 0's choice is every rank's (each rank times its own steps)."""
        self._step_start = time.perf_counter()
        if self.schedule.controller is not None and self._last_step is not None:
            shape, accepted, ranks, start = self._last_step
            seconds = self._step_start - start if self._interval_clean else None
            self.schedule.observe(shape, accepted.tolist(), seconds,
                                  None if ranks is None else rank_paths(ranks.tolist()))
            self._last_step = None
        shape = self.schedule.choose(bs)
        if self.schedule.controller is not None and self.vocab.world_size > 1:
            shape = SpecShape(*self.vocab.same_ints_on_every_rank((shape.nodes, shape.topk), self.device))
        return shape

    def _step(self, batch: ScheduleBatch, bonus: Tensor, shape: SpecShape, grammar_barrier,
              eager: bool = False) -> _Accepted:
        """Core's decode step (core/speculate.py) on SGLang's state: propose shape.nodes = n verify rows per request
        (a chain: [bonus, n-1 greedy drafts]; n = 1: a plain decoding step, no drafter pass; a tree: the best-first
        tree of n nodes), verify them in one TARGET_VERIFY forward (a tree with its ancestor mask), accept. eager:
        no verify graph replay (DP attention: another group prefills or idles this step)."""
        seq_lens, bs, n = batch.seq_lens, batch.seq_lens.numel(), shape.nodes
        params = sampling_params(batch.sampling_info, bs, batch.reqs)
        scores = self._scores(batch, bonus, draft_block(shape, self.block_size), params) if n > 1 else None
        proposal = propose(bonus, scores, shape, ops.TREE_KERNELS)
        tree = proposal.tree
        inputs = ops.build_tree_inputs(proposal.ids, proposal.depth, seq_lens, self.req_to_token_pool.req_to_token,
                                       batch.req_pool_indices)
        grammar = None
        if batch.has_grammar:  # (a host copy, before the verify)
            grammar = (GrammarTree.from_linear_chain(proposal.ids) if tree is None else
                       GrammarTree.from_device(tree.retrive_next_token, tree.retrive_next_sibling, tree.tokens))
        return_hidden = batch.return_hidden_states  # (the hook must run: no CUDA graph replay then)
        links = self.hybrid.links(tree, bs, n, seq_lens.device) if self.hybrid is not None else None
        with self.final_hidden.capture(return_hidden):
            logits_output, graph = run_target_verify(
                self.target_worker, batch, inputs.input_ids, inputs.positions, inputs.out_cache_loc,
                tree_mask=tree.mask if tree is not None else None, masked_graphs=self.masked_graphs,
                eager=eager or return_hidden or links is not None, tree_links=links,
            )
        penalized = self.penalties.rows(batch, bonus, logits_output.next_token_logits.shape[-1])
        logits = logits_output.next_token_logits.view(bs, n, -1)  # [bs, n, V]: n verify rows per request
        if penalized is not None:  # before the bias and the grammar mask, as plain decoding applies them
            self.penalties.penalize(logits, penalized, proposal.ids, tree.parent if tree is not None else None)
        self._bias_and_grammar(logits, batch, grammar, grammar_barrier)
        slots = inputs.out_cache_loc if tree is not None else None  # a tree's verify splits commit / free slots
        result = accept(proposal, logits, params, None, slots, ops.TREE_KERNELS)
        if self.simulation is not None and n > 1:  # the verify ran as usual (same cost); only its outcome is forced
            result = AcceptResult(*self.simulation.force(proposal.ids[:, 1:], logits.argmax(-1),
                                                         self.simulation.sample_commit_len(n)))
        result = self.vocab.same_on_every_rank(result)
        ranks = None  # the goodput controller prices trees from them (not for forced outcomes; none without trees)
        controller = self.schedule.controller
        if controller is not None and controller.uses_ranks and scores is not None and self.simulation is None:
            ranks = committed_ranks(scores, result, n, scores.positions)
        if penalized is not None:
            self.penalties.commit(penalized, result.out_tokens, result.accept_len + 1)
        return _Accepted(fit_rows(result.out_tokens, self.max_nodes), result.accept_len, result.bonus,
                         inputs.positions, inputs.out_cache_loc, logits_output, graph,
                         tree_result=result if tree is not None else None,
                         final_hidden=self.final_hidden.take() if return_hidden else None, ranks=ranks)

    @staticmethod
    def _bias_and_grammar(logits: Tensor, batch: ScheduleBatch, grammar, grammar_barrier) -> None:
        """logits [bs, n, V] (penalized already) adjusted in place as plain decoding would sample from them: logit
        bias (the same at every verify row of a request), then, for grammar-constrained requests, each row masked by
        the grammar state its draft path reaches (`grammar`: the verify rows as a tree, SGLang's `GrammarTree`; rows
        past a draft the grammar rejects stay unmasked: acceptance never reaches them). The scheduler advances each
        request's grammar by the tokens the step commits. (Custom logit processors are refused per request.)"""
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

    def _scores(self, batch: ScheduleBatch, bonus: Tensor, block: int, params) -> DraftScores:
        """One drafter pass's scores for core's propose: the draft logits merged over TP ranks (adapter/scale/tp.py),
        or a DFlash2 drafter's candidate selector over them (its candidates merged over TP ranks as well; its walk on
        the device, sampled where a request samples, with uniforms from `walk_generator`, seeded by --random-seed),
        replayed with the pass where draft graphs run (adapter/draft/selector_graph.py). Which requests sample is known
        on the host (params None: all greedy; else its hints), so no step reads the device to decide it."""
        if self.selector is None:
            return self.vocab.scores(self._draft_pass(batch, bonus, block))
        temperature = params.temperature if params is not None else None
        any_sampled = some_row_samples(params)  # (from the requests' host-side params: no host sync)
        assert any_sampled is not None, "step/verify.py sampling_params gives the host hints of the batch's requests"
        args = (bonus, batch.seq_lens, batch.seq_lens_cpu, batch.req_pool_indices)
        if self.graphs is not None:
            scores = self.graphs.select(*args, temperature, any_sampled, self.walk_generator)
            if scores is not None:
                return scores
        hidden, logits = self.eager_pass.with_hidden(*args, block)
        return SelectorScores.of(self.selector, hidden, logits, bonus, temperature, self.walk_generator,
                                 top_logits=self.vocab.top_logits, any_sampled=any_sampled)

    def _draft_pass(self, batch: ScheduleBatch, bonus: Tensor, block: int) -> Tensor:
        """One drafter pass over the block [bonus, MASK x (b-1)] at seq_len.. (b = `block` <= B) -> draft logits
        [bs, D, V] for block positions 1..D (D = b-1; B-1 where a graph replays the whole block). The pass writes no
        target KV (only the draft pool's per-request scratch rows), so the block needs no KV slots (B may exceed N)."""
        # batch.seq_lens_cpu: the scheduler's host mirror (it resolves it on its own stream), so no sync here
        args = (bonus, batch.seq_lens, batch.seq_lens_cpu, batch.req_pool_indices, block)
        logits = self.graphs(*args) if self.graphs is not None else None
        return logits if logits is not None else self.eager_pass(*args)
