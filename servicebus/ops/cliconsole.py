"""``servicebus console DATADIR... [--write] [--listen HOST:PORT] [--audit DIR]``: the web
console in the foreground until SIGINT or SIGTERM (the ``console`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .clibase import EXIT_USAGE, CliError, _datadir, _serve_until_stopped, app

__all__ = ["console"]


@app.command("console")
def console(datadirs: Optional[list[Path]] = typer.Argument(None, metavar="DATADIR...", show_default=False,
                                                            help="the buses' data directories (default: .)"),
            listen: str = typer.Option("127.0.0.1:8470", "--listen", help="HTTP host:port (loopback by default)"),
            write: bool = typer.Option(False, "--write", help="allow replay, edit-and-replay and purge "
                                                              "(read-only without it)"),
            token_file: Optional[Path] = typer.Option(None, "--token-file", help="a file holding the token "
                                                      "every request must carry (made up and printed when "
                                                      "listening beyond loopback without one)"),
            audit: Optional[Path] = typer.Option(None, "--audit", help="the folder of the latest "
                                                 "`servicebus audit --out`: its verdict and report"),
            interval: float = typer.Option(2.0, "--interval", help="seconds between two readings of each bus")) -> None:
    """Serve the web console for these data directories: services up or down, backlogs and
    rates, dead letters by cause with replay, edit-and-replay and purge (with --write), the
    latest audit. Stops on Ctrl-C or SIGTERM."""
    try:
        from ..console import Console  # noqa: PLC0415 - the extra
    except ImportError as exc:
        raise CliError(f"the console needs aiohttp: pip install 'servicebus[console]' ({exc})", EXIT_USAGE) from None
    dirs = [_datadir(d) for d in (datadirs or [Path(".")])]
    token = None
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise CliError(f"{token_file}: {exc.strerror}", EXIT_USAGE) from None
    if audit is not None and not audit.is_dir():
        raise CliError(f"{audit}: no such folder (the --out of servicebus audit)", EXIT_USAGE)
    try:
        server = Console(dirs, listen=listen, write=write, token=token, audit=audit, interval=interval)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    mode = "read and write" if write else "read-only"
    _serve_until_stopped(server, "servicebus console: {url} (" + mode + "; Ctrl-C stops)")
