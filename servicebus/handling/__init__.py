"""The handler side: the queue and ordered lanes (``dispatch``), one run of a message's
handlers (``runner``), who handles what (``handlers``), handler time limits
(``timeouts``), what a handler stages (``transaction``) and callers waiting for replies
(``requests``). It reads and writes the store; it never touches the core's state or the
engine's loop."""
