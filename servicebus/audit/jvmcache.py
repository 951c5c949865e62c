"""A class-data-sharing archive of the Spark driver's classes, for faster audit starts.

Why: most of the ~5 s a local audit spends starting the driver JVM, and of the ~2 s of its
first query, is loading and verifying the same few thousand classes every time. Java's
dynamic CDS archive (``-XX:ArchiveClassesAtExit`` once, then ``-XX:SharedArchiveFile``)
maps them ready-made, which roughly halves both. Java 17 has no
``-XX:+AutoCreateSharedArchive`` (Java 19+), so this module manages the archive itself:

- ``prepare`` picks the JVM options for a driver this process is about to start: use the
  archive if one exists for this exact Java + pyspark + jar set (its name says which), or,
  if this process wins the creator lock, have the JVM write one to a temporary file at its
  exit; else nothing.
- ``Archive.check_mapped`` removes an archive the started JVM did not map (truncated,
  another JDK's: Java 17 ignores such a file silently, and it then loads even its own base
  archive's classes the slow way), so that the next audit writes a good one.
- ``Archive.finish`` ends the driver JVM after ``spark.stop()``, waits (bounded) for its
  at-exit dump and renames the file into place only if the JVM exited cleanly.

Nothing here may fail an audit: every problem (no cache folder, a lock held, a bad file)
means running without the archive. Local masters only, and only when this process starts
the JVM: under spark-submit the driver's options are not ours to add.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

# Java 17's magic number for a dynamic (top-layer) archive, native byte order, at offset 0
# (CDS_DYNAMIC_ARCHIVE_MAGIC in HotSpot's cds/filemap.hpp).
_DYNAMIC_MAGIC = 0xF00BABA8
# A temporary archive is a killed audit's leftover after a day (an archive takes seconds).
STALE_TMP_S = 86_400
# Archives of other Java/pyspark versions nobody used for this long are removed: ~150 MB each.
STALE_ARCHIVE_S = 30 * 86_400
# How long ``finish`` waits for the JVM to exit and write its archive (seconds, typically 2-5).
FINISH_TIMEOUT_S = 60.0
# The options travel in spark.driver.extraJavaOptions, split on spaces (quotes are parsed,
# but a path of only these characters needs none).
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=@:,~-]+")
# Environment that changes the driver's classpath, on which the archive depends too.
_CLASSPATH_ENV = ("SPARK_HOME", "SPARK_CONF_DIR", "SPARK_DIST_CLASSPATH", "HADOOP_CONF_DIR",
                  "YARN_CONF_DIR", "SPARK_CLASSPATH")


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$SERVICEBUS_CACHE_DIR, else $XDG_CACHE_HOME/servicebus, else ~/.cache/servicebus."""
    if env.get("SERVICEBUS_CACHE_DIR"):
        return Path(env["SERVICEBUS_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "servicebus"
    return Path.home() / ".cache" / "servicebus"


def usable_dir(folder: Path) -> bool:
    """Make ``folder`` (0700) if needed; True if it is ours alone and writable. An archive
    is code the JVM trusts: one in a folder another user can write could be theirs."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return (st.st_uid == os.geteuid() and not st.st_mode & 0o022
            and os.access(folder, os.W_OK | os.X_OK))


def java_binary(env: Mapping[str, str] = os.environ) -> str | None:
    """The java spark-submit runs: $JAVA_HOME/bin/java, else the one on PATH."""
    if env.get("JAVA_HOME"):
        candidate = Path(env["JAVA_HOME"]) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    return shutil.which("java")


@functools.cache
def java_version(java: str) -> str:
    """``java -version``'s text (stderr), run once per process: the Java check and the
    archive's name both need it. Raises OSError or subprocess.TimeoutExpired."""
    return subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr


def java_build(version_text: str) -> str:
    """The build ``java -version`` names ("17.0.15+6-Debian-1deb12u1"), "" if none."""
    found = re.search(r"\(build ([^)]+)\)", version_text)
    return found.group(1) if found else ""


def archive_name(version_text: str, pyspark_version: str, jars: Path,
                 env: Mapping[str, str] = os.environ) -> str:
    """``spark-driver-java<ver>-pyspark<ver>-<hash>.jsa``: a JDK, pyspark or jar change
    makes a new name (so a new archive), never a stale archive read by a new JVM. The
    hash covers the whole ``java -version`` text, the jars' names, sizes and times, and the
    environment that changes the driver's classpath."""
    found = re.search(r'version "([^"]+)"', version_text)
    java = java_build(version_text) or (found.group(1) if found else "unknown")
    digest = hashlib.sha256(version_text.encode())
    digest.update(pyspark_version.encode())
    try:
        for jar in sorted(jars.iterdir()):
            st = jar.stat()
            digest.update(f"\0{jar.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    except OSError:
        digest.update(b"\0no jars")
    for key in _CLASSPATH_ENV:
        digest.update(f"\0{key}={env.get(key, '')}".encode())
    clean = lambda text: re.sub(r"[^A-Za-z0-9.+-]", "_", text)  # noqa: E731
    return f"spark-driver-java{clean(java)}-pyspark{clean(pyspark_version)}-{digest.hexdigest()[:16]}.jsa"


def size_file(archive: Path) -> Path:
    """Where the archive's size is written when it is put in place (see ``looks_valid``)."""
    return archive.with_name(archive.name + ".size")


def looks_valid(path: Path, java_build: str, *, sized: bool = True) -> bool:
    """A cheap check before use: a dynamic archive whose header names this JVM's build and,
    if ``sized``, of the size recorded when it was written. Java 17 ignores a file with a
    bad header (and with it even its base archive: a slower start), but it maps a
    truncated one and dies of SIGBUS: the size check is what keeps that from an audit."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
            size = os.fstat(f.fileno()).st_size
        recorded = int(size_file(path).read_text()) if sized else size
    except (OSError, ValueError):
        return False
    return (size == recorded and len(head) >= 8
            and int.from_bytes(head[:4], sys.byteorder) == _DYNAMIC_MAGIC
            and (not java_build or java_build.encode() in head))


def take_lock(path: Path) -> IO[bytes] | None:
    """The creator lock (fcntl, not blocking), or None if another process holds it. Held
    for as long as the returned file is open; the OS releases it if this process dies."""
    try:
        handle = path.open("ab")
    except OSError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or locks unsupported here: either way, not ours
        handle.close()
        return None
    return handle


def sweep(folder: Path, keep: str, now: float | None = None) -> None:
    """Remove temporary archives of killed audits and JVM crash reports (older than a day)
    and archives of other versions unused for a month. Best effort: another process may be removing them too."""
    now = time.time() if now is None else now
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat()
            leftover = ".jsa.tmp-" in entry.name or entry.name.startswith("hs_err_pid")
            if leftover and now - st.st_mtime > STALE_TMP_S:
                entry.unlink()
            elif (entry.name.endswith(".jsa") and entry.name != keep
                  and now - max(st.st_mtime, st.st_atime) > STALE_ARCHIVE_S):
                entry.unlink()
                size_file(entry).unlink(missing_ok=True)
                entry.with_suffix(".lock").unlink(missing_ok=True)
        except OSError:
            continue


def mapped_by(pid: int, path: Path) -> bool | None:
    """Whether process ``pid`` has ``path`` mapped (the JVM maps an archive it uses), from
    /proc/PID/maps; None if that cannot be read (not Linux, or the process is gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    # The kernel names the file by its resolved path (a cache under a symlinked folder).
    targets = {" " + str(path), " " + os.path.realpath(path)}
    return any(line.rstrip().endswith(tuple(targets)) for line in maps.splitlines())


@dataclass
class Archive:
    """What ``prepare`` decided for one driver JVM: ``options`` to add to it, and either
    the archive it uses (``final``) or the temporary file it writes (``tmp``, with the
    creator ``lock`` held until ``finish``)."""

    options: list[str]
    final: Path
    tmp: Path | None = None
    lock: IO[bytes] | None = None

    @property
    def creating(self) -> bool:
        return self.tmp is not None

    def check_mapped(self, pid: int) -> bool:
        """After the JVM started with the archive: False, and the archive removed (so the
        next audit writes a new one), if the JVM did not map it."""
        if self.creating or mapped_by(pid, self.final) is not False:
            return True
        self.discard()  # under the creator lock: never an archive another audit just wrote
        return False

    def finish(self, proc: subprocess.Popen | None, timeout: float = FINISH_TIMEOUT_S) -> bool:
        """When creating: end the driver JVM ``proc`` (its stdin closed: pyspark's gateway
        server exits on EOF, so System.exit runs and the JVM dumps the archive), wait at
        most ``timeout`` for it, and put the file in place if it exited 0 and wrote a
        valid archive; remove the file otherwise. True if the archive is now in place."""
        tmp = self.tmp
        if tmp is None:
            return False
        self.tmp = None
        done = False
        try:
            if proc is not None:
                if proc.stdin is not None:
                    try:
                        proc.stdin.close()
                    except OSError:
                        pass
                try:
                    code: int | None = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()  # a half-written archive is removed below
                    proc.wait(10)
                    code = None
                if code == 0 and looks_valid(tmp, "", sized=False):
                    # The size first, then the archive: a reader that sees the archive sees
                    # its size; a crash between leaves no archive, so a new one is written.
                    sizes = size_file(tmp)
                    sizes.write_text(str(tmp.stat().st_size))
                    os.replace(sizes, size_file(self.final))
                    os.replace(tmp, self.final)  # atomic: readers see all or nothing
                    done = True
        except OSError:
            done = False
        finally:
            if not done:
                tmp.unlink(missing_ok=True)
                size_file(tmp).unlink(missing_ok=True)
            self.release()
        return done

    def discard(self) -> None:
        """The JVM did not start with these options: remove what they named (the archive, or
        the temporary file) so that neither is tried again."""
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None
            self.release()
            return
        lock = take_lock(self.final.with_suffix(".lock"))
        if lock is not None:  # else another audit is writing a new one: leave it be
            with lock:
                self.final.unlink(missing_ok=True)
                size_file(self.final).unlink(missing_ok=True)

    def release(self) -> None:
        """Give up the creator lock, if held."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None


# Environment through which the user may give the driver JVM options of their own.
_USER_JVM_ENV = ("JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS", "SPARK_SUBMIT_OPTS",
                 "SPARK_DRIVER_OPTS", "PYSPARK_SUBMIT_ARGS")


def enabled(master: str | None, env: Mapping[str, str] = os.environ) -> bool:
    """The archive is for a local driver this process starts: not when turned off
    (SERVICEBUS_SPARK_CDS=0), not under spark-submit, not for a cluster master, and not
    when the user sets class sharing options of their own (-Xshare:off would make every
    audit find the archive unused, remove it and write it again)."""
    own = any(word in env.get(key, "") for key in _USER_JVM_ENV
              for word in ("Xshare", "SharedArchiveFile", "ArchiveClassesAtExit", "extraJavaOptions"))
    return (env.get("SERVICEBUS_SPARK_CDS", "1") != "0" and not env.get("SPARK_ENV_LOADED")
            and bool(master) and str(master).startswith("local") and not own)


def prepare(master: str | None, env: Mapping[str, str] = os.environ) -> Archive | None:
    """The archive plan for a driver JVM about to start with ``master``, or None: run
    without. Never raises."""
    if not enabled(master, env):
        return None
    try:
        import pyspark

        folder = cache_dir(env)
        java = java_binary(env)
        if java is None or not usable_dir(folder):
            return None
        version = java_version(java)
        jars = Path(pyspark.__file__).parent / "jars"
        name = archive_name(version, pyspark.__version__, jars, env)
        final = folder / name
        if not _SAFE_PATH.fullmatch(str(final)):
            return None  # would need quoting in extraJavaOptions: not worth the risk
        build = java_build(version)
        sweep(folder, keep=name)
        # A JVM that dies writes its report here, not into the operator's working folder.
        crash = f"-XX:ErrorFile={folder}/hs_err_pid%p.log"
        if final.exists():
            if looks_valid(final, build):
                return Archive([f"-XX:SharedArchiveFile={final}", crash], final)
            lock = take_lock(final.with_suffix(".lock"))
            if lock is None:
                return None  # someone is replacing it: run without
            final.unlink(missing_ok=True)  # garbage: write a new one this time
        else:
            lock = take_lock(final.with_suffix(".lock"))
            if lock is None:
                return None  # another audit is writing it
        if final.exists():  # written by another audit between our look and the lock
            lock.close()
            return Archive([f"-XX:SharedArchiveFile={final}", crash], final) if looks_valid(final, build) else None
        # A name no one else uses: the JVM removes and recreates the file, so it is not made here.
        tmp = folder / f"{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        return Archive([f"-XX:ArchiveClassesAtExit={tmp}", crash], final, tmp, lock)
    except Exception:  # noqa: BLE001 - an archive is an optimisation, never a failure
        return None
