"""CURVE keys of a bus and of the peers it trusts (``Bus(..., keys=DIR)``).

``servicebus keygen DIR`` writes ``DIR/bus.key`` (public) and ``DIR/bus.key_secret``
(secret, mode 0600) with pyzmq's certificate writer. ``DIR/peers.toml`` lists the buses this
one talks to, each with the public key(s) it may use and, optionally, what it may do::

    [[peer]]
    address = "tcp://10.0.0.5:5555"          # where it listens (as it advertises itself)
    keys = ["rq3...Z85 public key...="]     # several during a key switch, newest first
    subscribe = ["orders.*", "user.signup"]  # optional: topics it may subscribe to (fnmatch)
    send = ["charge"]                        # optional: commands it may send or request

With keys, every socket of the bus speaks CURVE (ZeroMQ's CurveZMQ: encrypted and
authenticated): a peer whose key is not listed, or that speaks NULL, is refused during the
handshake and counted; a listed peer may name only its own address in a subscribe or a
request, and only do what its entry allows.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from .trust import Keys, PeerEntry

__all__ = ["Keys", "PeerEntry", "load_keys", "keygen", "KEY_NAME"]

KEY_NAME = "bus"


def _z85_key(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) != 40:
        raise ValueError(f"{where}: a public key is 40 Z85 characters, got {value!r}")
    return value


def _patterns(entry: dict, name: str, where: str) -> tuple[str, ...] | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {name} must be a list of strings")
    return tuple(value)


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
    peers: list[PeerEntry] = []
    peers_file = folder / "peers.toml"
    if peers_file.is_file():
        try:
            data = tomllib.loads(peers_file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{peers_file}: {exc}") from exc
        for n, entry in enumerate(data.get("peer", []), 1):
            where = f"{peers_file} peer #{n}"
            if not isinstance(entry, dict) or not isinstance(entry.get("address"), str):
                raise ValueError(f"{where}: needs address = \"tcp://host:port\" (or ipc://path)")
            keys = entry.get("keys")
            if not isinstance(keys, list) or not keys:
                raise ValueError(f"{where}: needs keys = [\"<public key>\", ...]")
            peers.append(PeerEntry(entry["address"], tuple(_z85_key(k, where) for k in keys),
                                   _patterns(entry, "subscribe", where), _patterns(entry, "send", where)))
    return Keys(public, secret, tuple(peers))


def keygen(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new key pair into ``directory`` (made 0700 if new); refuses to overwrite one.
    Returns (public file, secret file)."""
    import zmq.auth

    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = folder / f"{KEY_NAME}.key", folder / f"{KEY_NAME}.key_secret"
    if secret_file.exists() or public_file.exists():
        raise FileExistsError(f"{folder} holds a key pair already; move it away to make a new one")
    public, secret = zmq.auth.create_certificates(folder, KEY_NAME)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)
