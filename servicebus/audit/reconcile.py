"""Reconciliation: the journal events folded into one row per (message, receiver) pair.

A sender-side event's receiver is its ``peer``, a receiver-side event's receiver is its
``address``; the pair's row carries everything the classification needs (first times,
counts, attempts, the dead letter reason, each side's latest event). Those rows are
partial aggregates that fold together (``combine``), which is what lets a checkpoint
carry pairs from one run into the next. Each journal's "now" (``journal_clocks``) is
taken from the pairs, so the events are read and shuffled once.

A journal line about a segment names its messages in ``ids`` (journals.py): it is spread
into one event per message before anything else, so that every later step is per message
exactly as for a line about one.
"""

from __future__ import annotations


# Columns of a pair's partial aggregate, each with how two partials combine (a checkpoint
# carries partials forward and the next run folds new events into them).
_COMBINE = {
    "topic": "first", "kind": "first", "sender": "first",
    "published_ts": "min", "received_ts": "min", "handled_ts": "min", "first_ts": "min",
    "received": "sum", "handled_count": "sum", "deadlettered": "sum", "dropped": "sum",
    "moved_drops": "sum", "moved_to": "first",
    "acked": "sum", "replayed": "sum",
    "retries": "sum", "n_events": "sum", "sender_deadlettered": "sum",
    "last_event": "max",
    "deadletter_reason": "first",
    "attempts": "max", "send_attempts": "max", "sender_max_ts": "max", "receiver_max_ts": "max",
}


# The pair's latest event in one number, so that it aggregates as a number (see partials):
# ts * 32 + the event's code, the later in a delivery the higher where two share a ts.
EVENTS = ("?", "published", "sent", "acked", "received", "handler_failed", "retried", "handled",
          "dropped", "expired", "deadlettered", "replayed", "moved")
_CODE_SPAN = 32


def last_event_columns():
    """``last_event`` (its name) and ``last_ts`` from a pair's packed ``last_event``."""
    from pyspark.sql import functions as F

    packed = F.col("last_event")
    names = F.create_map(*[F.lit(x) for i, name in enumerate(EVENTS) for x in (i, name)])
    return (names[(packed % _CODE_SPAN).cast("int")].alias("last_event"),
            F.floor(packed / _CODE_SPAN).cast("long").alias("last_ts"))


def one_per_message(events):
    """The events, a line about several messages (``ids``) spread into one row per message:
    the same columns but ``ids``, ``id`` the message's. Lines without ``event`` or message
    are left out.

    ``explode`` of the line's ``ids``, or of ``[id]`` for a line about one message (``ids``
    null or an empty array, which no journal writes): in the JVM, inside the scan's stage,
    before any shuffle; a Python UDF would ship every line to a Python worker and back.
    ``id`` is filtered after the explode: an element of ``ids`` can be null in a
    hand-written line. Events without the column (spread already, ``read_events(spread=
    True)``, or an older schema) are each about ``id``: nothing to explode."""
    from pyspark.sql import functions as F

    col = F.col
    events = events.where(col("event").isNotNull())
    if "ids" not in events.columns:
        return events.where(col("id").isNotNull())
    ids = col("ids")
    one_each = F.explode(F.coalesce(F.when(F.size(ids) > 0, ids), F.array(col("id"))))
    return (events
            .select(one_each.alias("id"), *[c for c in events.columns if c not in ("id", "ids")])
            .where(col("id").isNotNull()))


def address_now(moved: dict[str, tuple[str, str | None]] | None, own: bool = False):
    """A column's address as its bus has it now (``moved``: journals.moved_addresses).
    ``own``: the column is the address of the journal the event is in (its ``node``):
    moved only when that journal is the bus that had it (an older bus without a bus file,
    given the port later, is not the one that moved away from it)."""
    from pyspark.sql import functions as F

    if not moved:
        return lambda c: c
    latest = F.create_map(*[F.lit(x) for a, (now, _node) in moved.items() for x in (a, now)])
    nodes = {a: node for a, (_now, node) in moved.items() if node is not None}
    if not own or not nodes:
        return lambda c: F.coalesce(latest[c], c)
    owner = F.create_map(*[F.lit(x) for pair in nodes.items() for x in pair])
    return lambda c: F.when(owner[c].isNull() | (owner[c] == F.col("node")), F.coalesce(latest[c], c)).otherwise(c)


def partials(events, moved: dict[str, tuple[str, str | None]] | None = None):
    """One row per (message id, receiver): everything the classification needs. ``moved``
    (journals.moved_addresses): an earlier address of a bus -> its address now, so that a
    bus that moved is one receiver (and one sender, one journal clock).

    The events are shuffled once, by pair. The aggregation runs in two steps over that
    one partitioning: first grouped by pair and its strings (topic, kind, sender, dead
    letter reason), so that every aggregate is a number and Spark uses its hash
    aggregation; then the few rows of a pair whose strings differ (a dead letter's reason
    is on one event only) are folded into one. Strings in the aggregation buffers make
    Spark sort all the events instead (measured: 9-13 s against 7-8 s on 5M events)."""
    from pyspark.sql import functions as F

    col, when = F.col, F.when
    # Events as numbers before the shuffle: each aggregate below tests an int, not a
    # string, and the rows shuffled are narrower (measured: 0.3-0.6 s of 6.3 warm on 5M).
    code_of = {name: i for i, name in enumerate(EVENTS)}
    code = col("code")
    is_ = lambda *names: code.isin(*[code_of[n] for n in names])  # noqa: E731
    count_of = lambda *names: F.sum(when(is_(*names), 1).otherwise(0))  # noqa: E731
    sender_side = col("sender_side")
    now, own = address_now(moved), address_now(moved, own=True)
    codes = F.create_map(*[F.lit(x) for name, i in code_of.items() for x in (name, i)])
    by_role = col("role") == "sender"
    event = col("event")
    # "dropped, moved to B" at a bus's old address is no drop for that bus at B: it would
    # hide a loss there (dropped is tested before lost). Where B is not known to be the
    # same bus (yet), the drop stays, with where it went: a checkpointed run that learns of
    # the move later takes it back (pipeline.run).
    to = when(event == "dropped", F.regexp_extract(col("error"), "^moved to (.+)$", 1))
    e = (one_per_message(events)  # a line about a segment's messages: one event per message
         .select("id", "topic", "kind", "ts", "attempt",
                 F.coalesce(codes[event], F.lit(0)).alias("code"),  # [], not element_at: null if absent, ANSI or not
                 by_role.alias("sender_side"),
                 when(by_role, now(col("peer"))).otherwise(own(col("address"))).alias("receiver"),
                 when(by_role, own(col("address"))).otherwise(now(col("peer"))).alias("sender"),
                 when(event.isin("deadlettered", "expired"), F.coalesce(col("error"), event))
                 .alias("deadletter_reason"),
                 when(to != "", to).alias("moved_to")))
    if moved:
        same_bus = is_("dropped") & (now(col("moved_to")) == col("receiver"))
        e = (e.withColumn("code", when(same_bus, code_of["moved"]).otherwise(code))
             .withColumn("moved_to", when(is_("dropped"), col("moved_to"))))
    partitions = int(events.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    by_strings = e.repartition(partitions, "id", "receiver").groupBy(
        "id", "receiver", "topic", "kind", "sender", "deadletter_reason", "moved_to").agg(
        F.min(when(is_("published"), col("ts"))).alias("published_ts"),
        F.min(when(is_("received"), col("ts"))).alias("received_ts"),
        F.min(when(is_("handled"), col("ts"))).alias("handled_ts"),
        F.min("ts").alias("first_ts"),
        count_of("received").alias("received"),
        count_of("handled").alias("handled_count"),
        count_of("deadlettered", "expired").alias("deadlettered"),
        count_of("dropped").alias("dropped"),
        F.sum(when(is_("dropped") & col("moved_to").isNotNull(), 1).otherwise(0)).alias("moved_drops"),
        count_of("acked").alias("acked"),  # the receiver acknowledged it: it had it
        count_of("replayed").alias("replayed"),  # a dead letter put back (servicebus replay)
        count_of("retried").alias("retries"),
        # where a dead letter is, for the command that replays it
        F.sum(when(sender_side & is_("deadlettered", "expired"), 1).otherwise(0)).alias("sender_deadlettered"),
        F.max(col("ts") * _CODE_SPAN + code.cast("long")).alias("last_event"),
        F.count(F.lit(1)).alias("n_events"),
        F.max(when(is_("handled", "handler_failed"), col("attempt"))).alias("attempts"),
        F.max(when(is_("sent"), col("attempt"))).alias("send_attempts"),
        # Each journal's "now" is its latest event, on its own clock: kept per side here
        # so that it comes from the pairs, without a second pass over the events.
        F.max(when(sender_side, col("ts"))).alias("sender_max_ts"),
        F.max(when(~sender_side, col("ts"))).alias("receiver_max_ts"),
    )
    return combine([by_strings])


def combine(frames):
    """Fold partials of the same pairs (a checkpoint's and a new run's) into one row each."""
    from functools import reduce

    from pyspark.sql import functions as F

    union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), frames)
    for c, kind in (("sender_deadlettered", "long"), ("last_event", "long"), ("moved_drops", "long"),
                    ("moved_to", "string")):  # a checkpoint an older audit wrote
        if c not in union.columns:
            union = union.withColumn(c, F.lit(None).cast(kind))
    fold = {"first": lambda c: F.first(c, ignorenulls=True), "min": F.min, "max": F.max, "sum": F.sum}
    extra = [F.max(c).alias(c) for c in ("touched", "was_open") if c in union.columns]
    if "new_events" in union.columns:  # events read by this run (not carried in)
        extra.append(F.sum("new_events").alias("new_events"))
    return union.groupBy("id", "receiver").agg(
        *[fold[how](c).alias(c) for c, how in _COMBINE.items()], *extra)


def journal_clocks(pairs, count: str = "n_events") -> tuple[dict[str, int], int]:
    """Each journal's latest event (its address -> ts): the sender side of every pair is
    in the sender's journal, the receiver side in the receiver's; and the sum of the pairs'
    ``count`` column (the events read), in the same job (a Spark job costs most of a
    second on a busy host)."""
    from pyspark.sql import functions as F

    sides = (pairs.select(F.col("sender").alias("node"), F.col("sender_max_ts").alias("ts"), F.col(count).alias("n"))
             .unionByName(pairs.select(F.col("receiver").alias("node"), F.col("receiver_max_ts").alias("ts"),
                                       F.lit(0).cast("long").alias("n"))))
    rows = sides.groupBy("node").agg(F.max("ts").alias("ts"), F.sum("n").alias("n")).collect()
    clocks = {r["node"]: r["ts"] for r in rows if r["node"] is not None and r["ts"] is not None}
    return clocks, sum(r["n"] or 0 for r in rows)
