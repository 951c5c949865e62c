"""Bus options: a mistyped one names the option that was meant."""

from __future__ import annotations

import pytest

from servicebus import BusConfig
from servicebus.testing import StubBus


def test_a_mistyped_option_names_the_closest_real_one():
    with pytest.raises(TypeError, match=r"unknown option 'max_attempt' \(did you mean 'max_attempts'\?\)"):
        BusConfig.of({"max_attempt": 3})


def test_an_option_like_no_other_is_named_without_a_guess():
    with pytest.raises(TypeError) as caught:
        BusConfig.of({"zzzz": 1})
    assert "unknown option 'zzzz';" in str(caught.value) and "did you mean" not in str(caught.value)


def test_the_stub_bus_names_a_mistyped_option_as_bus_does():
    with pytest.raises(TypeError, match="did you mean 'workers'"):
        StubBus(worker=2)


def test_known_options_still_make_a_config():
    assert BusConfig.of({"max_attempts": 3}).max_attempts == 3
