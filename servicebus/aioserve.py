"""An asyncio server on a thread of its own, for the HTTP fronts (the gateway, the console):
``start()`` returns once the server says it listens (or raises what stopped it), ``close()``
stops its loop and waits for it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Self

__all__ = ["LoopThread"]


class LoopThread:
    """Subclasses give ``_serve()``: a coroutine that sets ``self._loop`` and
    ``self._stopped``, calls ``self._ready.set()`` once listening, and returns after
    ``self._stopped`` is set (setting ``_ready`` again on its way out, for a failed start)."""

    thread_name = "servicebus-loop"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _serve(self) -> Coroutine[Any, Any, None]:
        raise NotImplementedError

    def start(self) -> Self:
        """Serve on a thread of its own; returns once listening."""
        def main() -> None:
            try:
                asyncio.run(self._serve())
            except BaseException as exc:  # noqa: BLE001 - told to start()'s caller
                self._error = exc
                self._ready.set()

        self._thread = threading.Thread(target=main, name=self.thread_name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _stop_loop(self) -> None:
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:  # closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout=30)

    def close(self) -> None:
        self._stop_loop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
