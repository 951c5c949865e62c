"""The Spark driver's class archive (servicebus/audit/jvmcache.py) without a JVM: its
cache folder, name, lock, checks and the hand-over of a written archive."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servicebus.audit import jvmcache

VERSION = ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment (build 17.0.15+6-deb)\n'
           "OpenJDK 64-Bit Server VM (build 17.0.15+6-deb, mixed mode, sharing)\n")
BUILD = "17.0.15+6-deb"


def archive_bytes(build: str = BUILD, size: int = 10_000) -> bytes:
    """What a Java 17 dynamic archive starts with: its magic, then a header naming the JVM."""
    head = (0xF00BABA8).to_bytes(4, sys.byteorder) + b"\0" * 60 + f"OpenJDK 64-Bit Server VM ({build})".encode()
    return head + b"\x01" * (size - len(head))


def put_archive(path: Path, data: bytes, recorded: int | None = None) -> Path:
    path.write_bytes(data)
    jvmcache.size_file(path).write_text(str(len(data) if recorded is None else recorded))
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An environment whose cache is a new folder, with a known Java (no JVM is run)."""
    monkeypatch.setattr(jvmcache, "java_version", lambda java: VERSION)
    monkeypatch.setattr(jvmcache, "java_binary", lambda env=None: "/usr/bin/java")
    return {"SERVICEBUS_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}


@pytest.fixture
def prepare():
    """jvmcache.prepare, every creator lock it took let go at the end of the test."""
    plans: list[jvmcache.Archive] = []

    def plan(master, env):
        archive = jvmcache.prepare(master, env)
        if archive is not None:
            plans.append(archive)
        return archive

    yield plan
    for archive in plans:
        archive.release()


def test_the_cache_folder_is_servicebus_cache_dir_else_xdg_cache_home_else_home():
    assert jvmcache.cache_dir({"SERVICEBUS_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert jvmcache.cache_dir({"XDG_CACHE_HOME": "/b"}) == Path("/b/servicebus")
    assert jvmcache.cache_dir({}) == Path.home() / ".cache" / "servicebus"


def test_the_cache_folder_is_made_private_and_one_others_can_write_or_none_is_not_used(tmp_path):
    folder = tmp_path / "a" / "cache"
    assert jvmcache.usable_dir(folder) and folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o770)
    assert not jvmcache.usable_dir(folder)
    (tmp_path / "file").write_text("")
    assert not jvmcache.usable_dir(tmp_path / "file" / "cache")


def test_the_name_says_the_java_build_and_pyspark_version_and_changes_with_any_jar(tmp_path):
    jars = tmp_path / "jars"
    jars.mkdir()
    (jars / "a.jar").write_bytes(b"x")
    name = jvmcache.archive_name(VERSION, "4.3.0", jars, {})
    assert name.startswith("spark-driver-java17.0.15+6-deb-pyspark4.3.0-") and name.endswith(".jsa")
    assert jvmcache.archive_name(VERSION, "4.3.0", jars, {}) == name
    assert jvmcache.archive_name(VERSION.replace("15+6", "16+8"), "4.3.0", jars, {}) != name
    assert jvmcache.archive_name(VERSION, "4.3.1", jars, {}) != name
    assert jvmcache.archive_name(VERSION, "4.3.0", jars, {"HADOOP_CONF_DIR": "/etc/h"}) != name
    (jars / "b.jar").write_bytes(b"y")
    assert jvmcache.archive_name(VERSION, "4.3.0", jars, {}) != name


def test_only_a_whole_archive_of_this_jvm_looks_valid(tmp_path):
    good = put_archive(tmp_path / "good.jsa", archive_bytes())
    assert jvmcache.looks_valid(good, BUILD)
    truncated = put_archive(tmp_path / "cut.jsa", archive_bytes()[:5000], recorded=10_000)
    garbage = put_archive(tmp_path / "garbage.jsa", os.urandom(10_000))
    other_jdk = put_archive(tmp_path / "other.jsa", archive_bytes(build="21.0.2+13"))
    unrecorded = tmp_path / "unrecorded.jsa"
    unrecorded.write_bytes(archive_bytes())
    empty = put_archive(tmp_path / "empty.jsa", b"")
    for bad in (truncated, garbage, other_jdk, unrecorded, empty):
        assert not jvmcache.looks_valid(bad, BUILD), bad.name


def test_the_creator_lock_is_one_process_s_until_it_lets_go(tmp_path):
    first = jvmcache.take_lock(tmp_path / "x.lock")
    assert first is not None
    assert jvmcache.take_lock(tmp_path / "x.lock") is None
    first.close()
    again = jvmcache.take_lock(tmp_path / "x.lock")
    assert again is not None
    again.close()


def test_a_killed_audit_s_leftovers_go_after_a_day_and_other_versions_archives_after_a_month(tmp_path):
    now = time.time()
    files = {name: tmp_path / name for name in (
        "keep.jsa", "old.jsa", "old.jsa.size", "recent.jsa", "keep.jsa.tmp-1-ab", "keep.jsa.tmp-2-cd",
        "hs_err_pid5.log")}
    for path in files.values():
        path.write_bytes(b"x")
    aged = {"keep.jsa": 90, "old.jsa": 40, "keep.jsa.tmp-1-ab": 2, "hs_err_pid5.log": 2, "recent.jsa": 3}
    for name, days in aged.items():
        os.utime(files[name], (now - days * 86_400, now - days * 86_400))
    jvmcache.sweep(tmp_path, keep="keep.jsa", now=now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsa", "keep.jsa.tmp-2-cd", "recent.jsa"]


def test_the_options_are_for_a_local_driver_this_process_starts_unless_turned_off(env, prepare):
    assert prepare("local[2]", env) is not None
    assert prepare("spark://host:7077", env) is None
    assert prepare(None, env) is None
    assert prepare("local[2]", {**env, "SERVICEBUS_SPARK_CDS": "0"}) is None
    assert prepare("local[2]", {**env, "SPARK_ENV_LOADED": "1"}) is None
    assert prepare("local[2]", {**env, "JAVA_TOOL_OPTIONS": "-Xshare:off"}) is None
    assert jvmcache.enabled("local[2]", {**env, "SPARK_SUBMIT_OPTS": "-Xlog:class+load"})


def test_without_an_archive_one_process_writes_one_and_a_second_at_once_runs_without(env, prepare):
    first = prepare("local[*]", env)
    assert first is not None and first.creating and first.tmp is not None
    assert first.options[0] == f"-XX:ArchiveClassesAtExit={first.tmp}"
    assert first.tmp.parent == first.final.parent == Path(env["SERVICEBUS_CACHE_DIR"])
    assert not first.tmp.exists()  # the JVM makes it
    assert prepare("local[*]", env) is None
    first.release()
    assert prepare("local[*]", env) is not None


def test_a_valid_archive_is_used_and_garbage_is_replaced(env, prepare):
    writer = prepare("local[*]", env)
    writer.release()
    final = writer.final
    put_archive(final, archive_bytes(build=BUILD))
    using = prepare("local[*]", env)
    assert using is not None and not using.creating and using.options[0] == f"-XX:SharedArchiveFile={final}"
    put_archive(final, os.urandom(10_000))
    replacing = prepare("local[*]", env)
    assert replacing is not None and replacing.creating and not final.exists()


def test_an_unwritable_cache_means_no_options_and_no_error(env, prepare, tmp_path):
    (tmp_path / "file").write_text("")
    assert prepare("local[*]", {**env, "SERVICEBUS_CACHE_DIR": str(tmp_path / "file" / "c")}) is None


JVM_STANDIN = """
import sys
sys.stdin.read()  # as pyspark's gateway server: it exits when its stdin closes
if sys.argv[2] != "hang":
    open(sys.argv[1], "wb").write(bytes.fromhex(sys.argv[3]))
sys.exit(int(sys.argv[2]) if sys.argv[2] != "hang" else 0)
"""


def jvm_standin(tmp: Path, how: str) -> subprocess.Popen:
    """A process that acts as the driver JVM at its exit: writes the archive, exits ``how``
    (a code), or ``hang``s (ignores its stdin closing)."""
    script = JVM_STANDIN if how != "hang" else "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", script, str(tmp), how, archive_bytes().hex()],
                            stdin=subprocess.PIPE)


@pytest.mark.parametrize("how", ["0", "1", "hang"])
def test_a_written_archive_is_put_in_place_only_after_a_clean_exit(env, prepare, how):
    archive = prepare("local[*]", env)
    assert archive is not None and archive.tmp is not None
    tmp = archive.tmp
    assert archive.finish(jvm_standin(tmp, how), timeout=0.5 if how == "hang" else 30) is (how == "0")
    assert not tmp.exists()
    assert archive.final.exists() is (how == "0")
    assert jvmcache.looks_valid(archive.final, BUILD) is (how == "0")
    again = prepare("local[*]", env)  # the lock was let go either way
    assert again is not None and again.creating is (how != "0")


def test_an_archive_a_process_maps_is_seen_in_its_maps(tmp_path):
    path = tmp_path / "mapped.jsa"
    path.write_bytes(b"x" * 4096)
    other = tmp_path / "other.jsa"
    other.write_bytes(b"x")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert jvmcache.mapped_by(os.getpid(), path) is True
        assert jvmcache.mapped_by(os.getpid(), other) is False
        (tmp_path / "link").symlink_to(tmp_path)
        assert jvmcache.mapped_by(os.getpid(), tmp_path / "link" / "mapped.jsa") is True
