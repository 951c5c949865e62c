"""Real faults for tests and tools/chaos: a small tmpfs as a full disk, network namespaces
joined by a veth pair as a partition, libfaketime as a clock set back or forward, a FUSE
file system that loses what was not fsynced as a power cut. Each helper undoes what it set
up; each says why it cannot run (not root, no such kernel feature) so callers skip with
that reason."""

from __future__ import annotations

import errno
import functools
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["SmallDisk", "cannot_mount", "PowerLossDisk", "cannot_cut_power", "Partition", "cannot_partition", "cannot_drop_packets",
           "libfaketime", "moved_clock_env", "offset_seconds", "forget_moved_clock"]


def libfaketime() -> str | None:
    """The path of libfaketime's shared library (Debian package libfaketime, installed with
    faketime), or None."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                   + glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    return found[0] if found else None


def moved_clock_env(offset: str) -> dict[str, str]:
    """Environment variables that start a process with its wall clock moved by ``offset``
    (libfaketime syntax: ``-1h``, ``+8d``), the library preloaded directly. Not the
    ``faketime`` wrapper: it forks the program and names a POSIX semaphore after its own pid,
    which a SIGKILL leaves behind in /dev/shm, so a later wrapper that gets the same pid fails
    with "sem_open: File exists" (seen in CI). The monotonic clock is left alone: libfaketime's
    monotonic faking hangs Python's timed waits, and the point is a wall clock that jumps while
    time itself goes on. Callers check ``libfaketime()`` first."""
    library = libfaketime()
    if library is None:
        raise FileNotFoundError("libfaketime is not installed (Debian package faketime)")
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD", "")]))
    return {"LD_PRELOAD": preload, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def offset_seconds(offset: str) -> float:
    """Seconds in a relative libfaketime offset (``-1h`` -> -3600.0, ``+8d``, ``+30``)."""
    unit = _UNITS.get(offset[-1], None)
    return float(offset[:-1]) * unit if unit else float(offset)


def forget_moved_clock(pid: int) -> None:
    """Remove what libfaketime left in /dev/shm for a process that has ended (a semaphore and
    a shared segment named after its pid; it removes them itself only when the process ends
    through exit(), not on SIGKILL or os._exit). A
    stale pair does not break the preloaded library, which then shares nothing, but it
    would pile up over a long chaos run."""
    for name in (f"sem.faketime_sem_{pid}", f"faketime_shm_{pid}"):
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


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


# --- network partitions ------------------------------------------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def cannot_partition() -> str | None:
    """Why two network namespaces joined by a veth pair cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    probe = f"sbprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"this kernel cannot make network namespaces: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def cannot_drop_packets() -> str | None:
    """Why packets cannot be dropped at random (iptables' statistic match), or None."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (Debian package iptables)"
    return None


class Partition:
    """Two network namespaces, ``a`` and ``b``, joined by a veth pair, with addresses only
    inside them (10.213.x.1 and .2). ``cut()`` takes the link down, ``heal()`` brings it
    back, ``lossy(p)`` drops packets at random on both ends, ``clear()`` stops that. The
    namespaces (and the veth pair with them) are deleted on exit."""

    def __init__(self) -> None:
        tag = os.urandom(3).hex()
        self.ns = {"a": f"sba{tag}", "b": f"sbb{tag}"}
        self.dev = {"a": f"sva{tag}", "b": f"svb{tag}"}  # interface names: 15 bytes at most
        octet = int(tag[:2], 16) % 250 + 2
        self.ip = {"a": f"10.213.{octet}.1", "b": f"10.213.{octet}.2"}

    def __enter__(self) -> "Partition":
        steps = [("netns", "add", self.ns["a"]), ("netns", "add", self.ns["b"]),
                 ("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])]
        for side in "ab":
            steps += [("link", "set", self.dev[side], "netns", self.ns[side]),
                      ("-n", self.ns[side], "addr", "add", f"{self.ip[side]}/24", "dev", self.dev[side]),
                      ("-n", self.ns[side], "link", "set", self.dev[side], "up"),
                      ("-n", self.ns[side], "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                self.__exit__()
                raise OSError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        return self

    def __exit__(self, *exc: object) -> None:
        for side in "ab":
            _ip("netns", "del", self.ns[side])  # takes the veth end inside it along

    def prefix(self, side: str) -> list[str]:
        """Command prefix that runs a program inside namespace ``side``."""
        return ["ip", "netns", "exec", self.ns[side]]

    def cut(self) -> None:
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "down")

    def heal(self) -> None:
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "up")

    def lossy(self, probability: float) -> None:
        for side in "ab":
            subprocess.run([*self.prefix(side), "iptables", "-A", "INPUT", "-m", "statistic",
                            "--mode", "random", "--probability", str(probability), "-j", "DROP"],
                           capture_output=True, check=True)

    def clear(self) -> None:
        for side in "ab":
            subprocess.run([*self.prefix(side), "iptables", "-F", "INPUT"], capture_output=True)


# --- power loss ------------------------------------------------------------------------------------

POWERFS = Path(__file__).resolve().with_name("powerfs.py")


@functools.cache
def cannot_cut_power() -> str | None:
    """Why a PowerLossDisk cannot be mounted here, or None. Tries one mount (once per
    process): a container may refuse FUSE even to root."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse: fails without it)
    except ImportError:
        return "mfusepy is not installed (pip install mfusepy; servicebus's dev extra has it)"
    except OSError as exc:
        return f"libfuse cannot be loaded (Debian package libfuse3-3): {exc}"
    with tempfile.TemporaryDirectory(prefix="powerfs-probe-") as tmp:
        try:
            with PowerLossDisk(Path(tmp) / "mnt", timeout=10):
                pass
        except OSError as exc:
            return f"a FUSE file system cannot be mounted here: {exc}"
    return None


class PowerLossDisk:
    """A directory at ``path`` whose file data is kept in memory until fsynced, and lost at
    ``cut()`` as in a power cut (``tests/powerfs.py``, in a process of its own, so killing
    the processes that use it does not touch it). What survived is in ``backing``, which
    plays the disk (``path`` + ".disk" unless given). Use as a context manager: it unmounts
    on exit, whatever happened. The processes using it must be killed before ``cut()``: a
    power cut stops them too, and one that lived on would go on writing over what was lost."""

    def __init__(self, path: Path, backing: Path | None = None, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.backing = Path(backing) if backing is not None else self.path.with_name(self.path.name + ".disk")
        self.control = self.backing.with_name(self.backing.name + ".control")
        self.log = self.backing.with_name(self.backing.name + ".log")
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.cuts = 0
        self.dropped_bytes = 0  # what the cuts lost: proof that they were real

    def __enter__(self) -> "PowerLossDisk":
        self.path.mkdir(parents=True, exist_ok=True)
        self.backing.mkdir(parents=True, exist_ok=True)
        self.control.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            # Its own session: a signal to the tests' process groups never reaches it.
            self.proc = subprocess.Popen([sys.executable, str(POWERFS), str(self.backing), str(self.path),
                                          "--control", str(self.control)],
                                         stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._ask("ping")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise OSError(f"powerfs did not mount at {self.path}: {self.tail()}") from None
                time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        wait = 10.0
        if subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True).returncode != 0:
            # Busy (a file still open): detach it. The file system process would then live as
            # long as that file stays open: it is ended after a moment instead.
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
            wait = 2.0
        if self.proc is not None:
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        self.control.unlink(missing_ok=True)

    def _ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.timeout)
            conn.connect(str(self.control))
            conn.sendall(command.encode() + b"\n")
            answer = conn.makefile("r").readline().strip()
        if not answer.startswith("ok"):
            raise OSError(f"powerfs {command}: {answer!r}")
        return answer

    def _numbers(self, answer: str) -> dict[str, int]:
        return {key: int(value) for key, value in (word.split("=") for word in answer.split()[1:])}

    def cut(self) -> dict[str, int]:
        """Drop every write not fsynced. Returns ``dropped_files`` and ``dropped_bytes``."""
        dropped = self._numbers(self._ask("cut"))
        self.cuts += 1
        self.dropped_bytes += dropped["dropped_bytes"]
        return dropped

    def stall(self, pattern: str | None) -> None:
        """Writes and fsyncs of files whose name matches the glob ``pattern`` wait, until
        ``stall(None)`` or the next cut (e.g. ``"*.ldb"``: LevelDB caught writing out a
        memtable, the moment its old log's unsynced tail is neither dropped nor durable)."""
        self._ask(f"stall {pattern or ''}")

    def stats(self) -> dict[str, int]:
        """``dirty_files``, ``dirty_bytes`` (not fsynced yet), ``fsyncs``, ``cuts``."""
        return self._numbers(self._ask("stats"))

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
