"""``servicebus asyncapi MODULE:ATTR``: print a service's AsyncAPI 3.0 document.

``ATTR`` names a bus (``Bus``, ``StubBus`` and their async forms) in ``MODULE``, or a function
that returns one: importing a live service's module would open its data directory, so a
function that registers the service's handlers on a ``StubBus`` is the usual target. The
current directory is importable, as with ``python -m``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
from typing import Any

import typer

from .clibase import EXIT_USAGE, CliError, app

__all__ = ["asyncapi"]


def _target(spec: str) -> tuple[Any, bool]:
    """The bus ``spec`` names, and whether this command made it (so closes it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"give MODULE:ATTR (a bus or a function returning one), not {spec!r}", EXIT_USAGE)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: whatever it raises, one line
        raise CliError(f"cannot import {module_name}: {type(exc).__name__}: {exc}", EXIT_USAGE) from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise CliError(f"{module_name} has no attribute {attr!r}", EXIT_USAGE)
        found = getattr(found, part)
    made = False
    if not hasattr(found, "asyncapi") and callable(found) and not isinstance(found, type):
        try:
            found, made = found(), True
        except Exception as exc:  # noqa: BLE001
            raise CliError(f"{spec}() raised {type(exc).__name__}: {exc}", EXIT_USAGE) from None
    if not callable(getattr(found, "asyncapi", None)):
        raise CliError(f"{spec} is not a bus (Bus, StubBus, AsyncBus, AsyncStubBus) nor a function "
                       f"returning one: {type(found).__name__}", EXIT_USAGE)
    return found, made


@app.command("asyncapi")
def asyncapi(target: str = typer.Argument(..., help="MODULE:ATTR: a bus, or a function returning one"),
             fmt: str = typer.Option("json", "--format", help="json or yaml (yaml needs PyYAML)"),
             title: str = typer.Option("", "--title", help="the document's title (default: the module's name)"),
             doc_version: str = typer.Option("1.0.0", "--doc-version", help="the document's info.version")) -> None:
    """Print the AsyncAPI 3.0 document of a service: what it handles and subscribes to, with
    its typed handlers' payload schemas."""
    if fmt not in ("json", "yaml"):
        raise CliError(f"--format must be json or yaml, not {fmt!r}", EXIT_USAGE)
    bus, made = _target(target)
    try:
        doc = bus.asyncapi(title=title or target.partition(":")[0], version=doc_version)
    finally:
        if made and callable(getattr(bus, "close", None)):
            closed = bus.close()
            if inspect.isawaitable(closed):
                asyncio.run(closed)  # type: ignore[arg-type]
    if fmt == "json":
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
        return
    try:
        import yaml
    except ImportError:
        raise CliError("--format yaml needs PyYAML: pip install PyYAML (or use --format json)", EXIT_USAGE) from None
    typer.echo(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), nl=False)
