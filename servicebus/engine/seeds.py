"""Seeds that need a lookup, off the engine thread (the engine never waits on DNS).

- ``dns://name:port``: every address ``name`` resolves to (the system resolver:
  ``getaddrinfo``), looked up at start and every ``DNS_INTERVAL``: a Kubernetes headless
  service or a Compose service name with several replicas gives every instance.
- ``mdns://`` (or ``mdns://<type>``): DNS-SD over multicast DNS on the LAN, through
  python-zeroconf (the ``mdns`` extra): the bus announces itself as an instance of
  ``_servicebus._tcp.local.`` (or ``_<type>._tcp.local.``) with its address, and every
  instance it browses is a seed.

What either finds is handed to the engine as the current seed list (``Maintain("seeds")``);
discovery (core/members.py) gossips to seeds until they answer.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SeedFinder", "DNS_INTERVAL", "resolve_dns"]

log = logging.getLogger("servicebus")

DNS_INTERVAL = 30.0


def resolve_dns(seed: str) -> list[str]:
    """``dns://name:port`` -> ``tcp://ip:port`` for every address of ``name`` (empty if it
    does not resolve now)."""
    host, _, port = seed[len("dns://"):].rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        log.info("seed %s does not resolve now: %s", seed, exc)
        return []
    out = set()
    for family, _t, _p, _c, addr in infos:
        ip = addr[0]
        out.add(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}")
    return sorted(out)


class SeedFinder:
    def __init__(self, seeds: tuple[str, ...], *, address: str, node_id: str, name: str | None,
                 found: Callable[[list[str]], None]) -> None:
        self.static = [s for s in seeds if s.startswith("tcp://")]
        self.dns = [s for s in seeds if s.startswith("dns://")]
        self.mdns = [s for s in seeds if s.startswith("mdns://")]
        self.address, self.node_id, self.name = address, node_id, name
        self._found = found
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._browsed: dict[str, str] = {}  # mDNS instance -> address
        self._zc: Any = None
        self._thread: threading.Thread | None = None

    @property
    def needed(self) -> bool:
        return bool(self.dns or self.mdns)

    def start(self) -> None:
        if self.mdns:
            self._start_mdns()
        if self.dns:
            self._thread = threading.Thread(target=self._run, name="servicebus-seeds", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._report()
            if self._stop.wait(DNS_INTERVAL):
                return

    def _report(self) -> None:
        found = list(self.static)
        for seed in self.dns:
            found += resolve_dns(seed)
        with self._lock:
            found += self._browsed.values()
        if not self._stop.is_set():
            self._found(sorted(set(found)))

    # --- mDNS (python-zeroconf) ------------------------------------------------------------

    def _start_mdns(self) -> None:
        try:
            from zeroconf import ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf  # noqa: PLC0415 - the extra
        except ImportError as exc:
            raise ImportError("mdns:// seeds need python-zeroconf: pip install 'servicebus[mdns]'") from exc
        kind = self.mdns[0][len("mdns://"):].strip("/") or "servicebus"
        service_type = f"_{kind}._tcp.local."
        host, _, port = self.address[len("tcp://"):].rpartition(":")
        self._zc = zc = Zeroconf()
        try:
            addresses = [socket.inet_aton(socket.gethostbyname(host))]
        except OSError:
            addresses = []
        info = ServiceInfo(service_type, f"{self.node_id}.{service_type}", port=int(port),
                           properties={"address": self.address, "name": self.name or ""},
                           addresses=addresses)
        zc.register_service(info)
        finder = self

        class Listener(ServiceListener):
            def add_service(self, zc: Any, type_: str, name: str) -> None:
                found = zc.get_service_info(type_, name, timeout=2000)
                address = (found.properties or {}).get(b"address") if found is not None else None
                if isinstance(address, bytes) and not name.startswith(finder.node_id):
                    with finder._lock:
                        finder._browsed[name] = address.decode("utf-8", "replace")
                    finder._report()

            def update_service(self, zc: Any, type_: str, name: str) -> None:
                self.add_service(zc, type_, name)

            def remove_service(self, zc: Any, type_: str, name: str) -> None:
                with finder._lock:
                    finder._browsed.pop(name, None)

        ServiceBrowser(zc, service_type, Listener())

    def close(self) -> None:
        self._stop.set()
        if self._zc is not None:
            try:
                self._zc.unregister_all_services()
                self._zc.close()
            except Exception:  # noqa: BLE001 - closing: nothing left to do about it
                log.debug("closing zeroconf failed", exc_info=True)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
