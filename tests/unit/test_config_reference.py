"""The config reference (issue 48): docs/config.md's "Config reference" section is what the schema's help
writes (regenerated in memory and compared), and every key of every section has help."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from raypar.core.config import reference
from raypar.core.config.schema import Config, TrainConfig, key


# Each a schema with one thing changed: the sections' docstrings (which the page shows) kept, since
# @dataclass writes a signature into a class without one.
@dataclass
class _RewordedTrain(TrainConfig):
    __doc__ = TrainConfig.__doc__
    steps: int = key(10, "Optimizer steps, reworded since the page was written.", rule="> 0")


@dataclass
class _UnhelpedTrain(TrainConfig):
    __doc__ = TrainConfig.__doc__
    extra: int = 0  # declared as a plain default, not with key(...)


@dataclass
class _RewordedConfig(Config):
    __doc__ = Config.__doc__
    train: TrainConfig = field(default_factory=_RewordedTrain)


@dataclass
class _UnhelpedConfig(Config):
    __doc__ = Config.__doc__
    train: TrainConfig = field(default_factory=_UnhelpedTrain)


def check_current(config: type = Config) -> None:
    problem = reference.stale(reference.PAGE.read_text(encoding="utf-8"), config)
    assert problem is None, problem


def check_helped(config: type = Config) -> None:
    missing = reference.missing_help(config)
    assert missing == [], f"config keys without help (declare them with schema.key): {', '.join(missing)}"


def test_docs_config_is_generated_from_the_schema():
    check_current()


def test_a_changed_help_makes_the_page_stale():
    """Control: the same check, on a schema whose train.steps help differs from the page, names the command
    that regenerates it."""
    with pytest.raises(AssertionError, match=r"reworded since.*regenerate it: make docs-config"):
        check_current(_RewordedConfig)


def test_every_key_has_help():
    check_helped()


def test_a_key_without_help_is_named():
    """Control: a field declared without help is reported by its section and name."""
    with pytest.raises(AssertionError, match=r"without help .*: train\.extra\b"):
        check_helped(_UnhelpedConfig)


def test_the_reference_shows_choices_rules_and_bounds():
    """What a reader looks up: the schedule's choices (options.SCHEDULES), tp's rule, n_layers' upper bound
    (rules.MAX_SIZES), each in its section's table."""
    text = reference.markdown()
    parallel = text[text.index("### `[parallel]`"):text.index("### `[train]`")]
    assert '`"1f1b"`, `"gpipe"`, `"zb-h1"`, `"dualpipev"`' in parallel
    assert "| `tp` | int | `1` | must divide model.n_heads" in parallel
    assert "| `n_layers` | int | `0` | > 0; at most 4096 |" in text
