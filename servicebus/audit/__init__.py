"""The fleet delivery audit: a PySpark job over the journals of many buses.

Run it with ``servicebus audit PATH ... --out DIR`` or, on a cluster, with
``spark-submit servicebus/audit/job.py PATH ... --out DIR``.
"""
