"""The delivery core: the state machine behind the durability contract, with no I/O.

No module in this package imports zmq or plyvel. ``Core`` (machine.py) takes events in
(decoded frames, user commands, time) and gives effects out (one batch of writes and
whether it needs an fsync, callers to release, messages for the handlers, acks and frames
to send); ``engine.py`` is the shell that does the I/O. Its parts, one concern each:

- ``peers``: peers and liveness (pings, pongs, forgetting idle addresses);
- ``handshake``: both sides of subscribe and unsubscribe;
- ``streams``: what goes into the outgoing streams and garbage collection;
- ``sender``: windows, acks, resends, frames;
- ``expiry``: sender-side dead letters (expired, refused, damaged);
- ``receiver``: dedupe, store, ack, hand-off, and pruning the dedupe window;
- ``ports``: the narrow protocols the core reads the store and opens links through.
"""

from .commands import Published, QueueReply, QueueSend, SendCmd, SubscribeCmd, Supersede
from .machine import TICK, Core
from .ports import NO_EVENTS, EventSwitch, Links, StoreView, WriteBatch
from .state import Effects, Incoming, Intent, Peer, incoming_record

__all__ = [
    "Core", "TICK", "Effects", "Incoming", "Intent", "Peer", "incoming_record",
    "Published", "QueueReply", "QueueSend", "SendCmd", "SubscribeCmd", "Supersede", "Links", "StoreView", "WriteBatch",
    "EventSwitch", "NO_EVENTS",
]
