import pytest

from servicebus.store import Store


@pytest.fixture
def store(tmp_path):
    """An open store in a temporary directory, closed after the test."""
    s = Store.open(tmp_path / "store")
    yield s
    s.close()
