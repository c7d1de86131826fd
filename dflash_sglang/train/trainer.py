"""Training loop: frozen target pieces (embeddings, head), cached features, AdamW + warmup + cosine, resume.

A resume restores the optimizer (AdamW moments) and the schedule from the checkpoint, so k steps + resume + k
steps == 2k steps bit for bit (tests/test_train.py). A fine-tune from a drafter without optimizer state (--init DIR)
does not warm up again: cli.py gives it a cosine that starts at a low lr (FINETUNE_LR, no warm-up).

Only the drafter (fc, hidden_norm, layers, norm) is trained; the target's embed_tokens and lm_head are read
once and kept frozen (DFlash paper, arXiv 2602.06036, section 4). Every random choice (sequence order,
anchors) is drawn from a generator seeded by (seed, epoch, step), so a resumed run continues exactly where the
killed one stopped.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..core.draft.checkpoint import save_drafter
from ..core.draft.config import DraftConfig
from ..core.draft.drafter import DFlashDrafter
from ..core.draft.token_map import inverse_map, restrict_head
from .objective import (DEFAULT_DISTILL_WEIGHT, BlockLossTerms, all_anchors, block_loss_terms, build_block_batch,
                        expected_accept_length, loss_gamma, sample_anchors, teacher_rows)
from .shards import Sequence_

log = logging.getLogger(__name__)
CKPT_DIR = "checkpoints"
LOG_FILE = "train_log.jsonl"
# Steps left out of the time-budget calibration: CUDA context, allocator and kernel warm-up make the first steps
# slow (several times the steady step time on a GPU: counted in, they shrank a time-budgeted schedule badly).
WARMUP_STEPS = 5
clock = time.monotonic  # the trainer's clock (tests substitute a fake one)


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 2.0
    max_steps: int | None = None  # overrides epochs (the cosine schedule spans exactly this many steps)
    batch_size: int = 4  # sequences per optimizer step
    num_anchors: int = 32  # blocks per sequence per step (fresh every epoch)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: objective.ACCEPT_GAMMA (a weighting that follows acceptance)
    distill_weight: float = DEFAULT_DISTILL_WEIGHT  # loss = (1 - w) CE + w KL(target || draft); 0: CE only
    distill_temperature: float = 1.0
    seed: int = 0
    save_every: int = 100
    val_every: int | None = None  # held-out pass every this many steps (None: at every checkpoint); a multiple
    # of save_every keeps validation cheap beside frequent checkpoints (a resumed run redoes fewer steps)
    max_passes: float | None = None  # stop (checkpointed, not exported) once the steps taken have visited the
    # sequences this many times on average: a growing cache (the standing CPU job) gets more data first
    keep_checkpoints: int = 2
    output_norm_init: float | None = 0.05  # None: copy the target's final norm (see init_drafter)
    bf16: bool | None = None  # autocast matmuls to bf16 (weights stay fp32); None: where it pays (bf16_pays)
    val_anchors: int = 256  # validation: at most this many evenly spaced anchors per held-out sequence
    val_batch: int = 4  # held-out sequences per validation forward (all their anchors at once)


@dataclass
class FrozenTarget:
    """The only target tensors training needs. embed [V, H], lm_head [V, H] (the same tensor when tied)."""

    embed: Tensor
    lm_head: Tensor
    final_norm: Tensor | None = None  # [H]; initialises the drafter's output norm

    @classmethod
    def from_model(cls, target) -> FrozenTarget:
        embed = target.get_input_embeddings().weight.detach()
        head = target.get_output_embeddings().weight.detach()
        inner = getattr(target, "model", None)
        norm = getattr(getattr(inner, "norm", None), "weight", None)
        return cls(embed, head, None if norm is None else norm.detach().clone())

    def to(self, device) -> FrozenTarget:
        norm = None if self.final_norm is None else self.final_norm.to(device)
        return FrozenTarget(self.embed.to(device), self.lm_head.to(device), norm)


def init_drafter(cfg: DraftConfig, frozen: FrozenTarget, seed: int, output_norm_init: float | None = 0.05
                 ) -> DFlashDrafter:
    """HF-style init (linear N(0, 0.02), norms 1), except the output norm.

    At init every block row's residual is dominated by its input embedding (mostly the mask token's), so with
    unit norm weights the head gives that token a logit of about |e| * sqrt(H), an initial CE far above ln V,
    and the first tens of steps only undo it. A small constant weight (default 0.05) starts near uniform.
    `output_norm_init=None` copies the target's final norm instead.
    """
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)
    with torch.no_grad():
        if output_norm_init is not None:
            model.norm.weight.fill_(output_norm_init)
        elif frozen.final_norm is not None and frozen.final_norm.shape == model.norm.weight.shape:
            model.norm.weight.copy_(frozen.final_norm.float())
    return model


def _vocab_name(token_map: Tensor | None) -> str:
    return "full" if token_map is None else str(len(token_map))


def bf16_pays(device: torch.device) -> bool:
    """Whether bf16 autocast speeds training up on `device`: on GPUs, and on CPUs with bf16 instructions
    (AVX512-BF16 or AMX). Elsewhere oneDNN emulates bf16: on the AVX2 dev machine (2 cores) a [4096, 576] x
    [576, 49152] matmul ran at 16 GFLOP/s in bf16 against 95 in fp32."""
    if device.type != "cpu":
        return True
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def _pad_rows(seqs: list[Sequence_], device, name: str = "features") -> Tensor:
    """[bs, T_max, F] float16 on `device` of each sequence's `name` rows (features [T, F] or final_hidden [T, H]),
    assembled where they live (the device, once they fit there)."""
    t_max = max(len(s.tokens) for s in seqs)
    rows = [getattr(s, name) for s in seqs]
    out = torch.zeros(len(seqs), t_max, rows[0].shape[1], dtype=torch.float16, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out.to(device)


def check_teacher(data: list[Sequence_]) -> None:
    """Distillation needs the target's final hidden state of every sequence: refuse a cache built without it,
    naming the shard (ValueError)."""
    for s in data:
        if s.final_hidden is None:
            raise ValueError(f"{s.source or 'a training sequence'}: this feature cache has no final_hidden (the "
                             f"target's last hidden state; caches built before logit distillation lack it): rebuild "
                             f"it (another --cache-dir, or delete its shards) or train with --distill-weight 0")


def _features_to_device(data: list[Sequence_], device: torch.device, max_fraction: float = 0.5) -> list[Sequence_]:
    """On a GPU, copy every sequence's cached features there once when they take at most `max_fraction` of the
    free memory (SmolLM2, 5 features: ~8 GB for 1.4M tokens), so steps do not copy ~80 MB from the host each."""
    if device.type != "cuda":
        return data
    total = sum(s.features.numel() * s.features.element_size() for s in data)
    free, _ = torch.cuda.mem_get_info(device)
    if total > max_fraction * free:
        log.info("features stay on the host: %.1f GB > %.0f%% of %.1f GB free", total / 1e9, 100 * max_fraction,
                 free / 1e9)
        return data
    log.info("features moved to %s: %.1f GB", device, total / 1e9)
    return [Sequence_(s.tokens, s.prompt_len, s.features.to(device),
                      None if s.final_hidden is None else s.final_hidden.to(device), s.source) for s in data]


class _StopOnTerm:
    """Turns SIGTERM into a flag the loop checks after each step (main thread only; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None
        try:
            self._old = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread
            pass

    def _on_term(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class Trainer:
    """`val_data`: held-out sequences (never trained on). At the start, at every checkpoint and at the end, the
    drafter's teacher-forced loss and per-position top-1 accuracy over fixed anchors of them go to the log: the
    training batch's own numbers (bf16, sequences seen for several epochs) do not tell under- from over-fitting.

    `token_map` [K] int64 (core/draft/token_map.py): train a reduced-vocabulary drafter, whose head and loss are the K
    rows of the target lm_head (labels outside the map are misses, see `block_loss_terms`); the exported drafter
    carries the map. A resumed run keeps the map its checkpoint was trained with."""

    def __init__(self, cfg: DraftConfig, tcfg: TrainConfig, frozen: FrozenTarget, data: list[Sequence_],
                 out_dir: Path, device: str | torch.device = "cpu", val_data: list[Sequence_] | None = None,
                 token_map: Tensor | None = None) -> None:
        if not data:
            raise ValueError("no training sequences")
        if not 0 <= tcfg.distill_weight <= 1:
            raise ValueError(f"--distill-weight must lie in [0, 1], got {tcfg.distill_weight}")
        if tcfg.distill_temperature <= 0:
            raise ValueError(f"--distill-temperature must be > 0, got {tcfg.distill_temperature}")
        self.cfg, self.tcfg, self.out = cfg, tcfg, Path(out_dir)
        self.device = torch.device(device)
        self.frozen = frozen.to(self.device)
        self.data = _features_to_device(data, self.device)
        self.val_data = list(val_data or [])
        self.model = init_drafter(cfg, frozen, tcfg.seed, tcfg.output_norm_init).to(self.device).train()
        self._set_token_map(token_map)
        self.gamma = tcfg.gamma or loss_gamma(cfg.block_size)
        self.bf16 = bf16_pays(self.device) if tcfg.bf16 is None else tcfg.bf16
        self.steps_per_epoch = math.ceil(len(data) / tcfg.batch_size)
        self.total_steps = tcfg.max_steps or max(1, int(tcfg.epochs * self.steps_per_epoch))
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tcfg.lr, betas=(0.9, 0.95),
        )
        self.step = 0
        self._set_schedule(self.total_steps)

    def _set_token_map(self, token_map: Tensor | None) -> None:
        """The draft head [K, H] (or the whole lm_head) and the label map [V] (None: full vocabulary)."""
        self.model.token_map = None if token_map is None else token_map.to(self.device)
        self.head = restrict_head(self.frozen.lm_head, self.model.token_map)
        self.label_map = None if token_map is None else inverse_map(self.model.token_map, self.cfg.vocab_size)

    def _set_schedule(self, total: int) -> None:
        self.total_steps = total
        warmup = int(self.tcfg.warmup_ratio * total)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(total, warmup, self.tcfg.min_lr_ratio), last_epoch=self.step - 1
        )

    def fit_to_budget(self, time_budget_s: float, seconds_per_step: float) -> None:
        """Shrink total_steps so the whole warmup + cosine schedule fits the time budget."""
        total = max(self.step + 1, min(self.total_steps, int(time_budget_s / seconds_per_step)))
        if total != self.total_steps:
            log.info("time budget %.0fs at %.2fs/step: %d -> %d steps", time_budget_s, seconds_per_step,
                     self.total_steps, total)
            self._set_schedule(total)

    # ------------------------------------------------------------------ batches
    def _batch_indices(self, step: int) -> list[int]:
        epoch, i = divmod(step, self.steps_per_epoch)
        gen = torch.Generator().manual_seed(self.tcfg.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.data), generator=gen).tolist()
        bs = self.tcfg.batch_size
        return order[i * bs : (i + 1) * bs]

    def loss_on(self, seqs: list[Sequence_], gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """Decay-weighted block loss on a list of sequences (one drafter forward for all their blocks)."""
        anchors = [sample_anchors(s.prompt_len, len(s.tokens), self.tcfg.num_anchors, gen) for s in seqs]
        terms = self._terms(seqs, anchors, teacher=self.tcfg.distill_weight > 0)
        return terms.mixed(self.tcfg.distill_weight), terms.accuracy

    def _terms(self, seqs: list[Sequence_], anchors: list[Tensor], teacher: bool) -> BlockLossTerms:
        """teacher: add the KL term against the target's distribution (needs every sequence's final_hidden)."""
        dev = self.device
        batch = build_block_batch([s.tokens for s in seqs], anchors, self.cfg.block_size, self.cfg.mask_token_id,
                                  self.gamma, device=dev)
        feats = _pad_rows(seqs, dev)
        teacher_hidden = None
        if teacher:
            check_teacher(seqs)
            teacher_hidden = teacher_rows(_pad_rows(seqs, dev, "final_hidden"), batch.block_pos)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            ctx = self.model.fuse(feats.float())
            ctx_kv = self.model.context_kv(ctx, batch.ctx_pos)
            embeds = self.frozen.embed[batch.block_ids] * self.cfg.input_embedding_scale
            hidden = self.model(embeds, batch.block_pos, ctx_kv, batch.ctx_pos, mask=batch.mask)
            return block_loss_terms(hidden, self.head, batch, self.model.logits, self.label_map, teacher_hidden,
                                    self.tcfg.distill_temperature)

    @torch.no_grad()
    def validate(self) -> dict | None:
        """Held-out loss, per-position top-1 accuracy [B] and the tau it implies, over fixed anchors (every
        response position up to `val_anchors` per sequence); None without validation data."""
        if not self.val_data:
            return None
        was_training = self.model.training
        self.model.eval()
        terms = None
        size = self.tcfg.val_batch
        # the held-out KL to the target whenever the cache has it, whatever the recipe (an A/B compares both)
        teacher = all(s.final_hidden is not None for s in self.val_data)
        for i in range(0, len(self.val_data), size):
            seqs = self.val_data[i : i + size]
            anchors = [all_anchors(s.prompt_len, len(s.tokens), self.tcfg.val_anchors) for s in seqs]
            part = self._terms(seqs, anchors, teacher)
            terms = part if terms is None else terms + part
        self.model.train(was_training)
        acc = terms.accuracy.cpu()
        out = {"loss": round(float(terms.loss), 4), "tau_est": round(expected_accept_length(acc), 4),
               "acc": [round(float(a), 4) for a in acc], "labels": int(terms.counts.sum())}
        if terms.kl is not None:
            out["kl"] = round(float(terms.kl), 4)
        return out

    def _log_validation(self, logf) -> dict | None:
        val = self.validate()
        if val is not None:
            logf.write(json.dumps({"step": self.step, "val": val}) + "\n")
            logf.flush()
            log.info("step %d: held-out loss %.4f, tau_est %.3f, top-1 by block position %s", self.step,
                     val["loss"], val["tau_est"], val["acc"][1:6])
        return val

    def _validated_steps(self) -> set[int]:
        """Steps with a held-out record in this run's log already."""
        path = self.out / LOG_FILE
        if not path.exists():
            return set()
        records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        return {r["step"] for r in records if "val" in r and "loss" not in r}

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_dir(self) -> Path:
        return self.out / CKPT_DIR

    def save_checkpoint(self) -> Path:
        d = self._ckpt_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"step_{self.step:07d}.pt"
        tmp = path.with_suffix(".tmp")
        token_map = None if self.model.token_map is None else self.model.token_map.cpu()
        torch.save({"step": self.step, "total_steps": self.total_steps, "model": self.model.state_dict(),
                    "opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "train_config": asdict(self.tcfg),
                    "token_map": token_map}, tmp)
        tmp.rename(path)
        for old in sorted(d.glob("step_*.pt"))[: -self.tcfg.keep_checkpoints]:
            old.unlink()
        return path

    def maybe_resume(self) -> bool:
        ckpts = sorted(self._ckpt_dir().glob("step_*.pt"))
        if not ckpts:
            return False
        state = torch.load(ckpts[-1], map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self._resume_token_map(state.get("token_map"), ckpts[-1])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self._set_schedule(int(state.get("total_steps", self.total_steps)))
        self.sched.load_state_dict(state["sched"])
        log.info("resumed from %s (step %d/%d)", ckpts[-1], self.step, self.total_steps)
        return True

    def _resume_token_map(self, saved: Tensor | None, path: Path) -> None:
        """Keep the checkpoint's map: counts from a cache grown since may pick slightly different tokens, and the
        run would change its softmax (and what its held-out numbers measure) mid-way."""
        want = self.model.token_map
        if (saved is None) != (want is None) or (saved is not None and len(saved) != len(want)):
            raise ValueError(f"{path}: trained with draft vocabulary {_vocab_name(saved)}, this run asks for "
                             f"{_vocab_name(want)} (--draft-vocab); use another --out to start a new run")
        if saved is not None and not torch.equal(saved.to(want.device), want):
            log.info("%s: keeping the checkpoint's token map (the data's most frequent tokens moved)", path)
            self._set_token_map(saved)

    def passes(self) -> float:
        """Sequence visits so far (every step, earlier launches included) per sequence of the data now."""
        return self.step * self.tcfg.batch_size / len(self.data)

    # ------------------------------------------------------------------ loop
    def train(self, progress: bool = True, time_budget_s: float | None = None, calibrate_steps: int = 10,
              stop_at: int | None = None) -> dict:
        """Run to `total_steps` and export the drafter.

        With `time_budget_s`, the time of `calibrate_steps` steps after the first WARMUP_STEPS sets total_steps so
        the schedule ends inside the budget (a hard stop with checkpoint + export remains as a safety net).
        `stop_at`: stop after this step (checkpointed, not exported; the schedule still spans total_steps), as a
        killed run would: a later train() resumes there.
        """
        from tqdm import tqdm

        if self.tcfg.distill_weight > 0:
            check_teacher(self.data)  # before any step (an evaluation-only Trainer never needs the teacher)
        self.out.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", disable=not progress)
        logf = (self.out / LOG_FILE).open("a")
        ema, last, start, first_step, calib_start = None, {}, clock(), self.step, None
        cpu_start = time.process_time()  # CPU seconds (all threads): what a shared CPU machine actually spent
        if self.step not in self._validated_steps():  # a resumed run's checkpoint step was validated when saved
            self._log_validation(logf)  # where this run starts (an --init drafter, a resumed step, or scratch)
        stop = _StopOnTerm()  # a stopped background job keeps the step it is on (and exits 143, not exported)
        needs_data = paused = False
        while self.step < self.total_steps:
            if self.tcfg.max_passes is not None and self.passes() >= self.tcfg.max_passes:
                needs_data = True
                break
            seqs = [self.data[i] for i in self._batch_indices(self.step)]
            gen = torch.Generator().manual_seed(self.tcfg.seed * 7_919 + self.step)
            loss, acc = self.loss_on(seqs, gen)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
            self.opt.step()
            self.sched.step()
            self.step += 1
            lv = loss.item()
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            tau = expected_accept_length(acc.cpu())
            last = {"step": self.step, "loss": lv, "loss_ema": ema, "tau_est": tau, "grad_norm": float(gnorm),
                    "lr": self.sched.get_last_lr()[0], "acc": [round(float(a), 4) for a in acc.cpu()],
                    "elapsed_s": round(clock() - start, 1), "cpu_s": round(time.process_time() - cpu_start, 1)}
            logf.write(json.dumps(last) + "\n")
            logf.flush()
            bar.set_postfix(loss=f"{ema:.3f}", tau=f"{tau:.2f}")
            bar.update(1)
            now = clock()
            elapsed, done = now - start, self.step - first_step
            if time_budget_s is not None and done == WARMUP_STEPS:
                calib_start = now
            elif time_budget_s is not None and done == WARMUP_STEPS + calibrate_steps:
                per_step = (now - calib_start) / calibrate_steps
                # steps already taken count at the calibrated rate, so total = step + remaining / per_step
                self.fit_to_budget(time_budget_s - elapsed + per_step * self.step, per_step)
                bar.total = self.total_steps
            out_of_time = time_budget_s is not None and elapsed > time_budget_s
            end = self.step == self.total_steps or out_of_time
            if self.step % self.tcfg.save_every == 0 or end or stop.requested:
                self.save_checkpoint()
            if self.step % (self.tcfg.val_every or self.tcfg.save_every) == 0 or end:
                val = self._log_validation(logf)
                if val is not None:
                    last["val"] = val
            if stop.requested:
                break
            if stop_at is not None and self.step >= stop_at and not end:
                paused = True
                self.save_checkpoint()
                break
            if out_of_time:
                log.warning("time budget reached at step %d/%d; exporting early", self.step, self.total_steps)
                break
        stop.restore()
        bar.close()
        logf.close()
        if needs_data:
            self.save_checkpoint()
            log.warning("step %d: %.1f passes over %d sequences (--max-passes %g): checkpointed, grow the data first",
                        self.step, self.passes(), len(self.data), self.tcfg.max_passes)
            return {**last, "step": self.step, "needs_data": True}
        if stop.requested:
            log.warning("SIGTERM at step %d/%d: checkpointed, not exported", self.step, self.total_steps)
            raise SystemExit(128 + signal.SIGTERM)
        if paused:
            return {**last, "step": self.step, "paused": True}
        save_drafter(self.model, self.out)
        return last
