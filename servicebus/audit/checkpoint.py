"""Incremental audits (``--checkpoint DIR``): what one run leaves for the next.

Segments are immutable once written, so a run needs to read only the segments no earlier
run read; the pairs still open (and those recent enough to meet a late duplicate) are
carried forward as partial aggregates that the next run folds its new events into.
"""

from __future__ import annotations

import json

from .errors import AuditError
from .hadoopfs import delete_path, read_text, write_text


class Checkpoint:
    """What an incremental audit keeps between runs, under its checkpoint directory:
    ``checkpoint.json`` (the segments read, each journal's latest event, the current
    state directory) and ``state-<n>`` (the carried pairs, Parquet). A run writes a new
    state directory, then the JSON that points at it: one that stops half-way leaves the
    previous checkpoint whole."""

    def __init__(self, root: str, files: set[str], clocks: dict[str, int], state: str | None,
                 generation: int) -> None:
        self.root = root.rstrip("/")
        self.files = files
        self.clocks = clocks
        self.state = state
        self.generation = generation
        self.carried = 0
        self.carried_out = 0

    @classmethod
    def load(cls, spark, root: str) -> "Checkpoint":
        text = read_text(spark, f"{root.rstrip('/')}/checkpoint.json")
        if text is None:
            return cls(root, set(), {}, None, 0)
        try:
            data = json.loads(text)
            return cls(root, set(data["files"]), {k: int(v) for k, v in data["clocks"].items()},
                       data.get("state"), int(data["generation"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise AuditError(f"{root}/checkpoint.json is not a checkpoint this audit wrote ({exc}); "
                             "move it away to start over") from exc

    def pairs(self, spark):
        if self.state is None:
            return None
        frame = spark.read.parquet(f"{self.root}/{self.state}")
        self.carried = frame.count()
        return frame

    def save(self, spark, pairs, messages, carry_ms: int) -> None:
        """Write the pairs to carry (from ``pairs``, classified in ``messages``), then the
        JSON naming them, the segments read (``self.files``) and the journals' clocks."""
        from pyspark.sql import functions as F

        col = F.col
        open_ = col("class").isin("in_flight", "owed")  # owed: still held by its sender
        keep = (messages.where(open_ | (col("age_ms").isNull()) | (col("age_ms") < F.lit(carry_ms)))
                .select("id", "receiver", open_.cast("int").alias("was_open")))
        carried = pairs.drop("touched", "was_open", "new_events").join(keep, ["id", "receiver"], "inner")
        generation = self.generation + 1
        name = f"state-{generation}"
        carried.write.mode("overwrite").parquet(f"{self.root}/{name}")
        self.carried_out = spark.read.parquet(f"{self.root}/{name}").count()
        write_text(spark, f"{self.root}/checkpoint.json", json.dumps(
            {"generation": generation, "state": name, "files": sorted(self.files),
             "clocks": self.clocks}, indent=1))
        if self.state is not None:  # the previous state: no checkpoint points at it now
            delete_path(spark, f"{self.root}/{self.state}")
