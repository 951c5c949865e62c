"""``servicebus``: inspect, unlock, replay and repair a bus's data directory.

Read-only commands work on a stopped bus (reading its store) and on a live one (asking it
over its admin endpoint); both print the same. Commands that write refuse while a live
process holds the lock. Exit codes: 0 ok, 1 usage, 2 no such / not a data directory,
3 locked by a live process, 4 corruption found, 5 permission denied (run it as the bus's
user). Errors are one line, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from typer.exceptions import TyperException

from ..errors import BusError, StoreError
from .clibase import EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, CliError, _denied, app
from .clitable import err, safe as _safe
# Imported for what they do: each registers its commands on ``app``, in this order, which
# is the order ``servicebus --help`` lists them in.
from . import cliinspect, climaintain, clijournal, cliasyncapi  # noqa: F401

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point: named exit codes, one-line errors."""
    try:
        code = app(standalone_mode=False)
    except CliError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(exc.code)
    except TyperException as exc:  # usage errors: unknown option, missing argument, ...
        show = getattr(exc, "show", None)
        show() if show else err.print(f"servicebus: {exc.format_message()}")
        sys.exit(EXIT_USAGE)
    except typer.Abort:
        err.print("servicebus: aborted")
        sys.exit(EXIT_USAGE)
    except StoreError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_CORRUPT)
    except PermissionError as exc:  # a file of the data directory this user may not use
        where = Path(exc.filename) if exc.filename else Path(".")
        denied = _denied(where, f"{exc.filename or 'a file'}: {exc.strerror}")
        err.print(f"servicebus: {_safe(denied)}")
        sys.exit(denied.code)
    except BusError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_USAGE)
    except OSError as exc:
        err.print(f"servicebus: {_safe(exc)}")
        sys.exit(EXIT_USAGE)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
