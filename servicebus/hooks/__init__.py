"""Observers of what the bus does: the delivery journal, Prometheus metrics, tracing and
the waits of ``Bus.once/any/all``. They are told; they never drive the loop."""
