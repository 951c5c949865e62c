"""``servicebus keygen DIR``: a new CURVE key pair for a bus (the format: wire/trust.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ..wire.trust import KEY_NAME

__all__ = ["keygen"]


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
