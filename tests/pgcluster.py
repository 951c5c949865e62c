"""A throwaway PostgreSQL cluster for tests: ``initdb`` in a temporary directory, ``pg_ctl``
starting it on a free loopback port (trust authentication, no other address), stopped and
removed on exit. ``cannot_run_postgres()`` says why it cannot be had here (no server
binaries: Debian package postgresql; no driver: psycopg), so callers skip with that reason."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from servicebus.testing import free_port

__all__ = ["PostgresCluster", "cannot_run_postgres", "postgres_bin"]


def postgres_bin() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: Debian keeps them out of PATH, under
    /usr/lib/postgresql/VERSION/bin (the newest is taken)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def _run_as() -> str | None:
    """initdb and postgres refuse to run as root: as root, run them as the ``postgres``
    user (which the Debian package creates). None: run them as ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return ""
    return "postgres"


def cannot_run_postgres() -> str | None:
    """Why a throwaway PostgreSQL cannot be started here, or None."""
    if postgres_bin() is None:
        return "PostgreSQL's server is not installed (Debian package postgresql)"
    if _run_as() == "":
        return "running as root and there is no 'postgres' user to run PostgreSQL as"
    if _run_as() and shutil.which("runuser") is None:
        return "running as root and runuser (util-linux) is missing"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver psycopg is not installed (pip install 'psycopg[binary]')"
    return None


class PostgresCluster:
    """``with PostgresCluster() as pg:`` a running server; ``pg.new_database()`` makes an
    empty database and returns its SQLAlchemy URL. Stopped (immediate) and removed on exit,
    whatever happened."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.user = _run_as()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sb-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.started = False

    def _cmd(self, name: str, *args: str) -> subprocess.CompletedProcess:
        assert self.bin is not None
        cmd = [str(self.bin / name), *args]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def __enter__(self) -> "PostgresCluster":
        try:
            if self.user:
                shutil.chown(self.dir, self.user)
            made = self._cmd("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                             "--no-sync", "-E", "UTF8", "--locale=C")
            if made.returncode != 0:
                raise OSError(f"initdb failed: {made.stderr.strip()[-2000:]}")
            # Loopback only, its socket in its own directory; fsync stays on (the default):
            # the tests are about what survives a crash.
            options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir}"
            started = self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options,
                                "-w", "-t", "60", "start")
            if started.returncode != 0:
                log = self.log.read_text()[-2000:] if self.log.exists() else ""
                raise OSError(f"pg_ctl start failed: {started.stderr.strip()[-2000:]}\n{log}")
            self.started = True
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.started = False
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """An empty database of its own (a test's tables never meet another's)."""
        import sqlalchemy as sa

        name = f"t{uuid.uuid4().hex[:12]}"
        engine = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return self.url(name)
