"""CUDA graphs of a decode step's drafter work: the draft pass (block -> draft logits) and the draft-KV commit of
the verify rows, one graph of each per captured batch size.

Why: eager, one draft pass dispatches hundreds of aten ops and one commit dozens (scripts/count_draft_ops.py;
counts in docs/benchmarks.md), each a host launch every decode step, while SGLang's builtin DFLASH replays its draft
as one graph. Here a step replays two graphs. The draft graph starts with the attention layout: the
`draft_layout` kernel (`ops.draft_kv_indices`, through the drafter's `context_rows.key_rows`) writes every request's
key rows into a fixed buffer from kv_indptr and seq_lens (a draft window reads the last W positions), which
FlashInfer's graph-mode wrapper reads at a fixed address. What stays on the host is what only the host knows:
kv_indptr (a cumulative sum of the scheduler's host copy of seq_lens, each clamped to the window), FlashInfer's plan
(host work and the copy of kv_indptr), and copying the step's inputs into the static buffers. A DFlash2 draft's graph
also holds its selector's candidates and the chain's walk (adapter/draft/selector_graph.py; `select` replays it).

Padding: bs requests replay the graph of the smallest captured size >= bs. Padded draft requests have no context
and the drafter's padding scratch rows (`PagedDrafter.pad_slot`); their logits are never read. Padded commit rows
write the first of those padding scratch rows (`pad_row`), which no pass reads as context, in either context layout
(the slot rows, or a draft window's rings, whose row 0 is request slot 0's). Batches larger than every captured
size, shapes without a commit graph, and layouts longer than the index buffer run eagerly.

When: on CUDA, wherever the target captures its decode graphs, at its batch sizes (`graph_mode`; SGLang's
`--disable-cuda-graph` turns both off; `--speculative-dflash-draft-graphs eager` only the draft's). `static` replays
the same static buffers and padding without capture, on any device: how the CPU tests run this path inside a real
Engine.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_sglang.core.draft.selector import CandidateSelector, SelectorScores, TopLogits

from .attention import DraftLayout, PagedAttention, host_indptrs
from .model import PagedDrafter, TargetHead
from .selector_graph import GraphedSelector, SelectorStatics

logger = logging.getLogger(__name__)
_MAX_INDEX_ROWS = 1 << 24  # the shared int32 kv_indices buffer stays <= 64 MiB; longer layouts run eagerly
_DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def graph_mode(device, target_captures: bool, attention: PagedAttention | None, choice: str = "auto") -> str | None:
    """'capture', 'static' or None (eager), from --speculative-dflash-draft-graphs: `auto` captures on CUDA with
    FlashInfer draft attention wherever the target captures its decode graphs (SGLang's --disable-cuda-graph turns
    both off), `eager` never captures, `static` replays the static buffers without capture on any device.

    target_captures: the target replays its decode/verify steps as CUDA graphs; attention: the drafter's paged
    backend (None: a layer kind the backend cannot express on the dense path, which has no static shapes and runs
    eagerly; model.py `PagedDrafter`).
    """
    if attention is None:
        if choice == "static":
            raise ValueError("--speculative-dflash-draft-graphs static: the drafter has a bidirectional sliding window "
                             "narrower than its block, whose dense attention path runs eagerly")
        return None
    if choice != "auto":
        return "static" if choice == "static" else None
    capturable = torch.device(device).type == "cuda" and attention.capturable
    return "capture" if capturable and target_captures else None


def default_sizes(max_requests: int) -> list[int]:
    """Batch sizes to capture when the target has no graph runner to copy them from (up to 256 requests; larger
    batches run eagerly, where launch overhead no longer dominates)."""
    top = {max_requests} if max_requests <= _DEFAULT_SIZES[-1] else set()
    return sorted({s for s in _DEFAULT_SIZES if s < max_requests} | top)


@dataclass
class _DraftGraph:
    """The draft pass of `size` requests: static inputs, the planned attention, the output."""

    size: int
    bonus: Tensor  # [size] int64
    seq_lens: Tensor  # [size] int64
    req_pool_indices: Tensor  # [size] int64; padded entries hold the padding scratch slot
    kv_indptr: Tensor  # [size+1] int32: each request's key rows in the shared kv_indices buffer
    attention: object  # the paged backend of this size, planned before every replay
    logits: Tensor  # [size, B-1, V] output, rewritten by every replay
    selection: SelectorStatics | None = None  # a DFlash2 draft's selector (adapter/draft/selector_graph.py)
    graph: object = None  # torch.cuda.CUDAGraph; None: replayed eagerly (static mode)


@dataclass
class _CommitGraph:
    """The draft-KV commit of `rows` = size * nodes verify rows."""

    rows: int
    hidden: Tensor  # [rows, n_features * H] target features
    positions: Tensor  # [rows] int64
    slots: Tensor  # [rows] int64 pool rows; padded rows hold the padding row (`DraftGraphs.pad_row`)
    graph: object = None


class DraftGraphs:
    """The draft pass and commit of every captured batch size (see the module docstring)."""

    def __init__(self, drafter: PagedDrafter, head: TargetHead, req_to_token: Tensor, sizes: Sequence[int],
                 commit_nodes: Sequence[int], feature_dim: int, feature_dtype: torch.dtype, capture: bool,
                 selector: CandidateSelector | None = None, top_logits: TopLogits | None = None,
                 select_in_graph: bool = True) -> None:
        """req_to_token: SGLang's [pool_reqs, max_ctx] slot table (a fixed tensor); sizes: batch sizes to capture;
        commit_nodes: verify rows per request that a step can commit (one commit graph per size and count).
        selector: a DFlash2 draft's (None: DFlash v1), with `top_logits`, its candidates over the whole draft
        vocabulary, and select_in_graph: its selection captured with the pass (False under TP: it follows the
        replay)."""
        assert drafter.attention is not None and drafter.pad_slot is not None, "a paged drafter with a padding slot"
        self.drafter, self.head, self.req_to_token = drafter, head, req_to_token
        self.block = drafter.block
        self.sizes = sorted(set(sizes))
        nodes = sorted(set(commit_nodes))
        device = drafter.pool.k.device
        max_size, i64 = self.sizes[-1], {"dtype": torch.int64, "device": device}
        index_rows = min(max_size * (req_to_token.shape[1] + self.block), _MAX_INDEX_ROWS)
        self.kv_indices = torch.zeros(index_rows, dtype=torch.int32, device=device)
        kv_indptr = torch.zeros(max_size + 1, dtype=torch.int32, device=device)
        # Static buffers shared by every size (each graph reads and writes a leading slice; replays run one at a
        # time), so memory is that of the largest size, not the sum over sizes: the draft logits alone are
        # max_size x (B-1) x V.
        bonus, seq_lens = torch.zeros(max_size, **i64), torch.zeros(max_size, **i64)
        pool_idx = torch.full((max_size,), drafter.pad_slot, **i64)
        logits = torch.zeros(max_size, self.block - 1, head.lm_head_weight.shape[0], dtype=head.lm_head_weight.dtype,
                             device=device)
        self.selection = None
        if selector is not None:
            assert top_logits is not None, "the selector's candidates over the whole draft vocabulary"
            self.selection = GraphedSelector(selector, top_logits, select_in_graph, max_size, self.block - 1,
                                             drafter.cfg.hidden_size, drafter.dtype, device)
        self.drafts = {
            s: _DraftGraph(s, bonus[:s], seq_lens[:s], pool_idx[:s], kv_indptr[: s + 1],
                           drafter.attention.for_graph(s, kv_indptr[: s + 1], self.kv_indices), logits[:s],
                           self.selection.statics(s) if self.selection is not None else None)
            for s in self.sizes
        }
        rows = max_size * nodes[-1]
        hidden = torch.zeros(rows, feature_dim, dtype=feature_dtype, device=device)
        # padded commit rows write here: the padding scratch's first row, never read as context
        self.pad_row = drafter.scratch_base + drafter.pad_slot * self.block
        positions, slots = torch.zeros(rows, **i64), torch.full((rows,), self.pad_row, **i64)
        self.commits = {
            (s, n): _CommitGraph(s * n, hidden[: s * n], positions[: s * n], slots[: s * n])
            for s in self.sizes for n in nodes
        }
        self.captured = capture
        self._replayed: set[tuple[str, int]] = set()  # (what, size) replayed at least once (logged at debug)
        if capture:
            self._capture_all(device)

    def describe(self) -> str:
        nodes = sorted({n for _, n in self.commits})
        how = "CUDA graphs" if self.captured else "static buffers replayed eagerly"
        what = "draft pass"
        if self.selection is not None:
            what += (" with the DFlash2 selector's candidates and walk" if self.selection.in_graph else
                     " (the DFlash2 selector's candidates merged over TP ranks and its walk after the replay)")
            what += f" ({self.selection.nbytes() / 2**20:.1f} MiB of selector buffers)"
        return f"{what} and commit as {how} for batch sizes {self.sizes}, commit rows per request {nodes}"

    def _size_for(self, bs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, bs)
        return self.sizes[i] if i < len(self.sizes) else None

    # ------------------------------------------------------------------ draft pass
    @torch.inference_mode()
    def __call__(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None,
                 req_pool_indices: Tensor, block: int | None = None) -> Tensor | None:
        """The step's draft pass by replay (model.py's DraftPass, as EagerDraftPass) -> draft logits [bs, B-1, V], a
        view of the graph's output that the next replay overwrites; None when no captured size fits (the caller runs
        the pass eagerly).

        bonus [bs] int64, seq_lens [bs] (device), seq_lens_cpu [bs] its host mirror (None: a host sync),
        req_pool_indices [bs]; block: ignored (one captured shape per batch size: the whole block).
        """
        assert self.selection is None, "a DFlash2 draft's pass replays through select()"
        g = self._load(bonus, seq_lens, seq_lens_cpu, req_pool_indices)
        if g is None:
            return None
        self._replay(g, self._draft_body, "draft", bonus.numel(), g.size)
        return g.logits[: bonus.numel()]

    @torch.inference_mode()
    def select(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None, req_pool_indices: Tensor,
               temperature: Tensor | None, any_sampled: bool,
               generator: torch.Generator | None) -> SelectorScores | None:
        """A DFlash2 draft's pass and selection by replay -> its scores over D = B-1 positions (views of the static
        buffers, valid until the next replay), equal to the eager pass's `SelectorScores.of` with the same arguments;
        None when no captured size fits (the caller runs both eagerly).

        The pass's arguments as __call__'s; temperature [bs] float32 (None: every request greedy), any_sampled: some
        request samples (known on the host), generator: the walk's uniforms' (drawn only where some request samples).
        """
        assert self.selection is not None, "a DFlash2 draft's graphs"
        g = self._load(bonus, seq_lens, seq_lens_cpu, req_pool_indices)
        if g is None:
            return None
        bs = bonus.numel()
        uniforms = self.selection.load(g.selection, temperature, any_sampled, generator, bs)
        self._replay(g, self._draft_body, "draft", bs, g.size)
        return self.selection.scores(g.selection, bs, bonus, g.logits[:bs], temperature, uniforms, generator,
                                     any_sampled)

    def _load(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None,
              req_pool_indices: Tensor) -> _DraftGraph | None:
        """The draft graph of the smallest captured size >= bs, planned and its static inputs loaded; None when no
        captured size fits or the layout is longer than the index buffer."""
        bs = bonus.numel()
        size = self._size_for(bs)
        if size is None:
            return None
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.to("cpu", torch.int64)
        key_lens = self.drafter.context_rows.key_lens(seq_lens_cpu)
        if int(key_lens.sum()) + size * self.block > self.kv_indices.numel():
            return None
        g = self.drafts[size]
        self._plan(g, key_lens)
        g.bonus[:bs].copy_(bonus)
        g.seq_lens[:bs].copy_(seq_lens)
        g.req_pool_indices[:bs].copy_(req_pool_indices)
        if bs < size:  # a previous, larger batch left real slots here
            g.req_pool_indices[bs:].fill_(self.drafter.pad_slot)
        return g

    def _plan(self, g: _DraftGraph, key_lens: Tensor) -> None:
        """Host kv_indptr of the padded batch (key_lens [bs] int64: each request's context keys, the drafter's
        `context_rows.key_lens`; padded requests: none) into the graph's buffer, and the attention planned on it. The
        layout carries no kv_indices: the graph's first kernel writes them."""
        lens = torch.zeros(g.size, dtype=torch.int64)
        lens[: key_lens.numel()] = key_lens
        qo_indptr, kv_indptr = host_indptrs(lens, self.block)
        g.kv_indptr.copy_(kv_indptr, non_blocking=True)
        g.attention.plan(DraftLayout(qo_indptr, kv_indptr, self.kv_indices[:0]))

    def _draft_body(self, g: _DraftGraph) -> None:
        self.drafter.context_rows.key_rows(g.kv_indptr, g.req_pool_indices, g.seq_lens, self.req_to_token,
                                           self.drafter.scratch_base, self.block, self.kv_indices)
        states = g.selection.states if g.selection is not None else None
        self.drafter.block_logits(self.head, g.bonus, g.seq_lens, g.req_pool_indices, g.attention, out=g.logits,
                                  states=states)
        if g.selection is not None:
            self.selection.body(g.selection, g.logits, g.bonus)

    # ------------------------------------------------------------------ commit
    @torch.inference_mode()
    def commit(self, hidden: Tensor, positions: Tensor, slots: Tensor, bs: int, nodes: int) -> bool:
        """The step's draft-KV commit of bs * nodes verify rows by replay; False when no graph fits (the caller
        commits eagerly). hidden [bs*nodes, F], positions / slots [bs*nodes] int64."""
        size = self._size_for(bs)
        c = self.commits.get((size, nodes))
        if c is None:
            return False
        rows = bs * nodes
        c.hidden[:rows].copy_(hidden)
        c.positions[:rows].copy_(positions)
        c.slots[:rows].copy_(slots)
        if rows < c.rows:
            c.slots[rows:].fill_(self.pad_row)
        self._replay(c, self._commit_body, f"commit of {nodes} rows per request", bs, size)
        return True

    def _commit_body(self, c: _CommitGraph) -> None:
        self.drafter.commit(c.hidden, c.positions, c.slots)

    # ------------------------------------------------------------------ capture / replay
    def _replay(self, g, body: Callable, what: str, bs: int, size: int) -> None:
        if (what, size) not in self._replayed:
            self._replayed.add((what, size))
            logger.debug("DFLASH draft graphs: first %s replay of size %d (batch of %d)", what, size, bs)
        if g.graph is not None:
            g.graph.replay()
        else:
            body(g)

    def _capture_all(self, device) -> None:
        # One memory pool for every graph's intermediates: replays run one at a time on one stream, and inputs and
        # outputs live outside it. Largest first, so the smaller graphs fit in what the largest one's freed.
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            g = self.drafts[size]
            self._plan(g, torch.zeros(0, dtype=torch.int64))  # captured on an all-padded batch
            # plan() copies its schedule and kv_indptr on the current stream; capture runs on `stream`
            stream.wait_stream(torch.cuda.current_stream(device))
            g.graph = _capture(lambda g=g: self._draft_body(g), pool, stream, f"draft pass of {size} requests")
            for (s, n), c in self.commits.items():
                if s == size:
                    c.graph = _capture(lambda c=c: self._commit_body(c), pool, stream,
                                       f"commit of {size} x {n} rows")
        torch.cuda.synchronize(device)


def _capture(body: Callable[[], None], pool, stream, what: str) -> torch.cuda.CUDAGraph:
    """Warm up twice on `stream` (lazy allocations, library handles and kernel choices happen outside the graph),
    then capture one run. A failure is raised at start-up with the way out, never hidden behind an eager path."""
    try:
        with torch.cuda.stream(stream):
            body()
            body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            body()
    except RuntimeError as e:
        raise RuntimeError(f"DFLASH (dflash-sglang): capturing the CUDA graph of the {what} failed: {e}. "
                           f"--disable-cuda-graph runs the target and the draft eagerly") from e
    return graph
