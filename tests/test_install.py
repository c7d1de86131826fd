"""The second SGLang environment of .ci/run layers over the *current* environment, virtualenv or not.

`python -m venv --system-site-packages`, run from inside a virtualenv, layers over the base interpreter instead of
that virtualenv (what broke `bash .ci/run` for users who install into a virtualenv). A probe module that exists
only in the parent virtualenv must import in the layered one, next to torch and the project; one installed into the
layered environment itself must win (it shadows SGLang's pins). No SGLang needed: seconds.
"""
from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _purelib(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _run(py: Path, code: str) -> str:
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _site_dirs() -> list[str]:
    """This interpreter's site-packages directories (a virtualenv's, its base's where it inherits them, a conda
    env's, Debian's dist-packages, the user site), in its sys.path order."""
    dirs = [e for e in sys.path if Path(e).name in ("site-packages", "dist-packages") and Path(e).is_dir()]
    return list(dict.fromkeys(dirs))


def _user_venv(tmp_path: Path) -> Path:
    """The user's virtualenv (its python): it sees torch and the project exactly as this environment does, and has
    one package of its own, which neither this environment nor its base interpreter has.

    Not `--system-site-packages`: from inside a virtualenv (the newcomer's `python3 -m venv venv`, activated), that
    layers over the *base* interpreter, which lacks torch. Instead a plain virtualenv on this environment's base
    executable, with a `.pth` that adds this interpreter's site-packages directories after its own, through
    `site.addsitedir` so their `.pth` files (the project's editable install) are read too."""
    parent = tmp_path / "user_venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(parent)
    parent_py = parent / "bin" / "python"
    own = _purelib(parent_py)
    (own / "_dflash_test_parent.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in _site_dirs() if d != str(own)))
    (own / "dflash_layer_probe.py").write_text("WHERE = 'parent virtualenv'\n")
    where = "import torch, dflash_sglang; print(torch.__file__, dflash_sglang.__file__)"
    assert _run(parent_py, where) == _run(Path(sys.executable), where)  # the same torch and project as here
    return parent_py


def test_layered_venv_sees_the_parent_virtualenv_and_shadows_it(tmp_path: Path) -> None:
    parent_py = _user_venv(tmp_path)
    parent = parent_py.parents[1]

    layered = tmp_path / "sglang_venv"
    made = subprocess.run([str(parent_py), str(REPO / ".ci" / "layered_venv.py"), str(layered)],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert f"over {parent}" in made.stdout, made.stdout  # the one-line report names the parent environment
    py = layered / "bin" / "python"

    probe = "import dflash_layer_probe, torch, dflash_sglang; print(dflash_layer_probe.WHERE, torch.__version__)"
    where, torch_version = _run(py, probe).rsplit(" ", 1)
    assert where == "parent virtualenv"
    assert torch_version == _run(Path(sys.executable), "import torch; print(torch.__version__)")

    # What the layered environment installs itself comes first (SGLang's pins shadow the parent's packages).
    (_purelib(py) / "dflash_layer_probe.py").write_text("WHERE = 'layered env'\n")
    assert _run(py, "import dflash_layer_probe; print(dflash_layer_probe.WHERE)") == "layered env"
    assert _run(parent_py, "import dflash_layer_probe; print(dflash_layer_probe.WHERE)") == "parent virtualenv"

    # Re-running (as every .ci/run does) keeps the environment and its own packages.
    again = subprocess.run([str(parent_py), str(REPO / ".ci" / "layered_venv.py"), str(layered)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert _run(py, "import dflash_layer_probe; print(dflash_layer_probe.WHERE)") == "layered env"


def test_base_venv_flag_misses_the_parent_virtualenv(tmp_path: Path) -> None:
    """The failure mode this guards against, shown: --system-site-packages from inside a virtualenv skips it."""
    parent_py = _user_venv(tmp_path)
    naive = tmp_path / "naive"
    subprocess.run([str(parent_py), "-m", "venv", "--system-site-packages", "--without-pip", str(naive)], check=True)
    out = subprocess.run([str(naive / "bin" / "python"), "-c", "import dflash_layer_probe"], capture_output=True,
                         text=True, cwd="/")
    assert out.returncode != 0 and "No module named 'dflash_layer_probe'" in out.stderr
