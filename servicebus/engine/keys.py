"""Reading a bus's CURVE key directory when it opens (the format: wire/trust.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ..wire.trust import KEY_NAME, Keys, PeerEntry, parse_peers

__all__ = ["load_keys"]


def load_keys(directory: str | os.PathLike[str]) -> Keys:
    """This bus's key pair and its trusted peers from ``directory``; ``ValueError`` naming
    the file and the problem if anything is missing or malformed."""
    import zmq.auth

    folder = Path(directory)
    secret_file = folder / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise ValueError(f"no secret key {secret_file}: make one with `servicebus keygen {folder}`")
    if secret_file.stat().st_mode & 0o077:
        raise ValueError(f"{secret_file} can be read by other users: chmod 600 it")
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key")
    peers_file = folder / "peers.toml"
    peers: tuple[PeerEntry, ...] = ()
    if peers_file.is_file():
        try:
            text = peers_file.read_text()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{peers_file}: {exc}") from exc
        peers = parse_peers(text, str(peers_file))
    return Keys(public, secret, peers)
