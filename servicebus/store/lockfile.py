"""The data directory lock: an owner record in ``DATADIR/LOCK`` plus an ``flock`` on it.

The flock is what proves liveness: the kernel drops it when the owner dies, however it
dies, so a LOCK file whose flock is free is stale and may be taken over. The owner record
(JSON: pid, host, address, started) is what an operator and ``LockedError`` get to see.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..errors import LockedError, StoreError

__all__ = ["LockOwner", "DataDirLock", "read_owner", "probe"]

log = logging.getLogger("servicebus")
LOCK_NAME = "LOCK"


@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    address: str
    started: float  # seconds since the epoch

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} ({self.address}, started {when})"

    @classmethod
    def from_json(cls, text: str) -> "LockOwner | None":
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["address"]), float(data["started"]))
        except (ValueError, KeyError, TypeError):
            return None


def read_owner(datadir: str | os.PathLike[str]) -> LockOwner | None:
    """The owner record in DATADIR/LOCK, or None if there is no (readable) record."""
    try:
        return LockOwner.from_json((Path(datadir) / LOCK_NAME).read_text())
    except OSError:
        return None


def probe(datadir: str | os.PathLike[str]) -> tuple[LockOwner | None, bool]:
    """(owner record, alive): alive is True when some process holds the flock right now."""
    path = Path(datadir) / LOCK_NAME
    owner = read_owner(datadir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return owner, False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return owner, True
    finally:
        os.close(fd)  # closing drops our probe lock, if we got one
    return owner, False


PROBE_GRACE = 0.2  # seconds a starting bus retries a lock that may be a probe's


def _flock_ex(fd: int) -> None:
    """Take the exclusive flock, or raise BlockingIOError if a live owner holds it.
    ``probe()`` takes the lock shared for a few microseconds: a bus starting at that
    instant retries for a moment rather than fail with LockedError."""
    deadline = time.monotonic() + PROBE_GRACE
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


_held: "weakref.WeakSet[DataDirLock]" = weakref.WeakSet()


def _forget_in_child() -> None:
    """A fork()ed child shares the parent's open file description, and so its flock: if
    the parent died, the child would keep the data directory locked. The child closes
    its copy (the parent's lock stays) and owns no lock."""
    for lock in list(_held):
        if lock._fd >= 0:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = -1


os.register_at_fork(after_in_child=_forget_in_child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's: alive
    return True


class DataDirLock:
    """Holds DATADIR/LOCK (mode 0600) for the lifetime of one bus."""

    def __init__(self, path: Path, fd: int, owner: LockOwner, previous: str = "") -> None:
        self.path = path
        self._fd = fd
        self.owner = owner
        self.previous = previous  # the owner record of a stale lock this one took over

    @classmethod
    def acquire(cls, datadir: str | os.PathLike[str], address: str) -> "DataDirLock":
        path = Path(datadir) / LOCK_NAME
        while True:
            try:
                # 0600: another user who could open it could flock it too (shared), wait for
                # the bus to crash and keep it from starting again, for as long as it liked.
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise StoreError(f"cannot create lock file {path}: {exc.strerror}") from exc
            try:
                _flock_ex(fd)
            except BlockingIOError:
                os.close(fd)
                owner = read_owner(datadir)
                who = owner.describe() if owner else "another process"
                gone = owner is not None and owner.host == socket.gethostname() and not _alive(owner.pid)
                hint = (f"; that process is gone, yet some process holds the lock (fuser -v {path} "
                        "names it)") if gone else ""
                raise LockedError(
                    f"data directory {datadir} is locked by {who}{hint}",
                    owner=owner.__dict__ if owner else None,
                ) from None
            # The previous owner may have unlinked LOCK between our open and our flock;
            # then we hold a lock on a file nobody else will ever open. Start again.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.fchmod(fd, 0o600)  # left by an older version with 0644
        except OSError:
            pass  # another user's file we could lock: root's business

        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        previous = LockOwner.from_json(text or "null")
        if previous is not None:
            log.warning("recovered a stale lock on %s left by %s", datadir, previous.describe())
        owner = LockOwner(os.getpid(), socket.gethostname(), address, time.time())
        lock = cls(path, fd, owner, text if previous is not None else "")
        _held.add(lock)
        try:
            lock.update(address)
        except BaseException:
            lock.release(keep_stale=True)
            raise
        return lock

    def update(self, address: str) -> None:
        """Rewrite the owner record (the bound address is known only after bind)."""
        self.owner = LockOwner(self.owner.pid, self.owner.host, address, self.owner.started)
        data = json.dumps(self.owner.__dict__).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            os.fsync(self._fd)
        except OSError as exc:  # a full disk, most likely: the bus cannot run here now
            raise StoreError(f"cannot write the lock file {self.path}: {exc.strerror}") from exc

    def release(self, *, keep_stale: bool = False) -> None:
        """Give the lock up. With ``keep_stale``, a stale owner record this lock took over
        is put back (a maintenance command leaves a crashed bus's lock as it found it, for
        the operator to see; ``servicebus unlock`` removes it)."""
        if self._fd < 0:
            return
        restored = False
        if keep_stale and self.previous:
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self.previous.encode(), 0)
                restored = True
            except OSError:
                pass  # a full disk: the record cannot be put back; remove the file instead
        if not restored:
            try:
                # Unlink while still holding the flock so no one can take the old inode over.
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
