"""Create a virtualenv that layers over the environment of the interpreter running this script.

    python .ci/layered_venv.py DIR

`python -m venv --system-site-packages` layers over the *base* interpreter's site-packages, not over the active
virtualenv's (its pyvenv.cfg `home` is the base Python): run from inside a virtualenv, the new environment would
lack torch, the test packages and the project. Instead the new environment gets a `.pth` file that adds every
site-packages directory of this interpreter (a virtualenv's, its base's where it inherits them, a conda env's, the
user site) *after* its own, through `site.addsitedir` so their `.pth` files (editable installs) are read too.
What is installed into DIR (SGLang's pins) shadows what the current environment has; everything else comes from it.
Idempotent: an existing DIR keeps its packages and gets its `.pth` rewritten, unless it was made from another base
Python than this interpreter's (its packages would not fit this environment's): then it is made afresh.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

PTH = "_dflash_layer_over_parent.pth"


def parent_site_dirs() -> list[str]:
    """This interpreter's site-packages directories, in its own sys.path order."""
    seen: list[str] = []
    for entry in sys.path:
        p = Path(entry)
        if p.name in ("site-packages", "dist-packages") and p.is_dir() and str(p) not in seen:
            seen.append(str(p))
    return seen


def same_base(target: Path) -> bool:
    """Whether the virtualenv at `target` runs the base Python this interpreter runs on (its pyvenv.cfg `home`)."""
    cfg = target / "pyvenv.cfg"
    homes = [v.strip() for k, _, v in (line.partition("=") for line in cfg.read_text().splitlines())
             if k.strip() == "home"] if cfg.is_file() else []
    here = Path(os.path.abspath(sys._base_executable)).parent  # what venv writes as `home`
    return bool(homes) and Path(homes[0]).resolve() == here.resolve()


def create(target: Path) -> Path:
    """The layered environment at `target` (created if missing or made from another base Python); returns its
    python."""
    py = target / "bin" / "python"
    if not (py.exists() and same_base(target)):
        venv.EnvBuilder(with_pip=True, symlinks=True, clear=(target / "pyvenv.cfg").is_file()).create(target)
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in parent_site_dirs() if d != own]
    (Path(own) / PTH).write_text("\n".join(lines) + "\n")
    return py


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/layered_venv.py DIR")
    where = create(Path(sys.argv[1]))
    print(f"layered_venv: {sys.argv[1]} over {sys.prefix} (site dirs: {', '.join(parent_site_dirs())})")
