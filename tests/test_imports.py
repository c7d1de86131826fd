import subprocess
import sys


def test_import_needs_neither_sglang_nor_cuda():
    code = (
        "import sys, dflash_sglang, dflash_sglang.core.reference, dflash_sglang.cli;"
        "import torch;"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'sglang imported';"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wheel_lists_every_subpackage_and_the_kernel_sources():
    """pyproject lists packages explicitly (cuda/ ships as dflash_sglang._cuda); a new subpackage must be added."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {str(p.parent.relative_to(root)).replace("/", ".") for p in (root / "dflash_sglang").rglob("__init__.py")}
    assert set(tool["packages"]) == on_disk | {"dflash_sglang._cuda"}
    assert tool["package-dir"]["dflash_sglang._cuda"] == "cuda"
    patterns = tool["package-data"]["dflash_sglang._cuda"]
    assert all(any(p.match(pat) for pat in patterns) for p in (root / "cuda").iterdir() if p.is_file())
