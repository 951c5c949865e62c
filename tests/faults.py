"""Real faults for tests and tools/chaos: a small tmpfs as a full disk, network namespaces
joined by a veth pair as a partition. Each helper undoes what it set up; each says why it
cannot run (not root, no such kernel feature) so callers skip with that reason."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SmallDisk", "cannot_mount"]


def cannot_mount() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs (a small disk to fill) needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount are not installed"
    return None


class SmallDisk:
    """A tmpfs of ``size_mb`` mounted at ``path``: fill() makes it full, free() empties the
    filler again. Use as a context manager: it unmounts on exit, whatever happened."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = Path(path)
        self.size_mb = size_mb
        self.filler = self.path / "filler"

    def __enter__(self) -> "SmallDisk":
        self.path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs",
                                 str(self.path)], capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"cannot mount a tmpfs at {self.path}: {result.stderr.strip()}")
        return self

    def __exit__(self, *exc: object) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)  # still in use: detach

    def fill(self) -> None:
        """Take every free byte (writes until ENOSPC, in smaller and smaller pieces)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for size in (1 << 20, 1 << 12, 1):
                piece = b"\0" * size
                while True:
                    try:
                        if os.write(fd, piece) < size:
                            break
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
