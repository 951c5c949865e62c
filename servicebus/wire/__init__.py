"""The wire: frames and records (``protocol``: kinds, records, encoders; ``decoding``),
what a field or a payload may be (``validation``, ``payload``), compression
(``compression``), which addresses may be connected to (``policy``), CURVE keys and peers
(``keys``, ``trust``), topics and patterns (``topics``). No sockets, no disk."""
