"""Progress of `TeacherClient.wait`: jobs and tokens done, rate and ETA, on a terminal.

`track_wait(job_ids, progress)` turns the `progress` argument of `wait` into a tracker:
None means auto (a bar when stderr is a terminal), True/False force it on/off, and a
`WaitProgress` built by the caller (to give the total tokens, or its own console) is used as
is. Trackers that show nothing cost nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from shared.messages import TeacherResult


def result_tokens(result: TeacherResult) -> int:
    """Tokens a finished job covered (its scored rows plus the first token; 0 if failed)."""
    if result.logprobs is None:
        return 0
    return int(result.logprobs.shape[0]) + 1


class Tracker(Protocol):
    """What `wait` reports to."""

    def advance(self, job_id: str, result: TeacherResult) -> None:
        """One more job finished."""


class _Silent:
    def advance(self, job_id: str, result: TeacherResult) -> None:
        """Nothing to show."""


class _TokensColumn(ProgressColumn):
    """Tokens done (of the total when known) and tokens/s since the start."""

    def render(self, task: Task) -> Text:
        done = task.fields.get("tokens", 0)
        total = task.fields.get("total_tokens")
        text = f"{done:,}/{total:,} tok" if total else f"{done:,} tok"
        elapsed = task.elapsed or 0.0
        if elapsed > 0:
            text += f"  {task.completed / elapsed:,.1f} jobs/s  {done / elapsed:,.0f} tok/s"
        return Text(text, style="progress.data.speed")


class WaitProgress:
    """A progress bar for a wait on `total_jobs` jobs (rich.progress, on stderr by default).

    Use it as a context manager, or hand it to `TeacherClient.wait(progress=...)`, which
    enters it for the duration of the wait.
    """

    def __init__(
        self,
        total_jobs: int,
        *,
        total_tokens: int | None = None,
        console: Console | None = None,
        description: str = "teacher jobs",
    ) -> None:
        self.total_jobs = total_jobs
        self.description = description
        self.jobs = 0
        self.tokens = 0
        self.failed = 0
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _TokensColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._task = self._progress.add_task(
            description, total=total_jobs, tokens=0, total_tokens=total_tokens
        )

    def advance(self, job_id: str, result: TeacherResult) -> None:
        """Count one finished job (and its tokens; a failure is counted and named)."""
        self.jobs += 1
        self.tokens += result_tokens(result)
        if not result.ok:
            self.failed += 1
        desc = f"{self.description} ({self.failed} failed)" if self.failed else self.description
        self._progress.update(self._task, advance=1, tokens=self.tokens, description=desc)

    def __enter__(self) -> WaitProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()


@contextmanager
def track_wait(job_ids: Sequence[str], progress: bool | WaitProgress | None) -> Iterator[Tracker]:
    """The tracker `wait` reports to: a bar when asked (or, for None, when stderr is a
    terminal), else a silent one. The bar is closed however the wait ends."""
    if isinstance(progress, WaitProgress):
        with progress:
            yield progress
        return
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        yield _Silent()
        return
    with WaitProgress(len(set(job_ids))) as bar:
        yield bar
