"""The LevelDB store: one database per data directory, split into keyspaces by prefix.

Only this module touches plyvel. Other modules speak in records and ``Batch`` methods,
never in raw keys. Every change that spans keyspaces goes through one ``Batch`` and so is
atomic. Keys (``\\0`` separates parts; topics and addresses cannot contain it)::

    m/<name>                       meta (node id, format version)
    s/<subscriber>\\0<topic>        subscriptions: who subscribed to me
    i/<publisher>\\0<topic>         subscribe intents: whom I asked (and whether confirmed)
    o/<stream>\\0<key>              outgoing segments (model/segments.py: the messages of one
                                   publish, keyed by the first one's id), one log per stream
                                   (e:<topic>, ...)
    d/<peer>\\0<stream>             delivery state of one peer on one stream (a cursor, by key)
    n/<key>                        incoming segments not yet handled (a message split off
                                   from its segment: a segment of one, under its own id)
    r/<id>                         run state of an incoming message (attempts, errors)
    c/<key>\\0<start>               how far the run of a received segment got (Progress)
    h/<key>                        handled segment keys, kept for the dedupe window (value:
                                   when, in bus-clock ms, see clock.py)
    t/<when, 8 bytes><id>          the same ids ordered by when they were handled (pruning)
    x/<id>                         dead letters, one per message (its record a segment of one)
    y/<command id>                 replies of handled requests, not yet queued for sending
    j/<seq, 8 bytes>               delivery journal records not yet moved to segment files
    g/<segment file name>          when (bus-clock ms) a journal segment was written (retention)
    p/<dedupe key>, q/<when><key>  publish(dedupe_key=): the id it made, and the same by time
    v/<key>                        bus.kv / message.kv values
    u/<handled id>\0<seq>          commands a handler sent, committed with its run (the outbox)

Beside the store, ``DATADIR/store.hwm`` holds its high-water mark (``mark.py``): a store
found holding less than it had made durable (a lost or cut log) is refused.

Outgoing messages are stored once per stream, however many subscribers there are; each
subscriber's delivery state is a cursor into the stream (see ``delivery.py``). That keeps a
fan-out to ten subscribers at one write per message.
"""

from .batch import Batch
from .db import OlderFormatError, Store
from .keys import FORMAT_VERSION, KEYSPACES, SEP
from .mark import MARK_INTERVAL, MARK_NAME

__all__ = ["Store", "OlderFormatError", "Batch", "KEYSPACES", "FORMAT_VERSION", "SEP", "MARK_INTERVAL", "MARK_NAME"]
