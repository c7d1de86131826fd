"""What `DFlashWorker` (adapter/step/worker.py) builds at start-up: all of its state, declared in `__init__`, built in
the scheduler's order (`__init__`, `alloc_memory_pool`, `init_attention_backends`, `init_cuda_graphs`), and the members
the scheduler reads off a spec worker. Per-step code lives in worker.py; what a feature adds to a step is picked here
once, as an object (a no-op one where the feature is off).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from dflash_sglang import ops
from dflash_sglang.core.draft.config import CheckpointError
from dflash_sglang.core.draft.token_map import read_token_map

from ..draft.context_rows import SlotRows, WindowPool
from ..draft.graphs import DraftGraphs, default_sizes, graph_mode
from ..draft.memory import check_pool_memory
from ..draft.model import EagerDraftPass, PagedDrafter, TargetHead, load_draft_weights, weight_bytes
from ..scale.disagg import TransferredDraftPool, watch_transfers
from ..scale.dp_attention import AttentionDP
from ..scale.hicache import draft_plan as hicache_draft_plan
from ..scale.retraction import watch_retractions
from ..scale.tp import DraftVocab
from ..settings import TREE_ATTENTION_BACKENDS, UnsupportedFlagError, settings_of
from .hidden import FinalHiddenStates
from .hybrid import HybridTarget, NoRecurrentState, state_scratch_bytes
from .metrics import GoodputMetrics
from .penalties import RequestPenalties
from .shapes import ShapeSchedule
from .upkeep import DraftCommit, draft_commit
from .verify import PLAIN_STEP_ENV, decode_serves_plain_steps, masked_verify_graphs

logger = logging.getLogger("dflash_sglang.adapter.step.worker")  # (the start-up lines keep the worker's logger name)
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


class WorkerStartup(BaseSpecWorker):
    """The worker's state and its start-up; `DFlashWorker` adds the step."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, ps=None) -> None:
        super().__init__()
        self.server_args = server_args
        self.gpu_id, self.ps, self.nccl_port = gpu_id, ps, nccl_port
        self._target_worker = target_worker
        self._draft_worker = DraftHandle()  # the drafter is not a TpModelWorker: see self.drafter
        self.model_runner, self.device = target_worker.model_runner, target_worker.device
        self.context_len = int(self.model_runner.model_config.context_len)
        self.settings = s = settings_of(server_args)  # resolved and checked at start-up (adapter/boot/resolve.py)
        self.cfg, self.draft_dir, self.block_size = s.draft, s.draft_dir, s.block_size
        self.max_nodes = self.settings.max_nodes  # N: the most verify rows per request = row stride of next_token_ids
        self._check_captured_layers()
        # The drafter's weights now, before the scheduler sizes the KV pools: SGLang gives them the GPU memory free
        # at that point (whatever is resident is charged), so ours are counted, a DFlash2 selector's codebooks
        # included. A draft window's ring pool (adapter/draft/context_rows.py) is resident now for the same reason
        # (adapter/draft/memory.py); None: the pool mirrors the target's slots.
        self.draft_weights = self._load_draft_weights()
        self.window = WindowPool.allocate(self.settings, self.draft_weights, self.model_runner.dtype, self.device)
        self.simulation = self.settings.simulation  # SGLANG_SIMULATE_ACC_LEN: forced commit lengths (chain only)
        self.masked_graphs = masked_verify_graphs(self.settings)  # tree verifies replay masked verify graphs
        self.penalties = RequestPenalties()  # frequency / presence / repetition / min_new_tokens, per request
        # What each feature adds to a step, picked once (a no-op object where it is off): the shape schedule (fixed,
        # table or goodput controller, with its step bookkeeping), a hybrid target's recurrent state (committed per
        # verify through SGLang's machinery), DP attention (every step agreed with the other groups).
        self.schedule = self._shape_schedule()
        self.hybrid = (HybridTarget.of(self.model_runner, self.settings.topk) if self.settings.hybrid
                       else NoRecurrentState())
        self.dp = AttentionDP.of(server_args)
        # Built by alloc_memory_pool (they need SGLang's pools and the loaded target), which also keeps SGLang's
        # req_to_token_pool and token_to_kv_pool_allocator (read through to the target worker's until then):
        self.drafter: PagedDrafter | None = None
        self.draft_commit: DraftCommit | None = None  # the draft-K/V commit policy (adapter/step/upkeep.py)
        self.vocab: DraftVocab | None = None  # this TP rank's lm_head rows and the proposal merge over ranks
        self.head: TargetHead | None = None  # the target's embedding and lm_head, borrowed by the drafter
        self.eager_pass: EagerDraftPass | None = None
        self.selector = None  # a DFlash2 draft's candidate selector (core/draft/selector.py); None: argmax / top-k
        self.walk_generator: torch.Generator | None = None  # a sampled selector walk's uniforms
        self.final_hidden: FinalHiddenStates | None = None  # return_hidden_states (adapter/step/hidden.py)
        self.graphs: DraftGraphs | None = None  # built by init_cuda_graphs (None: the draft work runs eagerly)
        # a plain step as SGLang's DECODE forward (step/verify.py `decode_serves_plain_steps`): by init_cuda_graphs
        self.plain_by_decode, self.decode_logged = False, False

    def _load_draft_weights(self):
        """dummy_draft (--speculative-draft-load-format dummy, capacity planning): random weights of the shapes."""
        weights = load_draft_weights(self.draft_dir, self.model_runner.dtype, self.device,
                                     dummy=self.settings.dummy_draft)
        total, books = weight_bytes(weights)
        logger.info("DFLASH (dflash-sglang): draft weights %.1f MiB%s, resident before SGLang sizes the KV pools",
                    total / 2**20, f" (DFlash2 selector codebooks {books / 2**20:.1f} MiB)" if books else "")
        return weights

    def _shape_schedule(self) -> ShapeSchedule:
        schedule = ShapeSchedule.from_settings(self.settings)
        if (schedule.controller is not None and getattr(self.server_args, "enable_metrics", False)
                and getattr(self._target_worker, "tp_rank", 0) == 0):  # (rank 0 decides every rank's shape)
            model = getattr(self.server_args, "served_model_name", None) or getattr(self.server_args, "model_path", "")
            schedule.metrics = GoodputMetrics({"model_name": str(model)})
        return schedule

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
        self._check_page_size()
        self.final_hidden = FinalHiddenStates(self.model_runner.model)  # (the target is loaded by now)
        kernels = ops.load_kernels(self.device)  # nvcc build (cached) now, not in the first decode step
        if kernels is not None:
            logger.info("DFLASH (dflash-sglang): CUDA ops %s", kernels)
        memory = self._build_drafter()
        self._borrow_target_head()
        self.walk_generator = torch.Generator(self.vocab.weight.device).manual_seed(self._walk_seed())
        self._log_start(memory)

    def _check_page_size(self) -> None:
        """ServerArgs may resolve the page size after our checks; a tree's accepted path is committed by permuting
        req_to_token entries, which only a page size of 1 allows (goodput mode: chains only then)."""
        page = int(self.model_runner.token_to_kv_pool.page_size)
        if not self.settings.has_tree_rows or page == 1:
            return
        if self.schedule.controller is None:
            raise UnsupportedFlagError(f"--page-size {page}: tree verification (--speculative-eagle-topk > 1) needs "
                                       f"page size 1")
        self.schedule.chains_only(f"page size {page}")

    def _build_drafter(self) -> str:
        """The paged drafter over SGLang's slots (or a window's ring) and its commit policy; returns the memory phrase
        of the start-up line."""
        target_pool = self.model_runner.token_to_kv_pool
        rows = int(target_pool.size) + int(target_pool.page_size)
        req_slots = int(self.req_to_token_pool.req_to_token.shape[0])
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
        self.draft_commit = draft_commit(self.drafter, self.settings, self.server_args,
                                         None if self.window is None else self.window.rows.ring)
        return memory

    def _borrow_target_head(self) -> None:
        """The drafter proposes through the target's embedding and lm_head, over the token map of the settings
        (checked at start-up) or the whole vocabulary; a DFlash2 draft through its candidate selector."""
        target = self.model_runner.model
        token_map = read_token_map(self.settings.token_map, self.cfg.vocab_size) if self.settings.token_map else None
        self.vocab = DraftVocab(target.lm_head, self.cfg.vocab_size, token_map)
        self.head = TargetHead(target.get_input_embeddings(), self.vocab.weight, self.cfg.mask_token_id,
                               self.cfg.input_embedding_scale)
        self.eager_pass = EagerDraftPass(self.drafter, self.head, self.req_to_token_pool.req_to_token)
        self.selector = self.drafter.drafter.candidate_selector
        if self.selector is not None:
            self.selector.check_proposable(token_map.numel() if token_map is not None else self.cfg.vocab_size)

    def _walk_seed(self) -> int:
        """A sampled selector walk's uniforms: every TP rank must draw the same ones (they walk the same chain and
        verify the same rows); ranks run the same steps with the same batch, so a generator seeded alike on each rank
        agrees without a collective (SGLang's default generator also serves other draws). Under DP attention each
        group seeds its own (adapter/scale/dp_attention.py `seed`)."""
        return self.dp.seed(int(self.server_args.random_seed or 0))

    def _log_start(self, memory: str) -> None:
        scratch = ""
        if isinstance(self.hybrid, HybridTarget):  # SGLang allocated them from the verify rows we declared
            scratch = f", target state per verify row {state_scratch_bytes(self.req_to_token_pool) / 2**20:.1f} MiB"
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
        self.plain_by_decode = decode_serves_plain_steps(
            self.model_runner, self.settings.hybrid, isinstance(self.dp, AttentionDP), os.environ.get(PLAIN_STEP_ENV))
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
        tic = time.perf_counter()
        self.graphs = self.draft_commit.graphs = DraftGraphs(
            self.drafter, self.head, self.req_to_token_pool.req_to_token,
            sizes or default_sizes(int(self.req_to_token_pool.req_to_token.shape[0])), self.schedule.node_counts(),
            self.drafter.drafter.fc.in_features, self.model_runner.dtype, capture=mode == "capture",
            selector=self.selector, top_logits=self.vocab.top_logits, select_in_graph=self.vocab.world_size == 1)
        logger.info("DFLASH (dflash-sglang): %s (%.1f s)", self.graphs.describe(), time.perf_counter() - tic)

    def __getattr__(self, name):
        # Everything else the scheduler asks of its model worker is the target's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target_worker, name)
