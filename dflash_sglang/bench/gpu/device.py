"""What the lent device asks of the code that runs there, for the GPU session and the training window alike: results
come back as whole files under $OUT (at most 8 of 16 MiB each, and a call killed at its timeout returns what is
there: `write_whole` never leaves a half-written report, `pack_logs` puts every log's tail in one archive), and
nothing there may call git (the device gets a copy of the working tree with no promise of a `.git`: `git_trap`
proves it in the CPU rehearsals)."""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

LOG_TAIL = 200_000  # bytes of each log kept in logs.tar.gz


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a reader never sees half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def pack_logs(work: Path, dest: Path, recursive: bool = True) -> None:
    """The last LOG_TAIL bytes of every *.log under `work` (in its sub-folders too when `recursive`), in one archive,
    named by their paths under `work`."""
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for log in sorted(work.rglob("*.log") if recursive else work.glob("*.log")):
            data = log.read_bytes()[-LOG_TAIL:]
            info = tarfile.TarInfo(str(log.relative_to(work)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest)


def git_trap(folder: Path) -> dict[str, str]:
    """An environment whose first `git` on PATH appends its call to folder/called ("git ARGS") and fails (exit 97)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "called").unlink(missing_ok=True)
    (folder / "git").write_text(f'#!/bin/sh\necho "git $*" >> {folder}/called\nexit 97\n')
    (folder / "git").chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}
