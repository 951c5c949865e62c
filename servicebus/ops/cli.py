"""``servicebus``: inspect, unlock, replay and repair a bus's data directory.

Read-only commands work on a stopped bus (reading its store) and on a live one (asking it
over its admin endpoint); both print the same. So do replay and purge of dead letters, and
readmit (the live bus makes the change itself); kick needs the live bus (exit 1 if it is
stopped). The other commands that write refuse while a live process holds the lock. Exit
codes: 0 ok, 1 usage, 2 no such / not a data directory, 3 locked by a live process,
4 corruption found, 5 permission denied (run it as the bus's user), 6 nothing matched (a
replay or purge; a kick or readmit of a target the bus does not know or did not kick). On
several data directories: the worst of them. Errors are one line, never a traceback.
"""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from ..errors import BusError, StoreError
from .clibase import EXIT_OK, EXIT_USAGE, CliError, app, describe
from .clitable import err
# Imported for what they do: each registers its commands on ``app``, in this order, which
# is the order ``servicebus --help`` lists them in.
from . import cliinspect, climaintain, clifleet, clijournal, cliasyncapi, cligateway, cliconsole  # noqa: F401

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point: named exit codes, one-line errors."""
    try:
        code = app(standalone_mode=False)
    except TyperException as exc:  # usage errors: unknown option, missing argument, ...
        show = getattr(exc, "show", None)
        show() if show else err.print(f"servicebus: {exc.format_message()}")
        sys.exit(EXIT_USAGE)
    except typer.Abort:
        err.print("servicebus: aborted")
        sys.exit(EXIT_USAGE)
    except (CliError, StoreError, PermissionError, BusError, OSError) as exc:
        message, code = describe(exc)
        err.print(f"servicebus: {message}")
        sys.exit(code)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
