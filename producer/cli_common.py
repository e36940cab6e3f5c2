"""What the verb modules of the `teacherq` command line share (`cli.py`, `cli_datasets.py`,
`cli_observe.py`, `cli_exporter.py`): how a verb loads its settings, and how it reads a time
given on the command line (`--since`, `--until`)."""

from __future__ import annotations

import re
import time
from datetime import datetime

import typer

from shared.settings import Settings, load_settings


def verb_settings(queue: str | None = None) -> Settings:
    """The settings from the environment (`TEACHERQ_*`) and config file, with `queue` as the
    queue name when given. A bad setting raises SettingsError, which `producer.cli_errors`
    reports (exit 78)."""
    settings = load_settings()
    return settings.with_queue(queue) if queue else settings


def parse_since(text: str, *, now: float | None = None) -> float:
    """Unix seconds from an age such as '90s', '10m', '2h', '1d' (that long before now), unix
    seconds, or an ISO 8601 time (local time unless it has an offset)."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text.strip())
    if m:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return now - float(m.group(1)) * scale
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(
            f"{text!r}: expected an age like 30m / 2h / 1d, unix seconds, or an ISO 8601 time"
        ) from None


def since_option(text: str, *, now: float | None = None) -> float:
    """`parse_since` for a typer option: a bad value is a usage error (exit 2)."""
    try:
        return parse_since(text, now=now)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
