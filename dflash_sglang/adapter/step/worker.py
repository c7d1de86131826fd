"""`DFlashWorker`: the decode step of the spec-v2 worker SGLang's scheduler drives for `--speculative-algorithm DFLASH`.

The scheduler contract is docs/worker.md's; the worker's state and start-up are adapter/step/startup.py's. A decode
step reads as core/reference.py `_spec_step`: `_decode` = shape -> `_step` (draft, propose, verify, accept) ->
publish -> commit, every feature's part an object picked at start-up (a no-op where the feature is off). Results:
`next_token_ids` [bs*N] (row i: accepted drafts, the bonus, -1 padded), `accept_lens` [bs] int32 (tokens committed),
`speculative_num_draft_tokens` = N (settings.max_nodes), the row stride. Rejected rows' target and draft KV sit in
reserved slots past the committed length, which the next step overwrites.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from torch import Tensor

from dflash_sglang import ops
from dflash_sglang.core.draft.selector import SelectorScores, some_row_samples
from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.speculate import DraftScores, accept, committed_ranks, draft_block, propose
from dflash_sglang.core.step.accept import AcceptResult, cap_commits

from ..versions import prefill_hidden_full
from .hidden import decode_rows, prefill_rows
from .logprobs import attach_logprobs
from .startup import WorkerStartup, logger
from .tree import compact_path_slots, fit_rows
from .verify import bias_and_grammar, grammar_rows, run_target_decode, run_target_verify, sampling_params


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

    @property
    def accept_nodes(self) -> Tensor | None:
        """[bs, D+1] a tree's accepted path (verify rows, root first, then -1); None: a chain (row j commits j)."""
        return None if self.tree_result is None else self.tree_result.accept_nodes

    def compact(self, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor) -> None:
        """A tree's accepted path moved to the front of its KV window (adapter/step/tree.py); a chain's is there."""
        if self.tree_result is not None:
            compact_path_slots(req_to_token, req_pool_indices, seq_lens, self.tree_result)


def _extend_positions(batch: ScheduleBatch, device) -> Tensor:
    """Absolute positions of the tokens of an extend batch, in `out_cache_loc` order."""
    spans = [torch.arange(p, p + n, device=device) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64, device=device)


def _no_publish(new_seq_lens: Tensor) -> None:
    pass


class DFlashWorker(WorkerStartup):
    """DFlash speculative decoding: one drafter pass per block, chain or tree verify, lossless accept."""

    # ------------------------------------------------------------------ hot path
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None):
        assert pp_proxy_tensors is None, "pipeline parallelism is refused at start-up"
        self.dp.reseed()  # (DP attention: this group's own random stream, once)
        publish = on_publish or _no_publish
        if self.dp.prefills(batch):
            return self._prefill(batch, publish)
        if batch.forward_mode.is_idle():
            return self._idle(batch, publish)
        return self._decode(batch, publish, grammar_barrier)

    def _prefill(self, batch: ScheduleBatch, publish) -> GenerationBatchResult:
        """Target prefill with feature capture; the prompt's draft K/V are written right away (a radix-cache
        hit of this prompt may be scheduled before this request decodes)."""
        self.draft_commit.catch_up()  # (before this prompt's rows: it may reuse a finished request's slots)
        self.schedule.interrupt()
        self.dp.prefill(batch)
        with self.final_hidden.capture(batch.return_hidden_states):
            out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens
        publish(out.new_seq_lens)
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

    def _idle(self, batch: ScheduleBatch, publish) -> GenerationBatchResult:
        """No request here this step (only under DP attention): the target's IDLE forward, which the other groups'
        collectives wait for, unless every group is idle."""
        self.draft_commit.catch_up()
        self.schedule.interrupt()
        if self.dp.idle(batch):
            self.target_worker.forward_batch_generation(batch)
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        publish(empty)
        return GenerationBatchResult(next_token_ids=empty, accept_lens=empty.to(torch.int32),
                                     next_draft_input=_draft_input(empty, empty),
                                     speculative_num_draft_tokens=self.max_nodes, new_seq_lens=empty)

    def _decode(self, batch: ScheduleBatch, publish, grammar_barrier=None) -> GenerationBatchResult:
        """One decode step: shape, draft -> verify -> accept (`_step`), publish, commit."""
        state, seq_lens, bs = batch.spec_info, batch.seq_lens, batch.seq_lens.numel()
        assert isinstance(state, DFlashDraftInputV2), "the scheduler relays DFlashDraftInputV2 between steps"
        if seq_lens.is_cuda:  # carried over from the previous overlap iteration, maybe made on another stream
            seq_lens.record_stream(torch.cuda.current_stream(seq_lens.device))
        shape, eager = self.dp.decode(batch, self._shape(batch))  # (DP: every group verifies the same shape)
        requests = tuple(r.rid for r in batch.reqs)  # (the batch whose plain steps may wait: adapter/step/upkeep.py)
        self.draft_commit.before(requests, drafted=shape.nodes > 1)
        step = self._step(batch, state.bonus_tokens, shape, grammar_barrier, eager)
        self.schedule.finish(shape, step.accept_len, step.ranks)  # (the drafts' acceptance, before any length cut)
        step = self._within_max_new_tokens(batch, step, shape.nodes)
        self.hybrid.commit(batch, seq_lens, step.accept_len, step.accept_nodes)  # (before anything plans again)
        commit_lens = (step.accept_len + 1).to(torch.int32)
        new_seq_lens = seq_lens + commit_lens.to(seq_lens.dtype)
        publish(new_seq_lens)  # as early as possible: the scheduler prepares the next batch meanwhile
        step.compact(self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens)
        # Every verify row's draft K/V goes to that row's own slot (or ring row): rejected rows land past the new
        # committed length (rows the next step rewrites), so none is filtered out (a boolean gather = a host sync).
        rows = (step.logits_output.hidden_states, step.positions.reshape(-1),
                self.drafter.context_rows.decode(step.positions, step.slots, batch.req_pool_indices))
        self.draft_commit.step(requests, rows, bs, step.positions.shape[1], copy=step.can_run_cuda_graph)
        self._request_outputs(batch, step)
        return GenerationBatchResult(
            logits_output=step.logits_output, next_token_ids=step.out_tokens.clamp_min(0).reshape(-1),
            accept_lens=commit_lens, can_run_cuda_graph=step.can_run_cuda_graph,
            next_draft_input=_draft_input(step.bonus, new_seq_lens), speculative_num_draft_tokens=self.max_nodes,
            new_seq_lens=new_seq_lens)

    def _shape(self, batch: ScheduleBatch) -> SpecShape:
        """The schedule's shape, capped near the context limit: the verify rows (positions seq_len .. seq_len + n - 1)
        must stay inside it (the target has no positions past it, and no request can commit past it anyway)."""
        shape = self.schedule.start(batch.seq_lens.numel(), self.vocab, self.device)
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        return shape.at_most(self.context_len - int(seq_lens.max()))

    def _request_outputs(self, batch: ScheduleBatch, step: _Accepted) -> None:
        """What requests ask of the committed tokens beyond the ids: logprobs, final hidden states (in place of the
        captured features, which are the drafter's)."""
        out, bs = step.logits_output, step.positions.shape[0]
        if batch.return_logprob:
            logits = out.next_token_logits.view(bs, step.positions.shape[1], -1)
            attach_logprobs(batch, out, logits, step.out_tokens, step.accept_nodes)
        out.hidden_states = (None if step.final_hidden is None else
                             decode_rows(step.final_hidden, step.accept_nodes, bs, self.max_nodes))

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

    def _step(self, batch: ScheduleBatch, bonus: Tensor, shape: SpecShape, grammar_barrier,
              eager: bool = False) -> _Accepted:
        """Core's decode step (core/speculate.py) on SGLang's state: propose shape.nodes = n verify rows per request
        (a chain: [bonus, n-1 greedy drafts]; n = 1: a plain decoding step, no drafter pass; a tree: the best-first
        tree of n nodes), verify them in one TARGET_VERIFY forward (a tree with its ancestor mask), accept. eager:
        no verify graph replay (DP attention: another group prefills or idles this step)."""
        bs, n = batch.seq_lens.numel(), shape.nodes
        params = sampling_params(batch.sampling_info, bs, batch.reqs)
        scores = self._scores(batch, bonus, draft_block(shape, self.block_size), params) if n > 1 else None
        proposal = propose(bonus, scores, shape, ops.TREE_KERNELS)
        inputs = ops.build_tree_inputs(proposal.ids, proposal.depth, batch.seq_lens,
                                       self.req_to_token_pool.req_to_token, batch.req_pool_indices)
        grammar = grammar_rows(batch, proposal)  # (a host copy, before the verify)
        logits_output, graph, final_hidden = self._verify(batch, proposal, inputs, eager)
        logits = logits_output.next_token_logits.view(bs, n, -1)  # [bs, n, V]: n verify rows per request
        penalized = self.penalties.rows(batch, bonus, logits.shape[-1])  # (before the bias and the grammar mask,
        parent = proposal.tree.parent if proposal.tree is not None else None  # as plain decoding applies them)
        self.penalties.penalize(logits, penalized, proposal.ids, parent)
        bias_and_grammar(logits, batch, grammar, grammar_barrier)
        result, ranks = self._accept(proposal, logits, params, inputs.out_cache_loc, scores)
        self.penalties.commit(penalized, result.out_tokens, result.accept_len + 1)
        return _Accepted(fit_rows(result.out_tokens, self.max_nodes), result.accept_len, result.bonus,
                         inputs.positions, inputs.out_cache_loc, logits_output, graph,
                         tree_result=result if proposal.tree is not None else None,
                         final_hidden=final_hidden, ranks=ranks)

    def _verify(self, batch: ScheduleBatch, proposal, inputs, eager: bool):
        """TARGET_VERIFY of the proposal's rows (a plain step, where `plain_by_decode`: SGLang's DECODE forward of
        its one row) -> (logits output, whether a graph replayed, the final hidden states where a request asks for
        them: the hook must run, so no graph replays then)."""
        return_hidden, tree = batch.return_hidden_states, proposal.tree
        links = self.hybrid.links(tree, *proposal.ids.shape, batch.seq_lens.device)
        with self.final_hidden.capture(return_hidden):
            if self.plain_by_decode and proposal.ids.shape[1] == 1:  # a plain step: plain decoding's forward
                self._log_first_decode()
                logits_output, graph = run_target_decode(self.target_worker, batch, inputs.input_ids,
                                                         inputs.out_cache_loc), False
            else:
                logits_output, graph = run_target_verify(
                    self.target_worker, batch, inputs.input_ids, inputs.positions, inputs.out_cache_loc,
                    tree_mask=tree.mask if tree is not None else None, masked_graphs=self.masked_graphs,
                    eager=eager or return_hidden or links is not None, tree_links=links)
        return logits_output, graph, self.final_hidden.take() if return_hidden else None

    def _log_first_decode(self) -> None:
        if not self.decode_logged:
            self.decode_logged = True
            logger.info("DFLASH (dflash-sglang): a plain step runs SGLang's decode forward (no verify rows)")

    def _accept(self, proposal, logits: Tensor, params, slots: Tensor, scores: DraftScores | None):
        """Core's acceptance (a tree's verify splits its slots into commit / free), or the simulated outcome; the same
        on every TP rank. Returns (result, the drafter's ranks of the committed tokens where the controller prices
        trees from them; not for forced outcomes, none without drafts)."""
        n = proposal.ids.shape[1]
        result = accept(proposal, logits, params, None, slots if proposal.tree is not None else None,
                        ops.TREE_KERNELS)
        if self.simulation is not None and n > 1:  # the verify ran as usual (same cost); only its outcome is forced
            result = AcceptResult(*self.simulation.force(proposal.ids[:, 1:], logits.argmax(-1),
                                                         self.simulation.sample_commit_len(n)))
        result = self.vocab.same_on_every_rank(result)
        with_ranks = self.schedule.wants_ranks and scores is not None and self.simulation is None
        return result, committed_ranks(scores, result, n, scores.positions) if with_ranks else None

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
