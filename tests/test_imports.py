import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_needs_neither_sglang_nor_cuda():
    code = (
        "import sys, dflash_sglang, dflash_sglang.core.reference, dflash_sglang.cli;"
        "import torch;"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'sglang imported';"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# bench/: the benchmarks run from a checkout only (pyproject's comment): never in the wheel
CHECKOUT_ONLY = {"dflash_sglang.bench", *(f"dflash_sglang.bench.{d}" for d in ("common", "engine", "serving", "memory",
                                                                                 "soak", "gpu", "gpu.train"))}


def test_wheel_lists_every_subpackage_and_the_kernel_sources():
    """pyproject lists packages explicitly (cuda/ ships as dflash_sglang._cuda); a new subpackage must be added, or
    named checkout-only here."""
    import tomllib

    root = REPO
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {str(p.parent.relative_to(root)).replace("/", ".") for p in (root / "dflash_sglang").rglob("__init__.py")}
    assert CHECKOUT_ONLY <= on_disk
    assert set(tool["packages"]) == (on_disk - CHECKOUT_ONLY) | {"dflash_sglang._cuda"}
    assert tool["package-dir"]["dflash_sglang._cuda"] == "cuda"
    patterns = tool["package-data"]["dflash_sglang._cuda"]
    assert all(any(p.match(pat) for pat in patterns) for p in (root / "cuda").iterdir() if p.is_file())


def test_every_dflash_environment_variable_is_documented():
    """Every `DFLASH_*` environment variable the package reads (a string constant naming one, as `os.environ.get`
    and the refusal of retired ones take it) is a row of the serving guide's environment table
    (docs/serving-flags.md). bench/ is left out: its variables configure the measurements, documented in its modules."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    package = root / "dflash_sglang"
    name = re.compile(r"DFLASH_[A-Z0-9_]+")
    read = {node.value: path.relative_to(root)
            for path in package.rglob("*.py") if "bench" not in path.relative_to(package).parts
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.fullmatch(node.value)}
    assert {"DFLASH_SGLANG_IMPL", "DFLASH_DEFER_PLAIN_UPKEEP"} <= set(read)  # (the scan finds what it looks for)
    table = (root / "docs" / "serving-flags.md").read_text().split("| Environment |", 1)[1].split("\n\n", 1)[0]
    missing = {v: str(path) for v, path in read.items() if f"`{v}`" not in table}
    assert not missing, f"read but not in docs/serving-flags.md's environment table: {missing}"


def test_the_wheel_holds_what_the_product_imports():
    """Every dflash_sglang module that the command line and the demo import lies in a package the wheel lists
    (pyproject [tool.setuptools] packages): the checkout-only benchmarks may stay out of it, what the product runs may
    not."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    code = ("import sys, dflash_sglang.cli, dflash_sglang.demo.main, dflash_sglang.demo.engines; "
            "print(*sorted(m for m in sys.modules if m.startswith('dflash_sglang.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = out.stdout.split()
    assert "dflash_sglang.measure.passes" in loaded  # (the demo's timed passes: the check sees them)
    packages = {m if (REPO / m.replace(".", "/") / "__init__.py").is_file() else m.rpartition(".")[0] for m in loaded}
    assert packages <= listed and not packages & CHECKOUT_ONLY, sorted(packages - listed)
