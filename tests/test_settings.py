"""Settings errors are worded alike for every component (gradwatch/settings.py): the setting, the
variable its value came from (nested ones included), and the value given."""

from __future__ import annotations

import pytest

from gradwatch.agent.config import load as agent_load
from gradwatch.aggregator.config import load as aggregator_load
from gradwatch.errors import ConfigError


def test_the_value_given_is_shown_even_when_the_rule_mentions_a_number():
    # "Input should be greater than 0" contains "0": the value was taken as shown already
    with pytest.raises(ConfigError) as e:
        agent_load(budget=0)
    assert str(e.value) == "agent.budget: Input should be greater than 0 (got 0)"


def test_a_nested_settings_variable_is_named(monkeypatch):
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS", "x")
    with pytest.raises(ConfigError) as e:
        aggregator_load(listen="tcp://127.0.0.1:0", metrics_port=0)
    assert str(e.value).startswith("aggregator.checks.skew_steps (GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS): ")
    assert "(got 'x')" in str(e.value)


def test_a_message_that_names_the_value_is_not_told_it_twice():
    with pytest.raises(ConfigError) as e:
        agent_load(endpoint="foo")
    assert str(e.value).count("'foo'") == 1
