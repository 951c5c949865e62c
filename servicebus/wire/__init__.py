"""The wire: frames to records and back (``protocol``), which addresses may be connected
to (``policy``), CURVE keys and peers (``keys``, ``trust``), topics and patterns
(``topics``). No sockets, no disk."""
