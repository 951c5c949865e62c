"""The power-loss file system the power-cut tests stand on (tests/powerfs.py): what was
fsynced survives a cut, nothing else does, and LevelDB works on it. A fault injector that
silently kept everything would make every power-loss test pass for nothing."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import plyvel
import pytest

from servicebus.testing import wait_until

from ..faults import PowerLossDisk, cannot_cut_power


@pytest.fixture
def disk(tmp_path):
    why = cannot_cut_power()
    if why:
        pytest.skip(why)
    with PowerLossDisk(tmp_path / "mnt") as mounted:
        yield mounted


def write(path: Path, data: bytes, *, fsync: bool, flags: int = os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def test_data_written_and_fsynced_survives_a_cut(disk):
    write(disk.path / "kept", b"durable", fsync=True)
    disk.cut()
    assert (disk.path / "kept").read_bytes() == b"durable"


def test_data_written_and_not_fsynced_is_gone_after_a_cut_though_readable_before(disk):
    write(disk.path / "lost", b"x" * 10_000, fsync=False)
    assert (disk.path / "lost").read_bytes() == b"x" * 10_000  # the page cache serves it
    assert disk.stats()["dirty_bytes"] >= 10_000
    assert disk.cut()["dropped_bytes"] >= 10_000
    # Its name was durable at once (see powerfs's docstring); its data was not.
    assert (disk.path / "lost").read_bytes() == b""
    assert disk.stats()["dirty_files"] == 0


def test_a_file_rewritten_after_an_fsync_comes_back_as_of_the_fsync(disk):
    path = disk.path / "f"
    write(path, b"A" * 6000, fsync=True)
    write(path, b"B" * 100, fsync=False)  # O_TRUNC, then a shorter rewrite
    write(path, b"C" * 50, fsync=False, flags=os.O_APPEND)  # and an append
    assert path.read_bytes() == b"B" * 100 + b"C" * 50
    disk.cut()
    assert path.read_bytes() == b"A" * 6000


def test_an_fsync_of_one_file_writes_back_that_file_only(disk):
    write(disk.path / "a", b"a", fsync=False)
    write(disk.path / "b", b"b", fsync=True)
    disk.cut()
    assert (disk.path / "a").read_bytes() == b"" and (disk.path / "b").read_bytes() == b"b"


def test_a_truncate_is_volatile_and_what_it_cut_off_reads_as_zeros_if_the_file_grows_again(disk):
    path = disk.path / "t"
    write(path, bytes(range(256)) * 40, fsync=True)  # 10,240 bytes
    with open(path, "r+b") as f:
        f.truncate(5000)
        f.seek(9000)
        f.write(b"end")  # the hole 5000..9000 must read as zeros, not the old bytes
        f.flush()
        assert path.read_bytes() == (bytes(range(256)) * 40)[:5000] + bytes(4000) + b"end"
        os.fsync(f.fileno())
    expected = path.read_bytes()
    write(path, b"", fsync=False)  # truncated to nothing, not fsynced
    disk.cut()
    assert path.read_bytes() == expected
    assert (disk.backing / "t").read_bytes() == expected  # and that is what the disk holds


def test_random_writes_truncates_and_fsyncs_match_a_model_of_the_disk_across_cuts(disk):
    """Mirror of what a disk must hold: ``durable`` changes only at fsync, ``live`` at every
    write; a cut turns live back into durable."""
    rng = random.Random(20261125)
    path = disk.path / "r"
    write(path, b"", fsync=True)
    durable, live = b"", b""
    for step in range(400):
        what = rng.random()
        with open(path, "r+b") as f:
            if what < 0.6:
                at = rng.randrange(0, len(live) + 9000)
                data = rng.randbytes(rng.randrange(1, 9000))
                f.seek(at)
                f.write(data)
                live = (live + bytes(max(0, at - len(live))))[:at] + data + live[at + len(data):]
            elif what < 0.75:
                size = rng.randrange(0, len(live) + 5000)
                f.truncate(size)
                live = live[:size] + bytes(max(0, size - len(live)))
            elif what < 0.9:
                os.fsync(f.fileno())
                durable = live
            else:
                f.close()
                disk.cut()
                live = durable
        assert path.read_bytes() == live, f"step {step}"
    disk.cut()
    assert path.read_bytes() == durable


def test_an_unlinked_open_file_keeps_its_pages_until_closed_and_renames_are_durable(disk):
    write(disk.path / "old", b"synced", fsync=True)
    os.rename(disk.path / "old", disk.path / "new")
    with open(disk.path / "gone", "w+b") as f:
        f.write(b"still readable")
        f.flush()
        os.unlink(disk.path / "gone")
        assert os.pread(f.fileno(), 100, 0) == b"still readable"
    # Forgotten with its last handle: FUSE sends that release after close() has returned.
    wait_until(lambda: disk.stats()["dirty_files"] == 0, 10, message="the unlinked file forgotten")
    disk.cut()
    assert sorted(os.listdir(disk.path)) == ["new"]
    assert (disk.path / "new").read_bytes() == b"synced"


LEVELDB_WRITER = textwrap.dedent("""
    import os, sys, plyvel
    db = plyvel.DB(sys.argv[1], create_if_missing=True, write_buffer_size=64 * 1024)
    for i in range(3000):  # several memtables: table files, new logs, MANIFEST and CURRENT
        db.put(b"synced%05d" % i, os.urandom(100), sync=(i % 100 == 99))
    for i in range(200):
        db.put(b"unsynced%05d" % i, b"v")
    db.delete(b"synced00001")  # an unsynced delete: the key comes back
    print("written", flush=True)
    os._exit(0)  # as if the power went: no close
""")


def test_leveldb_on_it_keeps_every_synced_write_across_a_cut_and_opens_without_corruption(disk):
    store = disk.path / "db"
    done = subprocess.run([sys.executable, "-c", LEVELDB_WRITER, str(store)],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "written", done.stderr
    dropped = disk.cut()
    assert dropped["dropped_bytes"] > 0
    db = plyvel.DB(str(store), paranoid_checks=True)
    try:
        keys = [k for k in db.iterator(include_value=False)]
    finally:
        db.close()
    synced = [k for k in keys if k.startswith(b"synced")]
    assert len(synced) == 3000  # every key up to the last synced put, the deleted one back
    assert not [k for k in keys if k.startswith(b"unsynced")]


def test_a_stalled_write_waits_and_a_cut_fails_it_without_it_landing(disk):
    import threading

    path = disk.path / "table.ldb"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    disk.stall("*.ldb")
    failed: list[OSError] = []

    def writing() -> None:
        try:
            os.write(fd, b"after the power went")
        except OSError as exc:
            failed.append(exc)

    writer = threading.Thread(target=writing)
    writer.start()
    writer.join(0.5)
    assert writer.is_alive(), "the stalled write returned"
    (disk.path / "other").write_bytes(b"unaffected")  # other files are not held up
    disk.cut()
    writer.join(10)
    os.close(fd)
    assert failed and failed[0].errno == 5  # EIO: its process died with the power
    assert path.read_bytes() == b""


def test_the_disk_is_unmounted_and_its_process_ended_whatever_happened(tmp_path):
    why = cannot_cut_power()
    if why:
        pytest.skip(why)
    disk = PowerLossDisk(tmp_path / "mnt")
    with pytest.raises(RuntimeError):
        with disk:
            held = open(disk.path / "held", "w")  # busy at exit: detached, not left mounted
            raise RuntimeError("a test that failed")
    with contextlib.suppress(OSError):  # its file system is gone: ENOTCONN
        held.close()
    assert not os.path.ismount(disk.path)
    assert disk.proc is not None and disk.proc.poll() is not None
