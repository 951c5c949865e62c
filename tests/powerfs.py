"""powerfs: a FUSE file system that loses, at a "power cut", every write not fsynced.

    python tests/powerfs.py BACKING MOUNTPOINT --control SOCKET

A passthrough to the directory BACKING, which plays the disk, in the manner of LazyFS:
file data written through MOUNTPOINT is kept in this process's memory, in pages, as the
kernel's page cache keeps it, and reaches BACKING only when the file is fsynced (or
fdatasynced: both are modelled as "this file's data and size are on the disk"). Reads see
the pages in memory over the disk, as reads from a page cache do. On ``cut`` (a command on
the control socket) every page not fsynced is dropped: the files read as they were at
their last fsync, which is what a machine finds on its disk after a power cut. Processes
that used the mount must be dead by then (a power cut kills them too: kill them first, then
cut, then start them again on what survived); see ``tests/faults.py`` ``PowerLossDisk``.

What it models, and how (state here what a test built on it can and cannot claim):

- **Data and size are volatile until fsync.** Writes, and size changes (``truncate``,
  ``ftruncate``, ``O_TRUNC``), stay in memory until that file is fsynced; a cut drops
  them, so a file rewritten after an fsync comes back as of that fsync, and a file
  created and written but never fsynced comes back empty. fsync of one file writes back
  that file only. Nothing is ever written back on its own: the kernel writes dirty pages
  back within about 30 s (``vm.dirty_expire_centisecs``), this file system never does, so
  it is stricter than a real machine, never more lenient: a design that survives it relies
  on fsync alone, which is the contract (DESIGN.md section 3, rule 12).
- **Names are durable at once, in order.** create, mkdir, unlink, rmdir, rename, link,
  symlink, chmod, chown, utimens are applied to BACKING when they happen and survive a cut.
  That is what ext4 (data=ordered) and xfs give a program that fsyncs: metadata is
  journaled in order, and any fsync commits every earlier metadata change with it, so the
  name of a file LevelDB fsynced is there after a crash (LevelDB 1.22 never fsyncs the
  directory after creating a new log or table file and relies on exactly this). What is not
  modelled: losing the namespace changes made after the last journal commit (a rename or
  unlink that a real machine could lose if nothing fsynced after it), and ext4's
  ``auto_da_alloc`` (which flushes a file's data when it replaces another by rename: here
  a file renamed over another without fsync comes back with its content as of its last
  fsync, empty if none: stricter).
- **Whole-cut semantics, no torn writes.** A cut drops every unsynced page of every file;
  it never keeps some of them (a real disk may have written back some pages in any order,
  or half a sector). LevelDB's log checksums cope with a torn tail; this model does not
  exercise it.
- **Locks** (flock, fcntl) are left to the kernel (FUSE keeps them local when the file
  system does not implement them), so they work across processes on one mount and are
  released when a process dies. **mmap** reads (LevelDB maps table files) go through the
  page cache to ``read`` here; writable shared mappings are not supported (nothing here
  writes through one). Attribute and name caching are off (timeouts 0), so after a cut no
  process sees a stale size or name.

The backing directory itself is never fsynced to the real disk: it only has to outlive
this process, not the host's power.

Control: a Unix stream socket at ``--control`` takes one line per connection and answers
one line: ``ping`` -> ``ok``; ``stats`` -> ``ok dirty_files=N dirty_bytes=N fsyncs=N
cuts=N``; ``cut`` -> ``ok dropped_files=N dropped_bytes=N`` (what the cut lost, so a test
can prove the fault was real); ``stall GLOB`` -> ``ok``: writes and fsyncs of files whose
name matches wait (a disk slow for those files) until ``stall`` without a glob, or until a
cut, which fails them (their process died with the power); ``stall fsync:GLOB`` -> ``ok``:
only fsyncs of such files wait, their writes go on (a write reached the page cache, its
fsync hangs: the instant between them, held open). The mount is ready once ``ping`` answers. Unmount with
``fusermount3 -u MOUNTPOINT`` (or umount); the process then exits.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import mfusepy

PAGE = 4096
log = logging.getLogger("powerfs")


@dataclass
class Dirty:
    """One file's state that is not on the disk yet: its pages written since the last fsync,
    its size, and the lowest size it had since then (pages of the disk's file at or past
    that read as zeros: they were truncated away, whatever the disk still holds)."""

    size: int
    floor: int
    pages: dict[int, bytearray] = field(default_factory=dict)


@dataclass
class Handle:
    fd: int  # on the backing file, always read-write: an fsync through any handle writes back
    ino: int
    name: str  # its name when opened: what ``stall`` matches
    epoch: int  # cuts before it was opened: a handle from before a cut is dead (EIO)


class PowerLossFS(mfusepy.Operations):
    use_ns = True  # utimens in nanoseconds (mfusepy warns otherwise)
    flag_nopath = True  # with hard_remove, an open file that was unlinked has no path:
    flag_nullpath_ok = True  # every operation on an open file goes through its handle

    def __init__(self, backing: str, control: str) -> None:
        self.backing = os.path.realpath(backing)
        self.control = control
        self.mutex = threading.RLock()  # one at a time: a model, not a fast file system
        self.dirty: dict[int, Dirty] = {}  # by backing inode: the page cache is per inode
        self.handles: dict[int, Handle] = {}
        self.open_count: dict[int, int] = {}  # handles per inode
        self.dirs: dict[int, str] = {}  # opendir handle -> path (readdir gets no path)
        self.next_fh = 1
        self.fsyncs = 0
        self.cuts = 0
        self.stalled: str | None = None  # a glob: writes and fsyncs of such files wait
        self.unstalled = threading.Condition(self.mutex)

    def init(self, path: str) -> None:
        # The control socket answers only once the kernel mounted us: a caller that pinged
        # it can use the mount.
        serve_control(self, self.control)

    # -- paths and state --

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _handle(self, fh: int) -> Handle:
        try:
            handle = self.handles[fh]
        except KeyError:
            raise mfusepy.FuseOSError(errno.EBADF) from None
        if handle.epoch != self.cuts:
            # Opened before a cut by a process that died with it (an operation it started
            # while dying, e.g. one a stall held): it never reaches the disk.
            raise mfusepy.FuseOSError(errno.EIO)
        return handle

    def _state(self, ino: int, fd: int) -> Dirty:
        state = self.dirty.get(ino)
        if state is None:
            size = os.fstat(fd).st_size
            state = self.dirty[ino] = Dirty(size=size, floor=size)
        return state

    def _read(self, state: Dirty | None, fd: int, size: int, offset: int) -> bytes:
        """What a read sees: the disk's bytes under the dirty pages, zeros past what a
        truncate cut off, nothing past the file's size."""
        if state is None:
            return os.pread(fd, size, offset)
        end = min(offset + size, state.size)
        if offset >= end:
            return b""
        out = bytearray(os.pread(fd, end - offset, offset) if offset < state.floor else b"")
        if offset + len(out) > state.floor:
            del out[max(0, state.floor - offset):]
        out.extend(bytes(end - offset - len(out)))
        for index in range(offset // PAGE, (end - 1) // PAGE + 1):
            page = state.pages.get(index)
            if page is None:
                continue
            start = index * PAGE
            lo, hi = max(start, offset), min(start + PAGE, end)
            out[lo - offset:hi - offset] = page[lo - start:hi - start]
        return bytes(out)

    def _page(self, state: Dirty, fd: int, index: int) -> bytearray:
        page = state.pages.get(index)
        if page is None:
            page = bytearray(self._read(state, fd, PAGE, index * PAGE))
            page.extend(bytes(PAGE - len(page)))
            state.pages[index] = page
        return page

    def _truncate(self, ino: int, fd: int, length: int) -> None:
        state = self._state(ino, fd)
        if length < state.size:
            keep = (length + PAGE - 1) // PAGE  # pages that still hold bytes
            if length % PAGE:  # the last page keeps its head, its tail reads as zeros
                page = self._page(state, fd, length // PAGE)
                page[length % PAGE:] = bytes(PAGE - length % PAGE)
            for index in [i for i in state.pages if i >= keep]:
                del state.pages[index]
            state.floor = min(state.floor, length)
        state.size = length

    def _writeback(self, ino: int, fd: int) -> None:
        """fsync: this file's pages and size go to the disk."""
        self.fsyncs += 1
        state = self.dirty.pop(ino, None)
        if state is None:
            return
        if state.floor < os.fstat(fd).st_size:
            os.ftruncate(fd, state.floor)
        for index, page in sorted(state.pages.items()):
            length = min(PAGE, state.size - index * PAGE)
            if length > 0:
                os.pwrite(fd, page[:length], index * PAGE)
        os.ftruncate(fd, state.size)

    def _forget_if_gone(self, ino: int, nlink: int) -> None:
        """A file with no name and no open handle can never be read again: its pages go, and
        its inode number may be reused by the disk for another file."""
        if nlink == 0 and not self.open_count.get(ino):
            self.dirty.pop(ino, None)

    def cut(self) -> tuple[int, int]:
        """Power cut: drop every page not fsynced. Returns (files, bytes) dropped."""
        with self.mutex:
            files = len(self.dirty)
            dropped = sum(len(s.pages) * PAGE for s in self.dirty.values())
            self.dirty.clear()
            self.cuts += 1
            self.stall(None)  # what waited fails: it came after the power went
            return files, dropped

    def stall(self, pattern: str | None) -> None:
        """Writes and fsyncs of files whose name matches ``pattern`` (a glob) wait until
        ``stall(None)`` or a cut (a slow disk for some files: e.g. ``*.ldb``, so that LevelDB
        is caught writing out a full memtable)."""
        with self.mutex:
            self.stalled = pattern
            self.unstalled.notify_all()

    def _wait_if_stalled(self, handle: Handle, syncing: bool = False) -> None:
        """Called holding the mutex; gives it up while waiting."""
        if self.stalled is None:
            return
        pattern = self.stalled
        if pattern.startswith("fsync:"):
            if not syncing:
                return
            pattern = pattern[len("fsync:"):]
        if not fnmatch.fnmatch(os.path.basename(handle.name), pattern):
            return
        cuts = self.cuts
        while self.stalled is not None and self.cuts == cuts:
            self.unstalled.wait()
        if self.cuts != cuts:
            raise mfusepy.FuseOSError(errno.EIO)  # its process is gone: it never happened

    def stats(self) -> str:
        with self.mutex:
            return (f"dirty_files={len(self.dirty)} "
                    f"dirty_bytes={sum(len(s.pages) * PAGE for s in self.dirty.values())} "
                    f"fsyncs={self.fsyncs} cuts={self.cuts}")

    # -- file operations --

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        with self.mutex:
            if fh is not None and fh in self.handles:
                st = os.fstat(self.handles[fh].fd)
            elif path is not None:
                st = os.lstat(self._real(path))
            else:
                raise mfusepy.FuseOSError(errno.EBADF)
            attrs = {key: getattr(st, key) for key in (
                "st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks",
                "st_atime_ns", "st_mtime_ns", "st_ctime_ns")}
            for key in ("st_atime", "st_mtime", "st_ctime"):
                attrs[key] = attrs.pop(key + "_ns")
            state = self.dirty.get(st.st_ino)
            if state is not None:
                attrs["st_size"] = state.size
                attrs["st_blocks"] = (state.size + 511) // 512
            return attrs

    def _open(self, path: str, flags: int, mode: int | None) -> int:
        how = os.O_RDWR | os.O_CLOEXEC | (flags & os.O_EXCL)
        if mode is not None:
            how |= os.O_CREAT
        fd = os.open(self._real(path), how, mode or 0)
        with self.mutex:
            ino = os.fstat(fd).st_ino
            fh, self.next_fh = self.next_fh, self.next_fh + 1
            self.handles[fh] = Handle(fd, ino, path, self.cuts)
            self.open_count[ino] = self.open_count.get(ino, 0) + 1
            if flags & os.O_TRUNC:  # a size change like any other: volatile until fsync
                self._truncate(ino, fd, 0)
            return fh

    def open(self, path: str, flags: int) -> int:
        return self._open(path, flags, None)

    def create(self, path: str, mode: int, flags: int = 0) -> int:
        return self._open(path, flags, mode)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        with self.mutex:
            handle = self._handle(fh)
            return self._read(self.dirty.get(handle.ino), handle.fd, size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self.mutex:
            handle = self._handle(fh)
            self._wait_if_stalled(handle)
            state = self._state(handle.ino, handle.fd)
            at = offset
            while at < offset + len(data):
                index, within = divmod(at, PAGE)
                take = min(PAGE - within, offset + len(data) - at)
                self._page(state, handle.fd, index)[within:within + take] = data[at - offset:at - offset + take]
                at += take
            state.size = max(state.size, offset + len(data))
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self.mutex:
            if fh is not None and fh in self.handles:
                handle = self._handle(fh)
                self._truncate(handle.ino, handle.fd, length)
                return 0
            if path is None:
                raise mfusepy.FuseOSError(errno.EBADF)
            fd = os.open(self._real(path), os.O_RDWR | os.O_CLOEXEC)
            try:
                self._truncate(os.fstat(fd).st_ino, fd, length)
            finally:
                os.close(fd)
            return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        with self.mutex:
            handle = self._handle(fh)
            self._wait_if_stalled(handle, syncing=True)
            self._writeback(handle.ino, handle.fd)
            return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0  # close() is not fsync: the pages stay in memory

    def release(self, path: str | None, fh: int) -> int:
        with self.mutex:
            handle = self.handles.pop(fh, None)
            if handle is None:
                return 0
            nlink = os.fstat(handle.fd).st_nlink
            os.close(handle.fd)
            self.open_count[handle.ino] -= 1
            if not self.open_count[handle.ino]:
                del self.open_count[handle.ino]
            self._forget_if_gone(handle.ino, nlink)
            return 0

    # -- names: applied to the disk at once (see the module docstring) --

    def _unlinking(self, real: str) -> tuple[int, int] | None:
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_nlink - 1

    def unlink(self, path: str) -> int:
        with self.mutex:
            real = self._real(path)
            gone = self._unlinking(real)
            os.unlink(real)
            if gone:
                self._forget_if_gone(*gone)
            return 0

    def rename(self, old: str, new: str) -> int:
        with self.mutex:
            real_old, real_new = self._real(old), self._real(new)
            replaced = self._unlinking(real_new)
            moved = os.lstat(real_old).st_ino
            os.rename(real_old, real_new)
            if replaced and replaced[0] != moved:
                self._forget_if_gone(*replaced)
            return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._real(source), self._real(target))
        return 0

    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._real(target))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def mknod(self, path: str, mode: int, dev: int) -> int:
        os.mknod(self._real(path), mode, dev)  # a Unix socket's name (the bus's admin.sock)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def chmod(self, path: str | None, mode: int) -> int:
        if path is not None:
            os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        if path is not None:
            os.chown(self._real(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        if path is not None:
            os.utime(self._real(path), ns=times, follow_symlinks=False)
        return 0

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def opendir(self, path: str) -> int:
        with self.mutex:
            fh, self.next_fh = self.next_fh, self.next_fh + 1
            self.dirs[fh] = path
            return fh

    def readdir(self, path: str | None, fh: int) -> list[tuple[str, dict[str, int], int]]:
        with self.mutex:
            where = self.dirs.get(fh, path)
        if where is None:
            raise mfusepy.FuseOSError(errno.EBADF)
        # Each entry with its inode number: with use_ino, a bare name would get inode 0,
        # which readdir(3) skips.
        entries = []
        with os.scandir(self._real(where)) as found:
            for entry in found:
                st = entry.stat(follow_symlinks=False)
                entries.append((entry.name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        here = os.stat(self._real(where))
        return [(".", {"st_mode": here.st_mode, "st_ino": here.st_ino}, 0),
                ("..", {"st_mode": here.st_mode, "st_ino": 1}, 0), *entries]

    def releasedir(self, path: str | None, fh: int) -> int:
        with self.mutex:
            self.dirs.pop(fh, None)
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        return 0  # names are durable at once already

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_flag", "f_namemax")}


class _FUSE(mfusepy.FUSE):
    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        # mfusepy drops the handle of an ftruncate under libfuse 3; an unlinked open file
        # (hard_remove) has no path, so pass the handle on.
        fh = fip.contents.fh if fip else None
        return self.operations.truncate(None if path is None else path.decode(), length, fh)


def serve_control(fs: PowerLossFS, path: str) -> None:
    """The control socket: one command per connection (see the module docstring)."""
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                command = conn.makefile("r").readline().strip()
                if command == "ping":
                    answer = "ok"
                elif command == "stats":
                    answer = "ok " + fs.stats()
                elif command.startswith("stall"):
                    fs.stall(command[len("stall"):].strip() or None)
                    answer = "ok"
                elif command == "cut":
                    files, dropped = fs.cut()
                    log.info("power cut: dropped %d bytes in %d files", dropped, files)
                    answer = f"ok dropped_files={files} dropped_bytes={dropped}"
                else:
                    answer = f"error unknown command {command!r}"
                conn.sendall((answer + "\n").encode())

    threading.Thread(target=loop, name="control", daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backing", help="the directory that plays the disk")
    ap.add_argument("mountpoint")
    ap.add_argument("--control", required=True, help="Unix socket for ping / stats / cut")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[powerfs {os.getpid()}] %(asctime)s %(message)s")
    logging.getLogger("mfusepy").setLevel(logging.WARNING)  # it logs every ENOENT at debug
    _FUSE(PowerLossFS(args.backing, args.control), args.mountpoint, foreground=True, fsname="powerfs", subtype="powerfs",
          attr_timeout=0, entry_timeout=0, negative_timeout=0, hard_remove=True, use_ino=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
