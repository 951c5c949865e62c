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
import pwd
import stat
import tempfile
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ..model.config import BusConfig
from ..errors import TransportError
from ..wire.protocol import FRAME_BYTES
from ..wire.trust import Keys

__all__ = ["Sockets", "AdminFolderRefused", "admin_folder", "open_private_folder"]

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
ADMIN_SOCKET = "admin.sock"


class AdminFolderRefused(TransportError):
    """The folder for the admin socket is not a private directory of this bus's user (made
    by someone else, a symlink, a file): the bus runs without its admin endpoint."""


def admin_folder(datadir: Path) -> tuple[Path, bool]:
    """Where the admin socket's folder goes, and whether it is outside the data directory
    (then it is removed at close). Makes nothing.

    ``DATADIR/run``, or for a long data directory path (the socket path would pass the OS
    limit) a folder named after the path under $XDG_RUNTIME_DIR or /tmp: the same one after
    a restart (we hold the data directory's lock), so a killed bus leaves none behind for
    good. That name is predictable: another local user can make it first, and then the
    bus runs without its admin endpoint (``open_private_folder``)."""
    resolved = datadir.resolve()
    folder = resolved / "run"
    if len(str(folder / ADMIN_SOCKET).encode()) < SOCKET_PATH_MAX:
        return folder, False
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    if not base or not os.path.isdir(base) or len(base) > SOCKET_PATH_MAX - 50:
        base = tempfile.gettempdir()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:20]
    return Path(base) / f"servicebus-{os.geteuid()}-{digest}", True


def user_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refusal(folder: Path, why: str) -> AdminFolderRefused:
    return AdminFolderRefused(
        f"{folder} {why}, so the admin socket is not put there and the admin endpoint is off: "
        f"`servicebus` commands cannot ask this bus while it runs. Remove {folder} (root or "
        "its owner can) and restart the bus, or give the bus a data directory with a shorter "
        "path (its socket then goes in DATADIR/run)")


def open_private_folder(folder: Path) -> int:
    """A file descriptor on ``folder``, made (mode 0700) if missing: a directory only this
    user (and root) can enter. ``AdminFolderRefused`` unless it is a real directory owned by
    this user: a symlink (even to a directory of ours), a file or another user's directory
    is refused, never followed, changed or used.

    The checks are made on the open descriptor (``O_NOFOLLOW``, ``fstat``, ``fchmod``) and
    the socket is bound through it (``Sockets.bind_admin``), so nobody can swap the folder
    between the check and the bind to catch the socket elsewhere."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass  # ours from a killed run, or someone else's: the checks below tell
    except OSError as exc:
        raise _refusal(folder, f"cannot be made ({exc.strerror})") from exc
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(folder, flags)
    except OSError as exc:
        try:
            st = os.lstat(folder)
        except OSError:
            raise _refusal(folder, f"cannot be opened ({exc.strerror})") from exc
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise _refusal(folder, f"is {what} owned by {user_name(st.st_uid)}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _refusal(folder, f"is a directory owned by {user_name(st.st_uid)}, not by this "
                                   f"bus's user {user_name(os.geteuid())}")
        os.fchmod(fd, 0o700)  # ours, made with another mode (by hand, an older version)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        self.bound: tuple[str, ...] = ()  # the ROUTER's bind address and the endpoint bound
        self.admin: zmq.Socket | None = None
        self.admin_off: str | None = None  # why the bus runs without its admin endpoint
        self._admin_fd: int | None = None  # the admin socket's folder, as checked
        self._admin_folder: Path | None = None
        self._admin_outside = False  # the folder is outside DATADIR: removed at close
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
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound = (bind, endpoint)
        return endpoint

    def bind_admin(self, datadir: Path) -> str | None:
        """Bind the admin endpoint: a Unix socket in a directory only this user can enter
        (``admin_folder``, ``open_private_folder``). Never TCP: the kernel's directory
        permissions are its access control. Returns the endpoint the CLI connects to, or
        None when the folder is refused or the socket cannot be bound: the bus runs
        without it (``admin_off`` says why), since an operator's view must never stop the
        service, and another user must not be able to stop it by making a folder."""
        folder, outside = admin_folder(datadir)
        try:
            fd = open_private_folder(folder)
        except AdminFolderRefused as exc:
            self.admin_off = str(exc)
            return None
        self._admin_fd, self._admin_folder, self._admin_outside = fd, folder, outside
        try:
            os.unlink(ADMIN_SOCKET, dir_fd=fd)  # left by a killed bus; the data directory lock is ours
        except FileNotFoundError:
            pass
        # Bound through the descriptor checked above, not the folder's path: what the path
        # names may change, the descriptor's directory cannot. Linux's /proc/self/fd
        # resolves to it (and keeps the path short whatever the folder's length). Without
        # /proc, the path: in a sticky /tmp, $XDG_RUNTIME_DIR or DATADIR only this user
        # can rename the folder.
        via = f"/proc/self/fd/{fd}"
        target = f"{via}/{ADMIN_SOCKET}" if os.path.isdir(via) else str(folder / ADMIN_SOCKET)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.bind(f"ipc://{target}")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._release_admin_folder()
            self.admin_off = f"cannot bind the admin endpoint ipc://{folder / ADMIN_SOCKET}: {exc}"
            return None
        self.admin = sock
        self.poller.register(sock, zmq.POLLIN)
        self.degraded_poller.register(sock, zmq.POLLIN)
        return f"ipc://{folder / ADMIN_SOCKET}"

    def _release_admin_folder(self) -> None:
        """Remove the admin socket, and its folder if it is outside the data directory
        (only if it is still the folder we opened, and empty: never another's)."""
        fd, self._admin_fd = self._admin_fd, None
        if fd is None:
            return
        try:
            try:
                os.unlink(ADMIN_SOCKET, dir_fd=fd)
            except FileNotFoundError:
                pass
            if self._admin_outside and self._admin_folder is not None:
                st, now = os.fstat(fd), os.lstat(self._admin_folder)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    os.rmdir(self._admin_folder)
        except OSError as exc:
            log.debug("admin folder not removed: %s", exc)
        finally:
            os.close(fd)

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
        self._release_admin_folder()
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
        self._release_admin_folder()  # a failed open's, after its socket is gone

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
