"""Bus configuration: explicit keyword options with documented defaults."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any
from dataclasses import dataclass

from ..wire.policy import parse_allow
from ..wire.compression import codecs
from ..wire.protocol import MAX_BATCH
from .members import check_channels, check_name, check_seeds
from .retention import check_retention

__all__ = ["BusConfig"]


@dataclass(frozen=True)
class BusConfig:
    """Every option ``Bus(..., **options)`` accepts. Times are in seconds."""

    @classmethod
    def of(cls, options: dict[str, Any]) -> BusConfig:
        """``BusConfig(**options)``, but an unknown option is a ``TypeError`` that names the
        closest real one (``max_attempt`` -> ``max_attempts``), not the dataclass's
        ``__init__() got an unexpected keyword argument``."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unknown option {key!r}{hint}; the options are in BusConfig "
                                "(servicebus/model/config.py) and the README")
        return cls(**options)

    #: address other buses use to reach this one; defaults to ``bind`` (required when
    #: ``bind`` is a wildcard such as ``tcp://*:5555`` or ``tcp://0.0.0.0:5555``)
    advertise: str | None = None
    #: handler worker threads owned by the bus
    workers: int = 8
    #: handler runs per message before it becomes a dead letter (crash reruns count)
    max_attempts: int = 5
    #: first handler retry delay; doubles each attempt up to ``retry_max``, +/-20 % jitter
    retry_initial: float = 0.1
    retry_max: float = 30.0
    #: resend an unacknowledged message after this long; doubles per resend up to ``resend_max``
    ack_timeout: float = 5.0
    resend_max: float = 30.0
    #: how long a receiver remembers handled ids, so that resends are acked but not rehandled
    dedupe_window: float = 7 * 24 * 3600.0
    #: unacknowledged messages in flight per subscriber per topic
    window: int = 1000
    #: messages per ZeroMQ frame (at most 10,000: a receiver refuses a larger frame whole)
    max_batch: int = 200
    #: largest encoded payload accepted for sending or off the wire
    max_payload: int = 1 << 20
    #: a reply the caller has not acknowledged within this long becomes a dead letter
    #: (reason ``expired``): the caller's request timed out, or the caller is gone for good.
    #: Keep it above your longest request timeout
    reply_ttl: float = 300.0
    #: an address nothing is owed to in either direction (no message stored or in flight for
    #: it, no subscription, no subscribe intent) is forgotten after this long: its socket is
    #: closed and its delivery record deleted; the next send to it connects again
    peer_expiry: float = 600.0
    #: how long ``close()`` waits for running handlers
    close_timeout: float = 10.0
    #: peers are pinged this often; silent for ``peer_timeout`` means down
    heartbeat: float = 1.0
    peer_timeout: float = 3.0
    #: incoming messages held in memory for dispatch; the rest wait in the store
    dispatch_queue: int = 10_000
    #: record delivery events in DATADIR/journal/ for the audit pipeline
    journal: bool = True
    #: journal segment files older than this are deleted by the bus
    journal_retention: float = 7 * 24 * 3600.0
    #: Snappy-compress store blocks. Off saves ~9 % CPU per message (measured on e2e-batch)
    #: but makes table files bigger, and LevelDB maps them into memory: with 1M compressible
    #: messages queued, publisher RSS went from ~110 MB to ~380 MB
    store_compression: bool = True
    #: addresses a frame off the wire may name (a subscriber's address, a request's reply
    #: address) beyond those on the frame's own source host: IPs, CIDRs (``"10.0.0.0/8"``;
    #: ``"0.0.0.0/0"`` allows every TCP peer), host names as written, ``ipc://`` path prefixes
    allow_peers: tuple[str, ...] = ()
    #: peers (addresses connected to, each a socket and ~2 file descriptors) at most; a new
    #: address beyond it is refused (a subscribe is counted and not stored, ``send`` raises)
    max_peers: int = 256
    #: a directory made by ``servicebus keygen``: CURVE encryption and authentication on
    #: every bus socket, peers and their rights from its ``peers.toml`` (see keys.py)
    keys: str | None = None
    #: ``publish(..., dedupe_key=K)`` within this long of an earlier publish with the same key
    #: returns that publish's id and stores nothing (counted on the bus's own running time)
    publish_dedupe_window: float = 24 * 3600.0
    #: compress batch frames to peers that can decode them: ``"zstd"`` (the
    #: ``servicebus[compression]`` extra) or None. Frames under 1 KiB go as they are
    wire_compression: str | None = None
    #: messages owed to one subscriber on one topic (stored, not acknowledged) at most;
    #: None: no limit (a subscriber that is down for long fills the publisher's disk)
    max_backlog: int | None = None
    #: what a publish to a topic with a subscriber at ``max_backlog`` does: ``"block"``
    #: (wait for room up to ``backlog_timeout``, then ``BacklogFull``), ``"raise"``
    #: (``BacklogFull`` at once) or ``"drop_oldest"`` (store it; that subscriber's oldest
    #: messages become dead letters ``backlog_full``)
    backlog_policy: str = "block"
    backlog_timeout: float = 30.0
    #: serve Prometheus metrics at http://metrics_bind:metrics_port/metrics (the
    #: ``metrics`` extra; see metrics.py). None: no server
    metrics_port: int | None = None
    metrics_bind: str = "127.0.0.1"
    #: OpenTelemetry spans for publish/send (PRODUCER) and handlers (CONSUMER), with the
    #: W3C trace context carried in message headers (the ``otel`` extra; see tracing.py)
    tracing: bool = False
    #: observers of this bus (``servicebus.Hook`` subclasses; hooks/base.py), called after
    #: the bus's own (journal, tracing) in this order
    hooks: tuple[Any, ...] = ()
    #: keep published events for this long (seconds) whether or not anyone subscribes, so
    #: that a subscriber can start from what was published before it subscribed
    #: (``subscribe(start=...)``, model/retention.py): seconds for every topic, or a dict of
    #: topic or pattern -> seconds (None: not retained). None: nothing retained
    retention: Any = None
    #: a retained topic's stored events beyond this many bytes go, oldest first (never
    #: what a subscriber is still owed)
    retention_bytes: int = 256 << 20
    #: this bus's service name: other buses ``subscribe``/``send``/``request`` to it by
    #: name, and discovery tells them where its instances are (model/members.py). None:
    #: known by its address only
    name: str | None = None
    #: addresses of a few buses of the fleet to learn it from (``tcp://host:port``), or
    #: ``dns://name:port`` for every address a DNS name resolves to (a Kubernetes headless
    #: service). What is learnt is stored: a restart needs no seed to reach what it knew
    seeds: tuple[str, ...] = ()
    #: discovery tells one instance what it knows this often; an instance not heard of for
    #: ``down_after`` is down
    gossip_interval: float = 1.0
    down_after: float = 5.0
    #: channel roles: ``{"order.*": {"writers": ["orders"], "readers": ["email"]}}`` (topic
    #: patterns -> the services that may publish or send it and that may subscribe to it)
    channels: Any = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "advertise":
                continue
            if field.name == "name":
                if value is not None:
                    check_name(value, "option name")
                continue
            if field.name == "seeds":
                object.__setattr__(self, "seeds", check_seeds(value))
                continue
            if field.name == "channels":
                object.__setattr__(self, "channels", check_channels(value))
                continue
            if field.name == "retention":
                object.__setattr__(self, "retention", check_retention(value))
                continue
            if field.name == "hooks":
                if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                    raise TypeError("option hooks must be a list of servicebus.Hook objects")
                object.__setattr__(self, "hooks", tuple(value))  # each checked by the bus
                continue
            if field.name == "wire_compression":
                if value is not None and value != "zstd":
                    raise ValueError(f"option wire_compression must be None or 'zstd', got {value!r}")
                if value == "zstd" and "zstd" not in codecs():
                    raise ValueError("wire_compression='zstd' needs the zstandard package: "
                                     "pip install 'servicebus[compression]'")
                continue
            if field.name in ("max_backlog", "metrics_port") and value is None:
                continue
            if field.name == "metrics_bind":
                if not isinstance(value, str) or not value:
                    raise TypeError("option metrics_bind must be a host or IP address")
                continue
            if field.name == "metrics_port" and (not isinstance(value, int) or isinstance(value, bool)
                                                 or not 0 <= value <= 65535):
                raise ValueError(f"option metrics_port must be a port 0-65535, got {value!r}")
            if field.name == "backlog_policy":
                if value not in ("block", "raise", "drop_oldest"):
                    raise ValueError(f"option backlog_policy must be 'block', 'raise' or 'drop_oldest', got {value!r}")
                continue
            if field.name == "keys":
                if value is not None:
                    if not isinstance(value, (str, os.PathLike)):
                        raise TypeError("option keys must be a directory path")
                    object.__setattr__(self, "keys", os.fspath(value))
                continue
            if field.name == "allow_peers":
                if isinstance(value, str) or not isinstance(value, (tuple, list)):
                    raise TypeError("option allow_peers must be a list of hosts, CIDRs or ipc:// paths")
                object.__setattr__(self, "allow_peers", tuple(value))
                parse_allow(self.allow_peers)  # ValueError naming the bad entry
                continue
            if field.name in ("journal", "store_compression", "tracing"):
                if not isinstance(value, bool):
                    raise TypeError(f"option {field.name} must be a bool, not {type(value).__name__}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"option {field.name} must be a number, not {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"option {field.name} must be > 0, got {value!r}")
        for name in ("workers", "max_attempts", "window", "max_batch", "max_payload", "dispatch_queue",
                     "max_peers", "retention_bytes", *(("max_backlog",) if self.max_backlog is not None else ())):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"option {name} must be an int")
        if self.max_batch > MAX_BATCH:
            raise ValueError(f"option max_batch must be at most {MAX_BATCH} (what a receiver "
                             f"takes in one frame), got {self.max_batch}")
        if self.retry_max < self.retry_initial:
            raise ValueError("option retry_max must be >= retry_initial")
        if self.down_after <= self.gossip_interval:
            raise ValueError("option down_after must be longer than gossip_interval")
        if self.peer_timeout <= self.heartbeat:
            raise ValueError("option peer_timeout must be longer than heartbeat")
