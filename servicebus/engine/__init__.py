"""The engine: the one I/O thread (``loop``), the sockets it owns, the publishers' group
commit and the admin endpoint it serves. Nothing here decides a delivery: that is the
core's (``servicebus.core``); this package only does the I/O around it."""
