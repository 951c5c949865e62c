"""Services by name: what a bus knows of the others (sans I/O; core/members.py runs it).

A bus started with ``name="email"`` is an *instance* of the service ``email``. Instances
tell each other what they know (gossip, over the connections buses already make): every
``gossip_interval`` a bus sends its table to one member it knows (and to its seeds until
they answer), and the one asked answers with its own. Each entry is one instance:

- ``node``: the instance's node id (kept in its data directory: an instance is its data
  directory, wherever it runs); ``name``: its service; ``address``: where it listens now;
- ``epoch``, ``beat``: its starts so far and a counter it raises every interval. Only the
  instance itself raises them, so a newer entry is simply a larger (epoch, beat): no clock
  of another host is compared with ours. An instance whose (epoch, beat) has not grown for
  ``down_after`` seconds of *our* clock is down;
- ``key``: its CURVE public key when keys are on; ``publishes``/``subscribes``: topics
  (what its handlers and intents name, for the fleet view); ``version``.

``Member`` is the entry as it travels and as it is stored; ``is_service`` tells a service
name from an address in ``subscribe``/``send``/``request``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "is_service", "check_name", "check_seeds", "check_channels", "SERVICE",
           "MAX_MEMBERS", "Channels"]

SERVICE = "svc:"  # a subscribe intent to a service (stored under "svc:<name>")
MAX_MEMBERS = 1000  # entries per gossip frame and in a table: a flood must not grow it
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_MAX_TOPICS = 200
_MAX_TOPIC = 255


def is_service(target: object) -> bool:
    """Whether ``target`` names a service (``"email"``) rather than an address."""
    return isinstance(target, str) and "://" not in target


def check_name(name: object, what: str = "service name") -> str:
    """A service name: 1-63 characters, lower-case letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or digit (it is also a DNS label, most of the time)."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name[:80]!r} is not a service name: 1-63 characters of "
                         "a-z, 0-9, '.', '_', '-', starting with a letter or digit")
    return name


def check_seeds(seeds: object) -> tuple[str, ...]:
    """``seeds``: addresses (``tcp://host:port``) of any buses of the fleet, or
    ``dns://name:port`` for every address a DNS name resolves to (a Kubernetes headless
    service), resolved again every 30 s, or ``mdns://`` for DNS-SD on the LAN (the ``mdns``
    extra): engine/seeds.py."""
    if isinstance(seeds, str) or not isinstance(seeds, (list, tuple)):
        raise TypeError("option seeds must be a list of tcp://host:port or dns://name:port")
    out = []
    for seed in seeds:
        if not isinstance(seed, str) or not re.fullmatch(
                r"(tcp|dns)://[^\s/:]+:\d{1,5}|tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}|mdns://([a-z0-9-]{1,15})?", seed):
            raise ValueError(f"seed {seed!r} is not tcp://host:port, dns://name:port or mdns://[type]")
        out.append(seed)
    return tuple(out)


@dataclass(frozen=True)
class Channels:
    """Channel roles (``Bus(channels=...)``): per topic pattern, the services that may
    publish it (writers) and that may subscribe to it (readers). A topic no pattern
    matches is open to all; a topic some pattern matches is open only to the services that
    pattern lists (``"*"`` for any). Enforced where it can be: by a publisher for the
    subscribes it gets, by a receiver for the events and commands it gets."""

    rules: tuple[tuple[str, frozenset[str] | None, frozenset[str] | None], ...] = ()

    def _rule(self, topic: str) -> tuple[frozenset[str] | None, frozenset[str] | None] | None:
        for pattern, writers, readers in self.rules:
            if fnmatch.fnmatchcase(topic, pattern):
                return writers, readers
        return None

    def may_write(self, service: str | None, topic: str) -> bool:
        rule = self._rule(topic)
        return rule is None or rule[0] is None or (service is not None and service in rule[0])

    def may_read(self, service: str | None, topic: str) -> bool:
        rule = self._rule(topic)
        return rule is None or rule[1] is None or (service is not None and service in rule[1])

    def __bool__(self) -> bool:
        return bool(self.rules)


def _services(value: Any, where: str) -> frozenset[str] | None:
    if value is None or value == "*":
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"{where} must be a list of service names or '*'")
    if "*" in value:
        return None
    return frozenset(check_name(v, where) for v in value)


def check_channels(value: object) -> Channels:
    """``channels={"order.*": {"writers": ["orders"], "readers": ["email", "billing"]}}``:
    the first pattern (in the order given) that matches a topic decides; a role left out
    is open to every service."""
    if value is None or isinstance(value, Channels):
        return value or Channels()
    if not isinstance(value, dict):
        raise TypeError("option channels must be a dict of topic pattern -> {'writers': [...], 'readers': [...]}")
    rules = []
    for pattern, roles in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError("option channels: a key must be a topic or pattern")
        if not isinstance(roles, dict) or set(roles) - {"writers", "readers"}:
            raise ValueError(f"option channels[{pattern!r}] must be a dict with 'writers' and/or 'readers'")
        rules.append((pattern, _services(roles.get("writers"), f"channels[{pattern!r}]['writers']"),
                      _services(roles.get("readers"), f"channels[{pattern!r}]['readers']")))
    return Channels(tuple(rules))


def _topics(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > _MAX_TOPICS or \
            not all(isinstance(t, str) and 0 < len(t) <= _MAX_TOPIC for t in value):
        raise ValueError("topics must be a short list of topics")
    return tuple(value)


@dataclass(frozen=True)
class Member:
    node: str
    name: str
    address: str
    epoch: int
    beat: int
    key: str | None = None
    publishes: tuple[str, ...] = ()
    subscribes: tuple[str, ...] = ()
    version: str = ""
    left: bool = False  # its last word: it is closing (a clean stop), down at once

    @property
    def age(self) -> tuple[int, int]:
        return self.epoch, self.beat

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "name": self.name, "address": self.address,
                               "epoch": self.epoch, "beat": self.beat, "pub": list(self.publishes),
                               "sub": list(self.subscribes), "v": self.version}
        if self.key is not None:
            out["key"] = self.key
        if self.left:
            out["left"] = True
        return out

    @classmethod
    def from_wire(cls, entry: Any, check_address: Any) -> "Member":
        """The entry as sent (``ValueError`` naming what is wrong); ``check_address``
        validates the address (wire/validation.py's, passed in: no layer cycle)."""
        if not isinstance(entry, dict):
            raise ValueError("a member is a map")
        node, epoch, beat, key = entry.get("node"), entry.get("epoch"), entry.get("beat"), entry.get("key")
        if not isinstance(node, str) or not 0 < len(node) <= 64:
            raise ValueError("member node must be a short str")
        for value, what in ((epoch, "epoch"), (beat, "beat")):
            if type(value) is not int or not 0 <= value < 1 << 53:
                raise ValueError(f"member {what} must be an int >= 0")
        if key is not None and (not isinstance(key, str) or len(key) != 40):
            raise ValueError("member key must be a 40-character Z85 key")
        version = entry.get("v", "")
        if not isinstance(version, str) or len(version) > 40:
            raise ValueError("member version must be a short str")
        assert isinstance(epoch, int) and isinstance(beat, int)
        left = entry.get("left", False)
        if type(left) is not bool:
            raise ValueError("member left must be a bool")
        return cls(node, check_name(entry.get("name"), "member name"), check_address(entry.get("address")),
                   epoch, beat, key, _topics(entry.get("pub", [])), _topics(entry.get("sub", [])), version, left)
