"""Deployment recipes: `recipes/<family>.toml` -> the exact `sglang.launch_server` command line and environment.

One parametrized builder serves the launcher (`recipes/launch.py`), the benchmark scripts (`--recipe`) and the
recipe test, so what is tested is what is launched. A recipe file holds the model pair and one `[hw.<name>]`
table per hardware (h100, h200, b200, b300) with `tp`, `attention_backend`, `draft_attention_backend`,
`mem_fraction_static`, `cuda_graph_bs`, `max_running_requests`, optional `args`/`env`, and `measured` (the
result line, or "not yet measured"). `--impl` picks the DFLASH worker: ours (this package), builtin (SGLang's
own, via DFLASH_SGLANG_IMPL=builtin) or none (no speculation: the baseline). The default is ours wherever our
worker supports the table (`ours_refusal`), else builtin; asking for ours on a table it cannot serve is a
RecipeError naming the file, table and field. `draft_attention_backend` is the builtin's draft backend; our worker
drafts with FlashInfer (its paged draft attention) on every table. Attention backends are checked against the hardware
generation at load (FA3 is Hopper-only, FA4 and TRT-LLM MHA Blackwell-only).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[3] / "recipes"
IMPL_ENV = "DFLASH_SGLANG_IMPL"
OURS_DRAFT_BACKEND = "flashinfer"  # our drafter's paged attention on GPU (adapter/draft/attention.py)
IMPLS = ("ours", "builtin", "none")
PD_SIDES = ("prefill", "decode")  # PD disaggregation: one server of each behind sglang-router (recipes/pd.md)
PD_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
HARDWARE = ("h100", "h200", "b200", "b300")
_HW_KEYS = {"tp", "attention_backend", "draft_attention_backend", "mem_fraction_static", "cuda_graph_bs",
            "max_running_requests", "args", "env", "measured", "builtin_only"}
_TOP_KEYS = {"name", "target", "draft", "block_size", "args", "env", "hw", "experimental"}
EXPERIMENTAL_FLAG = "--speculative-dflash-experimental"  # ours on a pair not yet validated end to end on a GPU
GENERATION = {"h100": "hopper", "h200": "hopper", "b200": "blackwell", "b300": "blackwell"}
# SGLang attention backends per GPU generation (fa3 needs sm90; fa4, trtllm_mha and trtllm_mla (MLA targets) sm100).
BACKENDS = {"hopper": ("flashinfer", "fa3", "triton"),
            "blackwell": ("flashinfer", "fa4", "trtllm_mha", "trtllm_mla", "triton")}


class RecipeError(ValueError):
    """A recipe file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class HwConfig:
    tp: int
    attention_backend: str
    draft_attention_backend: str
    mem_fraction_static: float
    cuda_graph_bs: tuple[int, ...]
    max_running_requests: int
    measured: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    builtin_only: str = ""  # why our worker cannot serve this table (e.g. a target with recurrent layers); "": it can


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    target: str
    draft: str
    block_size: int
    hw: dict[str, HwConfig]
    header: str  # the leading comment block
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    experimental: bool = False  # ours serves this pair only with EXPERIMENTAL_FLAG (hybrid targets, Gemma 4 drafts)

    def ours_refusal(self, hw: str) -> str | None:
        """Why dflash-sglang's worker cannot serve this table (None: it can): the table's `builtin_only` reason, e.g. a
        target with recurrent layers (adapter/boot/draft_checks.py refuses those at start-up)."""
        h = self.on(hw)
        if h.builtin_only:
            return f"{self.path} [hw.{hw}]: field 'builtin_only' = {h.builtin_only!r}"
        return None

    def default_impl(self, hw: str) -> str:
        return "builtin" if self.ours_refusal(hw) else "ours"

    def server_args(self, hw: str, impl: str | None = None, target: str | None = None, draft: str | None = None,
                    extra: list[str] | tuple[str, ...] = (), max_running_requests: int | None = None,
                    pd: str | None = None, bootstrap_port: int = PD_BOOTSTRAP_PORT) -> list[str]:
        """`sglang.launch_server` arguments for this recipe on `hw` (model paths and the request cap overridable);
        impl None: `default_impl(hw)`; pd: this server's PD side (its KV moved by the mooncake transfer engine, the
        prefill side listening on `bootstrap_port` for its decode peers), None: a whole server."""
        impl = impl or self.default_impl(hw)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "ours" and (why := self.ours_refusal(hw)):
            raise RecipeError(f"{why}; use --impl builtin (SGLang's DFLASH) for this table")
        h = self.on(hw)
        argv = ["--model-path", target or self.target, "--tp-size", str(h.tp),
                "--attention-backend", h.attention_backend,
                "--mem-fraction-static", str(h.mem_fraction_static),
                "--max-running-requests", str(max_running_requests or h.max_running_requests),
                "--cuda-graph-bs-decode", *map(str, h.cuda_graph_bs)]
        if impl != "none":
            argv += ["--speculative-algorithm", "DFLASH",
                     "--speculative-draft-model-path", draft or self.draft,
                     "--speculative-num-draft-tokens", str(self.block_size),
                     "--speculative-draft-attention-backend",
                     OURS_DRAFT_BACKEND if impl == "ours" else h.draft_attention_backend]
        ours = [EXPERIMENTAL_FLAG] if impl == "ours" and self.experimental else []
        if pd is not None:
            if pd not in PD_SIDES:
                raise ValueError(f"pd must be one of {PD_SIDES}, got {pd!r}")
            argv += ["--disaggregation-mode", pd, "--disaggregation-transfer-backend", "mooncake"]
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)] if pd == "prefill" else []
        return argv + list(self.args) + list(h.args) + ours + list(extra)

    def server_env(self, hw: str, impl: str | None = None) -> dict[str, str]:
        """Environment additions; the worker choice is DFLASH_SGLANG_IMPL (unset for the no-speculation arm)."""
        impl = impl or self.default_impl(hw)
        env = {**self.env, **self.on(hw).env}
        if impl != "none":
            env[IMPL_ENV] = impl
        return env

    def command(self, hw: str, impl: str | None = None, **kw) -> str:
        """A copy-pasteable shell command."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.server_env(hw, impl).items()))
        argv = shlex.join(["python", "-m", "sglang.launch_server", *self.server_args(hw, impl, **kw)])
        return f"{env} {argv}" if env else argv

    def on(self, hw: str) -> HwConfig:
        if hw not in self.hw:
            raise RecipeError(f"{self.path}: no [hw.{hw}] table; this recipe covers {sorted(self.hw)}")
        return self.hw[hw]


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _get(d: dict, key: str, typ, where: str):
    if key not in d:
        raise RecipeError(f"{where}: missing field '{key}'")
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        raise RecipeError(f"{where}: field '{key}' must be {typ.__name__}, got {v!r}")
    return v


def _strs(d: dict, key: str, where: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise RecipeError(f"{where}: field '{key}' must be a list of strings")
    return tuple(v)


def _env(d: dict, where: str) -> dict[str, str]:
    v = d.get("env", {})
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        raise RecipeError(f"{where}: field 'env' must be a table of strings")
    return dict(v)


def load(name_or_path: str | Path) -> Recipe:
    """A recipe by family name (`qwen3-8b`) or by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = RECIPES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise RecipeError(f"no recipe {name_or_path!r}; known: {names()}")
    d = _load_toml(path)
    where = str(path)
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise RecipeError(f"{where}: unknown fields {sorted(unknown)}")
    hws = {}
    for hw, t in _get(d, "hw", dict, where).items():
        w = f"{where} [hw.{hw}]"
        if hw not in HARDWARE:
            raise RecipeError(f"{w}: unknown hardware; use one of {HARDWARE}")
        if set(t) - _HW_KEYS:
            raise RecipeError(f"{w}: unknown fields {sorted(set(t) - _HW_KEYS)}")
        bs = _get(t, "cuda_graph_bs", list, w)
        if not bs or not all(isinstance(b, int) and b > 0 for b in bs):
            raise RecipeError(f"{w}: field 'cuda_graph_bs' must be a non-empty list of positive ints")
        hws[hw] = HwConfig(
            tp=_get(t, "tp", int, w), attention_backend=_get(t, "attention_backend", str, w),
            draft_attention_backend=_get(t, "draft_attention_backend", str, w),
            mem_fraction_static=_get(t, "mem_fraction_static", float, w), cuda_graph_bs=tuple(bs),
            max_running_requests=_get(t, "max_running_requests", int, w), measured=_get(t, "measured", str, w),
            args=_strs(t, "args", w), env=_env(t, w), builtin_only=str(t.get("builtin_only", "")),
        )
        allowed = BACKENDS[GENERATION[hw]]
        for key in ("attention_backend", "draft_attention_backend"):
            if t[key] not in allowed:
                raise RecipeError(f"{w}: field '{key}' = {t[key]!r} does not run on {GENERATION[hw]} GPUs; "
                                  f"use one of {allowed}")
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("# ").rstrip())
    return Recipe(
        name=_get(d, "name", str, where), path=path, target=_get(d, "target", str, where),
        draft=_get(d, "draft", str, where), block_size=_get(d, "block_size", int, where), hw=hws,
        header="\n".join(header), args=_strs(d, "args", where), env=_env(d, where),
        experimental=_opt_bool(d, "experimental", where),
    )


def _opt_bool(d: dict, key: str, where: str) -> bool:
    if not isinstance(d.get(key, False), bool):
        raise RecipeError(f"{where}: field '{key}' must be true or false, got {d[key]!r}")
    return d.get(key, False)


def names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def parse_ref(ref: str) -> tuple[Recipe, str]:
    """'qwen3-8b:h100' -> (recipe, 'h100')."""
    name, sep, hw = ref.partition(":")
    if not sep:
        raise RecipeError(f"recipe reference must be FAMILY:HW (e.g. qwen3-8b:h100), got {ref!r}")
    recipe = load(name)
    recipe.on(hw)
    return recipe, hw
