"""pytest fixtures for testing code that uses servicebus (loaded by pytest through the
``pytest11`` entry point when servicebus is installed).

- ``stub_bus``: a ``servicebus.testing.StubBus``, closed after the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .stub import StubBus


@pytest.fixture
def stub_bus() -> Iterator[StubBus]:
    """An in-memory bus for testing handlers: register them, publish, ``drain()``, assert."""
    with StubBus() as bus:
        yield bus
