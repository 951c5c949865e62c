"""The fleet delivery audit: a PySpark job over the journals of many buses.

Run it with ``servicebus audit PATH ... --out DIR`` or, on a cluster, with
``spark-submit servicebus/audit/job.py PATH ... --out DIR``.

The package imports nothing from the rest of servicebus (it reads journals; it never runs
a bus), and imports PySpark only inside the functions that use it. Its modules:

- ``job``: what spark-submit runs and the CLI calls: the command line, the Java check,
  starting Spark, the printed summary; it re-exports the names below that it used to hold
- ``pipeline``: ``run``, the audit from journals to summary, phase by phase
- ``journals``: finding the journal segments and reading them, and the buses' own files
  (service name and data directory per address)
- ``reconcile``: the events folded into one row per (message, receiver) pair
- ``checkpoint``: what an incremental audit carries from one run to the next
- ``classify``: each pair's class, and every summary from one rollup of the classes
- ``problems``: the problem pairs (lost, duplicated, dead-lettered, in flight, owed) with
  names and the command that acts on each: the ``problems`` table and the lists
- ``outputs``: the small tables, summary.json and the report (drawn by ``report``; its
  paged list of problem pairs by ``reportlist``)
- ``hadoopfs``: small files on any filesystem Spark writes
- ``errors``: ``AuditError``, bad input said in one line
- ``synthetic``: journals with known faults, for the tests and tools/bench_audit
"""
