"""The `teacherq` app's verbs: each registered once."""

from __future__ import annotations

from collections import Counter

from producer.cli import app


def test_every_verb_is_registered_once() -> None:
    """No verb module is registered twice (a second `register(app)` adds every command
    again, and typer serves the first while `--help` lists both)."""
    names = Counter(c.name or c.callback.__name__ for c in app.registered_commands)
    assert names and max(names.values()) == 1, names
    assert {"trace", "status", "submit-dataset", "exporter"} <= set(names)
