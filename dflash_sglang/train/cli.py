"""`dflash-sglang train`: prompts -> (target-regenerated) responses + cached target features -> DFlash drafter.

Stages (each resumable): 1. pick training prompts (ShareGPT train split, chat template applied), and the
held-out ones right after them (--val-samples);
2. build the feature cache in --cache-dir (greedy regeneration by the target, or the dataset replies with
--no-regenerate); 3. train the drafter (checkpoints in OUT/checkpoints, resumed automatically);
4. write OUT/config.json + OUT/model.safetensors in the z-lab format. The held-out sequences' numbers (loss,
top-1 accuracy by block position, tau estimate) are logged at every checkpoint and end in train_summary.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from ..core.draft.config import DraftConfig, build_target_layer_ids
from ..core.draft.token_map import build_token_map, token_counts
from .objective import ACCEPT_GAMMA, DEFAULT_DISTILL_WEIGHT
from .prepare import Example, build_cache
from .shards import list_shards, load_cache
from .trainer import FrozenTarget, TrainConfig, Trainer
from .warm_start import check_init_checkpoint, load_init_weights, warm_start_from_target

log = logging.getLogger(__name__)
NEEDS_DATA = 3  # exit code: --max-passes reached, checkpointed; grow the cache and resume
# Special tokens that never occur in chat text, by preference. <empty_output> is SmolLM2's jupyter-notebook
# marker: a real embedding row, outside the chat template, never produced by tokenizing ordinary text.
MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<mask>", "<|mask|>", "<empty_output>")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None,
                   help="HF target directory (default: the SmolLM2-135M testbed target, converted on first use)")
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (the packaged ShareGPT V3, train split) or a ShareGPT-format JSON file")
    p.add_argument("--out", type=Path, required=True, help="output draft directory")
    p.add_argument("--cache-dir", type=Path, default=None, help="feature cache (default OUT/cache)")
    p.add_argument("--extra-cache", type=Path, nargs="+", default=[],
                   help="more feature caches (same layer ids) to train on, e.g. one built with --no-regenerate")
    d = p.add_argument_group("data")
    d.add_argument("--num-samples", type=int, default=2048, help="training prompts")
    d.add_argument("--skip-samples", type=int, default=0,
                   help="leave out the first N train-split prompts, e.g. the 6144 the shipped drafter was trained on "
                        "when fine-tuning it (its training data are the first 6144)")
    d.add_argument("--val-samples", type=int, default=64,
                   help="held-out prompts: the train-split prompts right after the training ones, prepared the same "
                        "way into CACHE/val and never trained on; their loss, top-1 accuracy by block position and "
                        "tau estimate are logged at every checkpoint (0: none)")
    d.add_argument("--max-prompt-tokens", type=int, default=256)
    d.add_argument("--max-new-tokens", type=int, default=128, help="regenerated response length cap")
    d.add_argument("--no-regenerate", action="store_true", help="train on the dataset replies, not the target's")
    d.add_argument("--gen-batch-size", type=int, default=64)
    d.add_argument("--data-time-budget-min", type=float, default=None,
                   help="stop building the cache after this long (complete shards are kept)")
    d.add_argument("--skip-prepare", action="store_true", help="train on the shards already in the cache")
    d.add_argument("--prepare-only", action="store_true", help="build the cache, do not train")
    m = p.add_argument_group("drafter")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    m.add_argument("--num-features", type=int, default=5, help="target layers fused (uniform over 1..L-3)")
    m.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    m.add_argument("--mask-token-id", type=int, default=None, help=f"default: first of {MASK_TOKEN_CANDIDATES}")
    m.add_argument("--draft-vocab", type=int, default=0,
                   help="K > 0: reduced draft vocabulary, the K most frequent tokens of the cached (regenerated) "
                        "responses; the head and the loss use only their K lm_head rows (labels outside are misses) "
                        "and OUT gets token_map.safetensors. 0: the full vocabulary")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    t.add_argument("--time-budget-min", type=float, default=None,
                   help="fit the warmup+cosine schedule into this many minutes (step time measured on the first "
                        "10 steps); hard stop with checkpoint + export at the limit")
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    t.add_argument("--num-anchors", type=int, default=32, help="blocks per sequence")
    t.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {SCRATCH_LR:g} from --init target/random; {FINETUNE_LR:g} "
                        "from a draft checkpoint, where the schedule only anneals)")
    t.add_argument("--warmup-ratio", type=float, default=None,
                   help="share of the steps spent warming up (default 0.04 from --init target/random; 0 from a draft "
                        "checkpoint: a fine-tune never warms a trained drafter up to a high lr again)")
    t.add_argument("--gamma", type=float, default=None,
                   help=f"position-weight decay exp(-(k-1)/gamma) (default {ACCEPT_GAMMA:g}: follows the acceptance "
                        f"by block position of the shipped drafter, objective.py; the paper's B = 16 value is 7)")
    t.add_argument("--distill-weight", type=float, default=DEFAULT_DISTILL_WEIGHT,
                   help="loss = (1 - w) * CE on the target's token + w * KL(target || draft) on its whole "
                        "distribution (from the target's final hidden state in the cache; with --draft-vocab over the "
                        "K mapped ids, renormalised). 0: CE only")
    t.add_argument("--distill-temperature", type=float, default=1.0,
                   help="softmax temperature of both distributions in the KL term (scaled by T^2)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--max-passes", type=float, default=None,
                   help="stop (checkpointed, exit code 3) once the steps have visited the cached sequences this many "
                        "times on average: a resumed run with a grown cache goes on")
    t.add_argument("--val-every", type=int, default=None,
                   help="held-out pass every N steps (default: at every checkpoint)")
    t.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    t.add_argument("--init", default="target",
                   help="'target': start the draft layers as copies of the target layers after the deepest fused "
                        "feature (needs the target's layer shapes); 'random': HF-style random init; a draft "
                        "checkpoint directory: continue training it (same shapes, layer ids, block size, mask token)")
    t.add_argument("--output-norm-init", default="0.05",
                   help="initial drafter output-norm weight, or 'target' to copy the target's final norm")
    t.add_argument("--bf16", choices=tuple(BF16_CHOICES), default="auto",
                   help="bf16 autocast: auto = on GPUs and on CPUs with AVX512-BF16/AMX (an AVX2 CPU emulates bf16, "
                        "many times slower than fp32: docs/benchmarks.md)")
    t.add_argument("--no-bf16", action="store_const", const="off", dest="bf16", help="same as --bf16 off")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")


BF16_CHOICES = {"auto": None, "on": True, "off": False}  # --bf16 -> TrainConfig.bf16
SCRATCH_LR, SCRATCH_WARMUP = 6e-4, 0.04
# A fine-tune of a trained drafter (no optimizer state to restore) anneals from a low lr: a fresh warm-up to 6e-4
# undid what the shipped drafter knew (held-out tau_est fell 0.037 in 12 steps, docs/benchmarks.md 2026-11-26). 2e-4
# is twice where the shipped drafter's own schedule ended (1e-3 cosine to 1e-4).
FINETUNE_LR, FINETUNE_WARMUP = 2e-4, 0.0


def resolve_schedule(init: str, lr: float | None, warmup_ratio: float | None) -> tuple[float, float]:
    """(peak lr, warm-up ratio) for --init and the flags given (None: the default for that start)."""
    finetune = init not in ("target", "random")
    lr = lr if lr is not None else (FINETUNE_LR if finetune else SCRATCH_LR)
    warmup = warmup_ratio if warmup_ratio is not None else (FINETUNE_WARMUP if finetune else SCRATCH_WARMUP)
    if lr <= 0 or not 0 <= warmup < 1:
        raise ValueError(f"--lr must be > 0 and --warmup-ratio in [0, 1), got {lr} and {warmup}")
    if finetune and warmup > 0 and lr > FINETUNE_LR:
        log.warning("--init %s with --warmup-ratio %g to --lr %g: warming a trained drafter up to a high lr undoes "
                    "what it learnt (the default anneals from %g)", init, warmup, lr, FINETUNE_LR)
    return lr, warmup


def pick_mask_token(tokenizer, explicit: int | None, vocab_size: int) -> int:
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ValueError(f"--mask-token-id {explicit} is not a row of the target embedding (vocab {vocab_size})")
        return explicit
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_CANDIDATES:
        if name in vocab and vocab[name] < vocab_size:
            return vocab[name]
    raise ValueError(f"no mask token among {MASK_TOKEN_CANDIDATES} in the target vocabulary; pass --mask-token-id")


def draft_config(target_cfg, args, mask_token_id: int) -> DraftConfig:
    n_layers = target_cfg.num_hidden_layers
    ids = tuple(args.target_layer_ids or build_target_layer_ids(n_layers, args.num_features))
    rope = getattr(target_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0))
    heads = target_cfg.num_attention_heads
    return DraftConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=args.intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_cfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // heads,
        vocab_size=target_cfg.vocab_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        block_size=args.block_size,
        num_target_layers=n_layers,
        rope_theta=float(theta),
        max_position_embeddings=target_cfg.max_position_embeddings,
    )


def _examples(args, tokenizer) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: --num-samples distinct train-split prompts after the first --skip-samples,
    then the next --val-samples distinct ones.

    Distinct: ShareGPT splits long conversations into parts with one base id, which sort next to each other, and a
    later part's first human turn is often the same "continue" (the 48 prompts after the first 6144 held 11 distinct
    ones, 36 of them "Please continue"; the first 6144 hold 5795): a repeated prompt regenerates the same greedy
    response, so it costs data-preparation time for no new data and weighs one reply many times in the held-out
    numbers. A prompt among the skipped ones is dropped too (the shipped drafter trained on those).
    """
    from ..testbed.data import load_split, make_prompts

    path = None if args.data == "sharegpt" else Path(args.data)
    convs = load_split("train", path)
    want = args.num_samples + args.val_samples
    n = args.skip_samples + 2 * want
    while True:
        raw = make_prompts(convs, tokenizer, n, args.max_prompt_tokens)
        seen = {p.ids for p in raw[: args.skip_samples]}
        prompts = []
        for p in raw[args.skip_samples :]:
            if p.ids not in seen:
                seen.add(p.ids)
                prompts.append(p)
        if len(prompts) >= want or len(raw) < n:  # enough, or the split has no more
            break
        n *= 2
    prompts = prompts[:want]

    def example(p) -> Example | None:
        if not args.no_regenerate:
            return Example(p.ids)
        if not p.reference:
            return None
        reply = tokenizer(p.reference + "<|im_end|>", add_special_tokens=False)["input_ids"]
        return Example(p.ids, tuple(reply[: args.max_new_tokens]))

    def examples(ps) -> list[Example]:
        return [e for e in map(example, ps) if e is not None]

    return examples(prompts[: args.num_samples]), examples(prompts[args.num_samples :])


def draft_token_map(data, k: int, vocab_size: int):
    """[K] int64: the K most frequent response tokens of the training sequences (None for k = 0). Responses only:
    they are what the drafter proposes (prompt tokens are never drafted)."""
    if not k:
        return None
    counts = token_counts((s.tokens[s.prompt_len:] for s in data), vocab_size)
    token_map = build_token_map(counts, k)
    log.info("draft vocabulary: %d of %d tokens cover %.2f%% of the %d response tokens", k, vocab_size,
             100 * float(counts[token_map].sum()) / max(1, int(counts.sum())), int(counts.sum()))
    return token_map


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from ..testbed.target import convert_target, load_target

    if args.val_samples < 0:
        raise ValueError(f"--val-samples must be >= 0, got {args.val_samples}")
    if args.skip_samples < 0:
        raise ValueError(f"--skip-samples must be >= 0, got {args.skip_samples}")
    if not 0 <= args.distill_weight <= 1 or args.distill_temperature <= 0:
        raise ValueError(f"--distill-weight must lie in [0, 1] and --distill-temperature be > 0, got "
                         f"{args.distill_weight} and {args.distill_temperature}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0: full vocabulary), got {args.draft_vocab}")
    lr, warmup = resolve_schedule(args.init, args.lr, args.warmup_ratio)  # before the target is read
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_dir = args.target or convert_target()
    target, tok = load_target(target_dir, device=device)
    mask_id = pick_mask_token(tok, args.mask_token_id, target.config.vocab_size)
    cfg = draft_config(target.config, args, mask_id)
    if args.draft_vocab > cfg.vocab_size:
        raise ValueError(f"--draft-vocab {args.draft_vocab} exceeds the target vocabulary ({cfg.vocab_size})")
    init_dir = None if args.init in ("target", "random") else Path(args.init)
    if init_dir is not None:
        check_init_checkpoint(init_dir, cfg)  # now, not after minutes of data preparation
    cache = args.cache_dir or args.out / "cache"
    val_cache = cache / "val"
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if not (args.skip_prepare and list_shards(cache)):
        examples, val_examples = _examples(args, tok)
        log.info("%d training examples, %d held out (%s)", len(examples), len(val_examples),
                 "regenerated" if not args.no_regenerate else "dataset")
        if args.val_samples and not val_examples:
            log.warning("--val-samples %d: no train-split prompts left after the %d training ones; no validation",
                        args.val_samples, len(examples))
        prepare = dict(regenerate=not args.no_regenerate, max_new_tokens=args.max_new_tokens,
                       eos_id=tok.eos_token_id, batch_size=args.gen_batch_size)
        if val_examples:  # first and without the time budget: a few batches, and a run cut short keeps them
            build_cache(target, val_examples, val_cache, cfg.target_layer_ids, progress=False, **prepare)
        budget = None if args.data_time_budget_min is None else 60 * args.data_time_budget_min
        build_cache(target, examples, cache, cfg.target_layer_ids, time_budget_s=budget, **prepare)
    t_data = time.monotonic() - t0
    if args.prepare_only:
        print(json.dumps({"cache": str(cache), "shards": len(list_shards(cache)), "data_time_s": round(t_data)}))
        return 0
    frozen = FrozenTarget.from_model(target)
    data = load_cache(cache, cfg.target_layer_ids)
    for extra in args.extra_cache:
        data += load_cache(extra, cfg.target_layer_ids)
    val_data = load_cache(val_cache, cfg.target_layer_ids) if args.val_samples and list_shards(val_cache) else []
    tcfg = TrainConfig(epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                       num_anchors=args.num_anchors, lr=lr, warmup_ratio=warmup, gamma=args.gamma,
                       distill_weight=args.distill_weight, distill_temperature=args.distill_temperature,
                       seed=args.seed, save_every=args.save_every, val_every=args.val_every, max_passes=args.max_passes,
                       bf16=BF16_CHOICES[args.bf16],
                       output_norm_init=None if args.output_norm_init == "target" else float(args.output_norm_init))
    token_map = draft_token_map(data, args.draft_vocab, cfg.vocab_size)
    trainer = Trainer(cfg, tcfg, frozen, data, args.out, device, val_data=val_data, token_map=token_map)
    if not trainer.maybe_resume():
        if init_dir is not None:
            load_init_weights(trainer.model, init_dir)
        elif args.init == "target":
            sample = torch.cat([s.features[s.prompt_len :] for s in data[:16]])
            warm_start_from_target(trainer.model, target, sample.to(trainer.device))
    del target  # from here training needs only the embedding, head and final norm
    log.info("training on %d sequences (%d tokens), %d steps, %d held-out sequences", len(data),
             sum(len(s.tokens) for s in data), trainer.total_steps, len(val_data))
    t1 = time.monotonic()
    last = trainer.train(time_budget_s=None if args.time_budget_min is None else 60 * args.time_budget_min)
    if last.get("needs_data"):
        print(json.dumps({"needs_data": True, "step": trainer.step, "passes": round(trainer.passes(), 2),
                          "sequences": len(data)}))
        return NEEDS_DATA
    summary = {"target": str(target_dir), "init": args.init, "data": args.data, "sequences": len(data),
               "draft_vocab": args.draft_vocab or cfg.vocab_size, "lr": lr, "warmup_ratio": warmup,
               "gamma": trainer.gamma, "distill_weight": args.distill_weight,
               "held_out": len(val_data), "steps": trainer.total_steps,
               "data_time_s": round(t_data), "train_time_s": round(time.monotonic() - t1), "device": str(device),
               "final": last}
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0

