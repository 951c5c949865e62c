"""One owner for the ZeroMQ context and every socket of a bus.

``Sockets`` makes the context, binds the ROUTER and the admin endpoint, opens one DEALER
per peer (``connect``/``forget``: the core's ``Links``) and closes them all. Sockets are
used by the engine thread only; ``close()`` runs on it at its end, ``destroy()`` on the
thread that closes the bus, after the engine stopped (or never started): it closes
whatever a failed open left and terminates the context without waiting (linger 0).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from .config import BusConfig
from .errors import TransportError
from .protocol import FRAME_BYTES
from .trust import Keys

__all__ = ["Sockets"]

log = logging.getLogger("servicebus")


def max_part_bytes(max_payload: int) -> int:
    """ZMQ_MAXMSGSIZE: the largest part of a ZeroMQ message libzmq takes (a larger one
    drops the connection before Python sees it). Above the largest body a sender makes
    (``protocol.frame_body_limit``: FRAME_BYTES of payload, or one message of
    ``max_payload``, and framing for up to MAX_BATCH messages) with room for a frame's
    header (its messages' ids, topics and headers): a frame refused here is resent the
    same way, for ever. The limit of what a compressed body may decompress to is
    ``frame_body_limit``, checked as it is decompressed."""
    return 2 * max(FRAME_BYTES, max_payload) + (1 << 20)


def _tune(sock: zmq.Socket, config: BusConfig, hwm: int) -> None:
    """Options every socket of ours gets (DESIGN.md section 4). The store, not ZeroMQ's
    queue, is the source of truth: no linger; a bounded frame size."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
    sock.setsockopt(zmq.MAXMSGSIZE, max_part_bytes(config.max_payload))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, 100_000)


SOCKET_PATH_MAX = 100  # bytes; the OS limit (sun_path) is 107 with the terminating NUL


def private_folder(datadir: Path) -> tuple[Path, Path | None]:
    """A directory for the admin socket that only this user (and root) can enter, and the
    directory to remove at close if it is outside the data directory. For a long data
    directory path it is named after the path, under $XDG_RUNTIME_DIR or /tmp: the same one
    after a restart (we hold the data directory's lock), so a killed bus leaves none behind
    for good."""
    resolved = datadir.resolve()
    folder = resolved / "run"
    if len(str(folder / "admin.sock").encode()) < SOCKET_PATH_MAX:
        return _own_folder(folder), None
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    if not base or not os.path.isdir(base) or len(base) > SOCKET_PATH_MAX - 50:
        base = tempfile.gettempdir()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:20]
    folder = _own_folder(Path(base) / f"servicebus-{os.geteuid()}-{digest}")
    return folder, folder


def _own_folder(folder: Path) -> Path:
    """``folder``, made 0700 if missing; refused unless it is a real directory of this user
    (not a symlink, not made by someone else to catch the socket)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise TransportError(f"{folder} is not a directory of this user: the admin endpoint "
                             "will not be put there (remove it)")
    os.chmod(folder, 0o700)  # made by an older version, or with another mode
    return folder


HANDSHAKE_EVENTS: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake_failed",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake_failed_protocol",  # e.g. a NULL peer
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "handshake_failed_auth",  # a key not in peers.toml
}
ZAP_DOMAIN = "servicebus"


class _Trusted:
    """pyzmq's ZAP authenticator asks this whether a client key may connect (on the
    authenticator's own thread)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = self.keys.allowed(key.decode("ascii"))
        if not allowed:
            log.warning("refused a CURVE client with a key not in peers.toml: %s", key.decode("ascii"))
        return allowed


class Sockets:
    def __init__(self, config: BusConfig, keys: Keys | None = None) -> None:
        self.config = config
        self.keys = keys
        self.ctx = zmq.Context()
        self.monitor: zmq.Socket | None = None  # the ROUTER's handshake events, with keys
        self._auth: ThreadAuthenticator | None = None
        self._key_index: dict[str, int] = {}  # address -> which of its server keys is tried
        # Addresses peers.toml lists several keys for (a key switch): the only ones to retry.
        self.switchable = tuple(p.address for p in keys.peers if len(p.keys) > 1) if keys else ()
        self.router: zmq.Socket | None = None
        self.admin: zmq.Socket | None = None
        self._admin_path: Path | None = None
        self._admin_tmp: Path | None = None  # the admin directory outside DATADIR, removed at close
        self._dealers: dict[str, zmq.Socket] = {}
        self._address_of: dict[zmq.Socket, str] = {}
        self.poller = zmq.Poller()
        # While the store cannot be written, only user commands and operators are served.
        self.degraded_poller = zmq.Poller()

    # --- opening -----------------------------------------------------------------------

    def bind_router(self, bind: str) -> str:
        """Bind this bus's ROUTER; return the endpoint it actually bound."""
        router = self.ctx.socket(zmq.ROUTER)
        _tune(router, self.config, hwm=100_000)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a vanished peer raise, not vanish
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.keys is not None:
            # CURVE on the ROUTER: every client proves a key that peers.toml lists (ZAP);
            # a NULL client fails the handshake (mechanism mismatch) and is counted.
            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("servicebus.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, _Trusted(self.keys))
            router.curve_secretkey = self.keys.secret
            router.curve_publickey = self.keys.public
            router.curve_server = True
            router.zap_domain = ZAP_DOMAIN.encode()
            self.monitor = router.get_monitor_socket(sum(HANDSHAKE_EVENTS))
            self.poller.register(self.monitor, zmq.POLLIN)
            self.degraded_poller.register(self.monitor, zmq.POLLIN)
        try:
            router.bind(bind.replace(":*", ":0") if bind.startswith("tcp://") else bind)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise TransportError(f"cannot bind {bind}: the address is already in use") from exc
            raise TransportError(f"cannot bind {bind}: {exc}") from exc
        self.router = router
        self.poller.register(router, zmq.POLLIN)
        return router.getsockopt_string(zmq.LAST_ENDPOINT)

    def bind_admin(self, datadir: Path) -> str:
        """Bind the admin endpoint: a Unix socket in a directory only this user can enter
        (``DATADIR/run``, mode 0700, or when that path would pass the OS limit for socket
        paths, ~107 bytes, one named after it under $XDG_RUNTIME_DIR or /tmp: see
        ``private_folder``). Never TCP: the kernel's directory permissions are its access
        control."""
        folder, self._admin_tmp = private_folder(datadir)
        path = folder / "admin.sock"
        path.unlink(missing_ok=True)  # left by a killed bus; the data directory lock is ours
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.admin = sock
        self.poller.register(sock, zmq.POLLIN)
        self.degraded_poller.register(sock, zmq.POLLIN)
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot bind the admin endpoint ipc://{path}: {exc}") from exc
        self._admin_path = path
        return f"ipc://{path}"

    def watch(self, fd: int) -> None:
        """Wake the poll when ``fd`` (the engine's eventfd) is readable, in either mode."""
        self.poller.register(fd, zmq.POLLIN)
        self.degraded_poller.register(fd, zmq.POLLIN)

    # --- peers (the core's Links) ------------------------------------------------------

    def connect(self, address: str) -> None:
        if address in self._dealers:
            return
        try:
            # Creating the socket fails too once the context's socket limit or the process's
            # file descriptors run out (a flood of addresses): a refusal, not an engine death.
            sock = self.ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to {address[:200]}: {exc}") from exc
        try:
            if self.keys is not None:
                servers = self.keys.server_keys(address)
                if not servers:
                    raise ValueError(f"cannot connect to {address[:200]}: peers.toml has no key for it")
                sock.curve_secretkey = self.keys.secret
                sock.curve_publickey = self.keys.public
                sock.curve_serverkey = servers[self._key_index.get(address, 0) % len(servers)].encode()
            _tune(sock, self.config, hwm=10_000)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(address)
        except ValueError:  # no key for it
            sock.close(linger=0)
            raise
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to {address}: {exc}") from exc
        self._dealers[address] = sock
        self._address_of[sock] = address
        self.poller.register(sock, zmq.POLLIN)

    def try_next_key(self, address: str) -> bool:
        """Connect to ``address`` again with the next of the server keys peers.toml lists
        for it (a peer that switched keys answers to the new one); False if it has one."""
        if self.keys is None or len(self.keys.server_keys(address)) < 2 or address not in self._dealers:
            return False
        self._key_index[address] = self._key_index.get(address, 0) + 1
        self.forget(address)
        self.connect(address)
        return True

    def forget(self, address: str) -> None:
        sock = self._dealers.pop(address, None)
        if sock is None:
            return
        self.poller.unregister(sock)
        del self._address_of[sock]
        sock.close(linger=0)

    def address_of(self, sock: object) -> str | None:
        """The peer address a polled DEALER is connected to (None: not a DEALER of ours)."""
        return self._address_of.get(sock)  # type: ignore[call-overload]

    # --- sending -----------------------------------------------------------------------

    def send_peer(self, address: str, frames: list[bytes]) -> bool:
        """False if the peer cannot take it now: not connected (IMMEDIATE) or its queue is
        full. The store keeps what was in flight; the core resends it later."""
        sock = self._dealers.get(address)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def send_router(self, ident: bytes, frames: list[bytes]) -> bool:
        assert self.router is not None
        try:
            self.router.send_multipart([ident, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH (ROUTER_MANDATORY: the peer went away) or EAGAIN: the sender
            # will resend and we will ack again.
            log.debug("reply to a peer failed: %s", exc)
            return False

    def send_admin(self, ident: bytes, data: bytes) -> None:
        if self.admin is None:
            return
        try:
            self.admin.send_multipart([ident, b"", data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("admin reply not sent: %s", exc)

    # --- closing -----------------------------------------------------------------------

    def close(self) -> None:
        """Close every socket (on the thread that used them, when it is done)."""
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._address_of.clear()
        if self.admin is not None:
            self.admin.close(linger=0)
            self.admin = None
        if self._admin_path is not None:
            self._admin_path.unlink(missing_ok=True)
            self._admin_path = None
        if self._admin_tmp is not None:
            shutil.rmtree(self._admin_tmp, ignore_errors=True)
            self._admin_tmp = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
        if self.router is not None:
            self.router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def destroy(self) -> None:
        """Close what is still open (a failed open) and terminate the context. With every
        socket at linger 0, termination does not wait for anything."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)

    def handshake_failures(self) -> list[str]:
        """Counter names of the handshake failures the ROUTER reported since last asked."""
        out: list[str] = []
        if self.monitor is None:
            return out
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return out
            name = HANDSHAKE_EVENTS.get(int(event["event"]))
            if name is not None:
                out.append(name)
