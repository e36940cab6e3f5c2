"""The settings of a `teacherq` verb: loaded once per command, in one way, for every verb
module (`cli.py`, `cli_datasets.py`, `cli_observe.py`, `cli_exporter.py`)."""

from __future__ import annotations

from shared.settings import Settings, load_settings


def verb_settings(queue: str | None = None) -> Settings:
    """The settings from the environment (`TEACHERQ_*`) and config file, with `queue` as the
    queue name when given. A bad setting raises SettingsError, which `producer.cli_errors`
    reports (exit 78)."""
    settings = load_settings()
    if queue:
        from producer.datasets.jobs import with_queue  # rq and friends: only when asked

        settings = with_queue(settings, queue)
    return settings
