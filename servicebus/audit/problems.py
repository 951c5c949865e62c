"""The pairs an operator acts on, each with the command that acts on it.

Every pair of a class in ``LISTED`` is a row of the ``problems`` table (DIR/problems, all
of them) with its topic, sender and receiver (the service name beside each address, from
the buses' ``<node>.bus.json``: journals.py), its latest event and a command:

- ``deadlettered``: ``servicebus replay DATADIR ID``, on the side that holds the dead letter
  (the receiver's, or the sender's for one it could not deliver: expired, subscriber
  removed)
- ``in_flight``: stored at the receiver and not handled yet: ``servicebus incoming``
  of the receiver; not received yet: ``servicebus outgoing SENDER --subscriber RECEIVER``
- ``owed``: the sender holds it for a receiver that is down: the same ``outgoing``
- ``lost``: acknowledged, then no trace at the receiver: ``servicebus check`` of the
  receiver's data directory (a store that lost writes says so, and ``--repair`` lists
  what it lost by id)
- ``handled_more_than_once``: the receiver's journal lines about the id (``grep``), with the
  time and attempt of each run

A data directory comes from the bus's own file; a journal without one (written before it
existed) gets ``<data directory of ADDRESS>``, to fill in. summary.json and the report list
the first ``LIST_MAX`` of each class, by id (the oldest first), beside its true count.
"""

from __future__ import annotations

from typing import Any

LISTED = ("lost", "handled_more_than_once", "deadlettered", "in_flight", "owed")
LIST_MAX = 1000
COLUMNS = ("class", "id", "topic", "sender", "sender_name", "receiver", "receiver_name", "last_event",
           "last_ts", "published_ts", "handled_count", "attempts", "deadletter_reason", "command")

# What each class means and what to do, for the report (the command is per pair).
MEANING = {
    "lost": "acknowledged by the receiver, then nothing in its journal: check its store "
            "(servicebus check; --repair lists what a damaged store lost, by id)",
    "handled_more_than_once": "a duplicate reached a handler: its journal lines show each run "
                              "(a handler that is not idempotent did the work twice)",
    "deadlettered": "the handler failed every attempt, or it expired: fix the cause, then replay it",
    "in_flight": "not handled yet, younger than the grace or stored at the receiver: look at what "
                 "is pending; if it stays, the receiver is stuck",
    "owed": "the sender still holds it for a receiver that is down: start the receiver, or purge "
            "the subscriber (servicebus purge --subscriber) if it is gone for good",
}

# \z, not $: Java's $ also matches before a final line terminator ("/srv/x\n" would pass
# unquoted, and a pasted command would run its next word as a command of its own).
_SAFE = r"^[A-Za-z0-9_./:@%+=,-]+\z"


def _shell(c):
    """``c`` as one shell word (quoted unless it needs none)."""
    from pyspark.sql import functions as F

    quoted = F.concat(F.lit("'"), F.regexp_replace(c, "'", "'\\\\''"), F.lit("'"))
    return F.when(c.rlike(_SAFE), c).otherwise(quoted)


def problem_table(spark, messages, buses: dict[str, dict[str, str | None]]):
    """The ``problems`` table: every pair of a LISTED class, with names and its command."""
    from pyspark.sql import functions as F

    col, lit = F.col, F.lit
    rows = [(a, b.get("name"), b.get("datadir")) for a, b in buses.items()] or [("", None, None)]
    known = spark.createDataFrame(rows, "address STRING, name STRING, datadir STRING")

    def side(who: str):
        return F.broadcast(known.select(col("address").alias(who), col("name").alias(f"{who}_name"),
                                        col("datadir").alias(f"{who}_dir")))

    pairs = (messages.where(col("class").isin(*LISTED))
             .join(side("sender"), "sender", "left").join(side("receiver"), "receiver", "left"))

    def datadir(who: str):
        # Quoted too: pasted as it is, < and > would be redirections (and the address is the journal's).
        unknown = _shell(F.concat(lit("<data directory of "), F.coalesce(col(who), lit(f"the {who}")), lit(">")))
        return F.coalesce(_shell(col(f"{who}_dir")), unknown)

    klass, mid = col("class"), _shell(col("id"))
    cmd = lambda *parts: F.concat(*[lit(p) if isinstance(p, str) else p for p in parts])  # noqa: E731
    command = (
        F.when((klass == "deadlettered") & (col("deadlettered_at") == "sender"),
               cmd("servicebus replay ", datadir("sender"), " ", mid))
        .when(klass == "deadlettered", cmd("servicebus replay ", datadir("receiver"), " ", mid))
        .when((klass == "in_flight") & (F.coalesce(col("received"), lit(0)) > 0),
              cmd("servicebus incoming ", datadir("receiver"), " --topic ", _shell(col("topic"))))
        .when(klass.isin("in_flight", "owed"),
              cmd("servicebus outgoing ", datadir("sender"), " --subscriber ", _shell(col("receiver"))))
        .when(klass == "lost", cmd("servicebus check ", datadir("receiver")))
        .otherwise(cmd("servicebus journal events ", datadir("receiver"), " --id ", mid)))
    return pairs.select(*[command.alias(c) if c == "command" else col(c) for c in COLUMNS])


def listed(problems, counts: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """The first LIST_MAX pairs of each LISTED class (by id, the oldest first) as dicts."""
    from functools import reduce

    from pyspark.sql import functions as F

    out: dict[str, list[dict[str, Any]]] = {k: [] for k in LISTED}
    firsts = [problems.where(F.col("class") == k).orderBy("id", "receiver").limit(LIST_MAX)
              for k in LISTED if counts.get(k)]
    if firsts:  # one collect for every class: a Spark job costs most of a second on a busy host
        for r in reduce(lambda a, b: a.unionByName(b), firsts).collect():
            row = r.asDict()
            out[row.pop("class")].append(row)
    for rows in out.values():
        rows.sort(key=lambda row: (row["id"], row["receiver"] or ""))
    return out


def name_addresses(summary: dict[str, Any], buses: dict[str, dict[str, str | None]]) -> None:
    """The service name beside each receiver in the summary's tables; the buses found."""
    names = {a: b.get("name") for a, b in buses.items()}
    for row in summary.get("by_receiver") or []:
        row["receiver_name"] = names.get(row["receiver"])
    for row in summary.get("owed") or []:
        row["receiver_name"] = names.get(row["receiver"])
    summary["buses"] = [{"address": a, **b} for a, b in sorted(buses.items())[:LIST_MAX]]
    summary["buses_count"] = len(buses)
