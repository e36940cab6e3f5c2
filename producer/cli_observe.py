"""`teacherq trace` and `teacherq status`: look at recorded traces and at a queue's state.

`register(app)` adds both commands to the `teacherq` Typer app (called from producer/cli.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from producer.cli_common import since_option, verb_settings
from shared import exitcodes
from shared.settings import Settings

out = Console()
err = Console(stderr=True, soft_wrap=True)

EXIT_NOT_FOUND = exitcodes.NOT_DONE  # like `teacherq results` for unfinished jobs


def _redis(settings: Settings):
    from shared.redis_client import connect

    return connect(settings.redis)


def trace(
    job_id: Annotated[str | None, typer.Argument(help="The job whose trace to show.")] = None,
    fmt: str = typer.Option("tree", "--format", help="tree | chrome | json"),
    output: Path = typer.Option(None, "-o", "--output", help="Write to FILE, not stdout."),
    html_file: Path = typer.Option(None, "--html", help="Write a self-contained HTML timeline."),
    batch: str = typer.Option(None, "--batch", help="A batch and every job that rode in it."),
    since: str = typer.Option(None, help="Jobs first seen from: unix s, ISO time or age (10m)."),
    until: str = typer.Option(None, help="With --since: up to this time (default: now)."),
    limit: int = typer.Option(500, help="With --since: at most this many jobs."),
) -> None:
    """Show the recorded spans of a job (or a batch, or a time window): a tree, Chrome /
    Perfetto trace-event JSON (`--format chrome -o trace.json`), or an HTML timeline."""
    from producer.trace_export import (
        load_batch,
        load_job,
        load_window,
        render_rich,
        render_text,
        to_chrome,
        to_html,
    )
    from shared.trace_store import TraceStore

    chosen = [x for x in (job_id, batch, since) if x is not None]
    if len(chosen) != 1:
        err.print("[red]give exactly one of JOB_ID, --batch ID or --since TIME[/red]")
        raise typer.Exit(2)
    if fmt not in ("tree", "chrome", "json"):
        err.print(f"[red]unknown --format {fmt!r}; expected tree, chrome or json[/red]")
        raise typer.Exit(2)
    settings = verb_settings()
    store = TraceStore(_redis(settings), settings.queue.name)
    if job_id is not None:
        view = load_job(store, job_id)
    elif batch is not None:
        view = load_batch(store, batch)
    else:
        now = time.time()
        lo = since_option(since, now=now)
        hi = since_option(until, now=now) if until else now
        view = load_window(store, lo, hi, limit=limit)
    if view.empty:
        err.print(f"[yellow]no spans recorded for {view.title}[/yellow]")
        raise typer.Exit(EXIT_NOT_FOUND)
    if html_file is not None:
        html_file.write_text(to_html(view), encoding="utf-8")
        err.print(f"wrote {html_file}")
    if fmt == "chrome":
        text = json.dumps(to_chrome(view))
    elif fmt == "json":
        text = json.dumps(
            {
                "title": view.title,
                "jobs": [{"job_id": j.job_id, "spans": j.spans} for j in view.jobs],
                "batches": view.batches,
            }
        )
    elif output is None and html_file is not None:
        return  # the page was the point; no tree unless asked with -o
    elif output is None and sys.stdout.isatty():
        out.print(render_rich(view))
        return
    else:
        text = render_text(view)
    if output is not None:
        output.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        err.print(f"wrote {output}")
    else:
        typer.echo(text.rstrip("\n"))


def status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object (per refresh)."),
    watch: bool = typer.Option(False, "--watch", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(2.0, help="With --watch: seconds between refreshes."),
    window: float = typer.Option(60.0, help="Seconds of history for jobs/s and tokens/s."),
) -> None:
    """Queue backlog and tokens, work in flight per consumer, dead letters, consumers and
    throughput: tables on a terminal, one JSON object otherwise (or with --json)."""
    from producer.status import render, snapshot

    settings = verb_settings()
    r = _redis(settings)
    q = settings.queue

    def snap() -> dict:
        return snapshot(r, q.name, q.group, window_s=window)

    use_json = as_json or not sys.stdout.isatty()
    interval = max(0.1, interval)
    if not watch:
        if use_json:
            typer.echo(json.dumps(snap()))
        else:
            out.print(render(snap()))
        return
    try:
        with _until_interrupted() as pause:
            if use_json:
                while True:
                    typer.echo(json.dumps(snap()))
                    sys.stdout.flush()
                    if not pause(interval):
                        return
            from rich.live import Live

            with Live(render(snap()), console=out, auto_refresh=False) as live:
                while pause(interval):
                    live.update(render(snap()), refresh=True)
    except KeyboardInterrupt:  # a second Ctrl-C, during a refresh that hangs
        return


@contextmanager
def _until_interrupted() -> Iterator[Callable[[float], bool]]:
    """For a refresh loop: yields `pause(seconds)`, which waits that long and returns False once
    Ctrl-C (SIGINT) has come. The first SIGINT only records itself and wakes the pause, so the
    loop ends between two refreshes: a KeyboardInterrupt raised wherever the main thread happens
    to be can land in a finalizer, where Python drops it, and the loop would run on. A second
    SIGINT raises KeyboardInterrupt at once (a refresh stuck on an unreachable Redis)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signals = 0

    def handle(_signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            raise KeyboardInterrupt
        with suppress(BlockingIOError):
            os.write(wake_w, b"\0")

    def pause(seconds: float) -> bool:
        if signals:
            return False
        woken, _, _ = select.select([wake_r], [], [], seconds)
        return not woken and not signals

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield pause
    finally:
        signal.signal(signal.SIGINT, previous)
        os.close(wake_r)
        os.close(wake_w)


def register(app: typer.Typer) -> None:
    """Add the `trace` and `status` commands to the teacherq app."""
    app.command("trace")(trace)
    app.command("status")(status)
