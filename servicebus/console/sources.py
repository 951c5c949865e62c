"""What the console knows of each data directory it was given: read every interval (a live
bus over its admin endpoint, a stopped one from its store), kept as a short history for the
plots, and merged into one fleet view.

A stopped bus's store is opened only when it changed since it was last read (its LevelDB
files' sizes and times, taken after our own read, which writes some of them): a console
left open does not keep taking a stopped bus's store from under a bus that starts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ops.letters import act, alive, read_view
from ..ops.views import Rows, cause_of

__all__ = ["Source", "Sample", "cause_of", "fleet_view", "read_audit", "HISTORY_SECONDS"]

HISTORY_SECONDS = 1800.0  # what the plots show at most
_NOT_STORE = {"LOG", "LOG.old", "LOCK"}  # written by every open, ours too
_COUNTED = ("published", "acked", "received")  # engine counters: the rates are made of them


def _signature(datadir: Path) -> tuple:
    try:
        entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                         for e in (datadir / "store").iterdir() if e.name not in _NOT_STORE)
    except OSError:
        return ()
    return tuple(entries)


@dataclass
class Sample:
    """One reading of a data directory."""

    at: float  # wall-clock seconds
    up: bool
    error: str | None = None
    status: dict[str, Any] = field(default_factory=dict)
    subscribers: list[dict[str, Any]] = field(default_factory=list)
    fleet: dict[str, Any] = field(default_factory=dict)
    letters: int = 0
    groups: list[dict[str, Any]] = field(default_factory=list)
    rates: dict[str, float | None] = field(default_factory=dict)


class Source:
    """One data directory: its latest sample and the history the plots draw."""

    def __init__(self, index: int, datadir: Path, interval: float) -> None:
        self.index = index
        self.datadir = datadir
        self.label = str(datadir)
        self.latest: Sample | None = None
        self.history: deque[tuple[float, dict[str, float | None]]] = deque(
            maxlen=max(10, int(HISTORY_SECONDS / max(interval, 0.1))))
        self._signature: tuple | None = None
        self._counters: tuple[float, int | None, dict[str, int]] | None = None  # at, pid, counters
        # One reader or writer of a stopped bus's store at a time: LevelDB lets a process
        # open it once.
        self._lock = threading.Lock()

    def view(self, view: str, args: dict[str, Any]) -> Rows:
        with self._lock:
            return read_view(self.datadir, view, args)

    def act(self, action: str, args: dict[str, Any]) -> list[dict]:
        with self._lock:
            try:
                return act(self.datadir, action, args)
            finally:
                self._signature = None  # read it again

    def read(self) -> Sample:
        """A new sample (blocking: run off the event loop)."""
        up = alive(self.datadir)
        latest = self.latest
        if not up and latest is not None and not latest.up and latest.error is None \
                and self._signature == _signature(self.datadir):
            sample = Sample(time.time(), False, None, latest.status, latest.subscribers, latest.fleet,
                            latest.letters, latest.groups, {})
        else:
            with self._lock:
                sample = self._read(up)
        self.latest = sample
        point: dict[str, float | None] = dict(sample.rates)
        for sub in sample.subscribers:
            point[f"backlog {sub['address']}"] = float(sub.get("pending") or 0)
            point[f"oldest {sub['address']}"] = sub.get("oldest_pending_age_s")
        self.history.append((sample.at, point))
        return sample

    def failed(self, exc: BaseException) -> None:
        """A reading that could not even begin (``alive`` raised: a symlink loop...)."""
        self._signature = None
        self.latest = Sample(time.time(), False, f"{type(exc).__name__}: {exc}")

    def _read(self, up: bool) -> Sample:
        at = time.time()
        try:
            status = read_view(self.datadir, "status", {})[0]
            subscribers = list(read_view(self.datadir, "subscribers", {}))
            fleet = read_view(self.datadir, "fleet", {})[0]
            # Counted by the bus, every dead letter: a cause behind thousands of another is
            # a group too, its count exact.
            groups = read_view(self.datadir, "deadletters", {"groups": True})
        except Exception as exc:  # noqa: BLE001 - shown on the page; the next read tries again
            self._signature = None
            return Sample(at, up, f"{type(exc).__name__}: {exc}")
        if not up:
            self._signature = _signature(self.datadir)  # after our read: its own writes are in
        return Sample(at, up, None, status, subscribers, fleet, groups.total or 0,
                      list(groups), self._rates(at, status) if up else {})

    def _rates(self, at: float, status: dict[str, Any]) -> dict[str, float | None]:
        """Per second since the last sample, of the engine's counters (None at the first
        sample, or after a restart: the counters start again from 0)."""
        counters = {k: int(v) for k, v in (status.get("counters") or {}).items() if isinstance(v, int)}
        pid = (status.get("lock") or {}).get("pid")
        before, self._counters = self._counters, (at, pid, counters)
        if before is None or before[1] != pid or at <= before[0]:
            return {name: None for name in _COUNTED}
        return {name: max(0.0, (counters.get(name, 0) - before[2].get(name, 0)) / (at - before[0]))
                for name in _COUNTED}


def fleet_view(sources: list[Source]) -> list[dict[str, Any]]:
    """Every instance any source knows (discovery's tables, and each source itself), once:
    up as the freshest live table says (a source's own bus: up when it runs)."""
    rows: dict[str, dict[str, Any]] = {}
    for source in sources:
        sample = source.latest
        if sample is None:
            continue
        for inst in sample.fleet.get("instances") or []:
            key = str(inst.get("node") or inst.get("address"))
            if not key or key == "None":
                continue
            row = {"service": inst.get("service") or "", "node": inst.get("node"),
                   "address": inst.get("address"), "up": bool(inst.get("up")),
                   "kicked": inst.get("kicked"), "seen_by": source.label, "live": sample.up}
            if inst.get("self"):
                row["up"] = sample.up
                row["datadir"] = source.label
            known = rows.get(key)
            # A bus's word on itself wins, then a live table over a stored one.
            if known is None or inst.get("self") or (sample.up and not known["live"] and "datadir" not in known):
                rows[key] = {**(known or {}), **row}
    node_of = {s.latest.status.get("node_id"): s for s in sources if s.latest and s.latest.status}
    for node, source in node_of.items():  # a bus without discovery is an instance too
        if node and str(node) not in rows:
            rows[str(node)] = {"service": "", "node": node, "address": None, "up": source.latest.up,  # type: ignore[union-attr]
                               "kicked": None, "seen_by": source.label, "live": source.latest.up,  # type: ignore[union-attr]
                               "datadir": source.label}
    return sorted(rows.values(), key=lambda r: (r["service"], str(r["address"]), str(r["node"])))


def read_audit(folder: Path | None) -> dict[str, Any] | None:
    """The latest audit's verdict (``summary.json`` of ``servicebus audit --out``), or None."""
    if folder is None:
        return None
    path = folder / "summary.json"
    try:
        summary = json.loads(path.read_text())
        at = path.stat().st_mtime
    except (OSError, ValueError) as exc:
        return {"error": f"no audit read from {path}: {exc}"}
    if not isinstance(summary, dict):
        return {"error": f"{path} is not an audit summary"}
    return {"ok": summary.get("ok"), "classes": summary.get("classes") or {},
            "events": summary.get("events"), "messages": summary.get("messages"),
            "problems": {k: (v or [])[:20] for k, v in (summary.get("problems") or {}).items()},
            "written": at, "report": (folder / "report.html").exists()}
