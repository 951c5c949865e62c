"""Bearer tokens with per-topic rights, from a TOML file::

    [[token]]
    token = "s3cr3t-billing"          # what the client sends: Authorization: Bearer s3cr3t-billing
    name = "billing-job"              # shown in logs
    read = ["order.*"]                # topics it may read (pull subscribers, their counts)
    write = ["invoice.*"]             # topics it may publish, commands it may send
    admin = false                     # may make and delete subscribers (default: false)

Patterns are fnmatch patterns; ``"*"`` is everything. Without a tokens file the gateway is
open, which it allows only on a loopback address (``Gateway`` refuses otherwise).
"""

from __future__ import annotations

import fnmatch
import hmac
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Token", "Tokens", "load_tokens", "OPEN"]


@dataclass(frozen=True)
class Token:
    name: str
    read: tuple[str, ...] = ("*",)
    write: tuple[str, ...] = ("*",)
    admin: bool = True

    def may_read(self, topic: str) -> bool:
        return any(fnmatch.fnmatchcase(topic, p) for p in self.read)

    def may_write(self, topic: str) -> bool:
        return any(fnmatch.fnmatchcase(topic, p) for p in self.write)


OPEN = Token("anonymous")


class Tokens:
    def __init__(self, tokens: dict[str, Token] | None) -> None:
        self._tokens = tokens  # None: open (loopback only)

    @property
    def open(self) -> bool:
        return self._tokens is None

    def check(self, header: str | None) -> Token | None:
        """The token an ``Authorization`` header carries, or None if it carries none we know
        (compared in constant time)."""
        if self._tokens is None:
            return OPEN
        if not header or not header.startswith("Bearer "):
            return None
        given = header[len("Bearer "):].strip().encode()
        found = None
        for secret, token in self._tokens.items():
            if hmac.compare_digest(secret.encode(), given):
                found = token
        return found


def _patterns(entry: dict, key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of topic patterns")
    return tuple(value)


def load_tokens(path: str | Path | None) -> Tokens:
    if path is None:
        return Tokens(None)
    text = Path(path).read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    tokens: dict[str, Token] = {}
    for n, entry in enumerate(data.get("token", []), 1):
        where = f"{path} token #{n}"
        secret = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(secret, str) or len(secret) < 16:
            raise ValueError(f"{where}: token must be a string of at least 16 characters")
        if secret in tokens:
            raise ValueError(f"{where}: the same token twice")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: admin must be true or false")
        tokens[secret] = Token(str(entry.get("name") or f"token #{n}"), _patterns(entry, "read", where),
                               _patterns(entry, "write", where), admin)
    if not tokens:
        raise ValueError(f"{path}: no [[token]] entries")
    return Tokens(tokens)
