"""``servicebus gateway DATADIR --bind ADDR --listen HOST:PORT``: run a bus with its HTTP
gateway in the foreground until SIGINT or SIGTERM (the ``gateway`` extra)."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import typer

from .clibase import EXIT_USAGE, CliError, _serve_until_stopped, app

__all__ = ["gateway"]


@app.command("gateway")
def gateway(datadir: Path = typer.Argument(..., help="the gateway bus's data directory (made if missing)"),
            bind: str = typer.Option(..., "--bind", help="the bus's address, e.g. tcp://0.0.0.0:5555"),
            listen: str = typer.Option("127.0.0.1:8080", "--listen", help="HTTP host:port"),
            advertise: str = typer.Option(None, "--advertise", help="the bus's address for others (with a wildcard bind)"),
            name: str = typer.Option(None, "--name", help="the bus's service name (discovery)"),
            seed: list[str] = typer.Option([], "--seed", help="a discovery seed; repeat for several"),
            tokens: Path = typer.Option(None, "--tokens", help="bearer tokens file (needed beyond loopback)"),
            cert: Path = typer.Option(None, "--cert", help="TLS certificate chain (PEM): serve HTTPS"),
            key: Path = typer.Option(None, "--key", help="TLS private key (PEM)"),
            max_body: int = typer.Option(1 << 20, "--max-body", help="largest request body, bytes")) -> None:
    """Serve a bus over HTTP: publish, commands, requests, pull and push subscribers
    (README "HTTP gateway"). Stops cleanly on Ctrl-C or SIGTERM."""
    try:
        from ..gateway import Gateway  # noqa: PLC0415 - the extra
        from ..gateway.server import check_listen  # noqa: PLC0415
    except ImportError as exc:
        raise CliError(f"the gateway needs aiohttp: pip install 'servicebus[gateway]' ({exc})", EXIT_USAGE) from None
    from ..bus import Bus  # noqa: PLC0415 - only this command starts a bus

    try:
        check_listen(listen, tokens)  # before anything is made
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    context = None
    if cert is not None or key is not None:
        if cert is None or key is None:
            raise CliError("--cert and --key go together", EXIT_USAGE)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = {"advertise": advertise, "name": name, "seeds": seed}
    with Bus(bind, datadir, **{k: v for k, v in options.items() if v}) as bus:
        try:
            server = Gateway(bus, listen=listen, tokens=tokens, ssl_context=context, max_body=max_body)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        _serve_until_stopped(server, "servicebus gateway: {url} for " + bus.address + " (Ctrl-C stops)")
