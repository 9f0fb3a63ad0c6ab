"""Files written whole or not at all, with the modes a plain `open` or `mkdir` would give them.

A temporary file or directory beside the target is renamed over it once complete, so a reader (a
reloading browser, a resume, another user's vLLM server) never sees half of one. Temporary files
(mkstemp: 0600, mkdtemp: 0700) and safetensors' writer (0600 whatever the umask) make files others
cannot read: `open_modes` gives a finished tree the modes the process's umask allows.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, IO


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc), else set and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_modes(root: Path) -> None:
    """Give `root` (a file, or a directory and everything below it) the modes a plain open() or
    mkdir() would have given: 0o666 or 0o777 less the umask."""
    mask = umask()
    root = Path(root)
    if root.is_file():
        root.chmod(0o666 & ~mask)
        return
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call write(binary file) on a temp file beside `path`, then rename it over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        open_modes(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
