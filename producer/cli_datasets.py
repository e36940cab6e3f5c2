"""The dataset verbs of the `teacherq` command line: submit-dataset, datasets, worker,
dataset-replay. `register(app)` adds them to the main app (producer/cli.py)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from producer.cli_common import verb_settings
from shared import exitcodes
from shared.messages import OPTION_FIELDS, RequestOptions
from shared.settings import Settings

out = Console()
err = Console(stderr=True, soft_wrap=True)


def _settings(queue: str | None = None) -> Settings:
    settings = verb_settings(queue)
    from shared.log import configure_logging

    configure_logging(level=settings.log.level, fmt=settings.log.format)
    return settings


def _default(option: str) -> Any:
    """The default of a request option (`RequestOptions`), for its flag."""
    return RequestOptions.model_fields[option].default


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds < 90:
        return f"{seconds}s"
    if seconds < 5400:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def submit_dataset_cmd(
    input: Annotated[str, typer.Argument(help="JSONL or Parquet file: local path or s3:// URL.")],
    output: str = typer.Option(..., "--output", "-o", help="Directory or s3:// prefix."),
    queue: str = typer.Option(None, help="Queue (default: TEACHERQ_QUEUE__NAME)."),
    # One flag per request option (shared.messages.RequestOptions: defaults and meaning);
    # tests/unit/test_messages.py checks that every option has its flag here.
    top_k: int = typer.Option(_default("top_k"), help="Top-k per position, for rows without one."),
    sample_n: int = typer.Option(
        _default("sample_n"), help="Samples per position, for rows without sample_n."
    ),
    return_entropy: bool = typer.Option(
        _default("return_entropy"), "--return-entropy", help="Return entropies."
    ),
    temperature: float = typer.Option(
        _default("temperature"), help="Temperature, for rows without one."
    ),
    seed: int = typer.Option(_default("seed"), help="Sampling seed, for rows without one."),
    dataset_id: str = typer.Option(None, help="Dataset id (default: from input and options)."),
    max_pending_tokens: int = typer.Option(
        4_000_000, help="Backpressure: ingest waits while the queue holds more pending tokens."
    ),
    batch_rows: int = typer.Option(256, help="Rows submitted (and recorded) per batch."),
    shard_rows: int = typer.Option(10_000, help="Rows per exported Parquet shard."),
    keep_field: list[str] = typer.Option(
        None, "--keep-field", help="A field/column rows may carry besides the request's."
    ),
    wait: bool = typer.Option(False, "--wait", help="Block until the dataset is done."),
    timeout: float = typer.Option(None, help="With --wait: give up after this many seconds."),
) -> None:
    """Ingest a dataset file into the queue and export its results to OUTPUT as Parquet;
    prints the dataset id. Idempotent: running it again resumes an unfinished dataset."""
    from producer.client import TeacherClient
    from producer.datasets import DatasetError, submit_dataset

    settings = _settings(queue)
    client = TeacherClient(settings)
    try:
        flags = locals()  # the arguments so far: one flag per option, named as the option
        options = RequestOptions(**{name: flags[name] for name in OPTION_FIELDS})
        done = submit_dataset(
            client,
            input=input,
            output=output,
            options=options,
            dataset_id=dataset_id,
            max_pending_tokens=max_pending_tokens,
            batch_rows=batch_rows,
            shard_rows=shard_rows,
            keep_fields=tuple(keep_field or ()),
        )
    except (DatasetError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    typer.echo(done.dataset_id)
    err.print(f"{done.dataset_id}: {done.action} (queue {client.queue}, output {output})")
    if wait:
        raise typer.Exit(_wait_done(client, done.dataset_id, timeout))


def _wait_done(client: Any, dataset_id: str, timeout: float | None) -> int:
    from producer.datasets import load_record

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        rec = load_record(client.r, client.queue, dataset_id)
        if rec is not None and rec.state in ("done", "failed"):
            err.print(f"{dataset_id}: {rec.state}" + (f": {rec.error}" if rec.error else ""))
            return exitcodes.OK if rec.state == "done" else exitcodes.FAILED
        if deadline is not None and time.monotonic() > deadline:
            err.print(f"[red]{dataset_id}: still {rec.state if rec else '?'}[/red]")
            return exitcodes.NOT_DONE
        # A state change has no stream to block on; a CLI polling its one record is cheap.
        time.sleep(0.5)


def datasets_cmd(
    queue: str = typer.Option(None, help="Only this queue (default: every queue)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per dataset."),
) -> None:
    """List datasets with their progress (queued, done, failed) and an ETA."""
    from producer.datasets import list_datasets
    from shared.redis_client import connect

    settings = _settings()
    snaps = list_datasets(connect(settings.redis), [queue] if queue else None)
    if as_json or not sys.stdout.isatty():
        for snap in snaps:
            typer.echo(json.dumps(snap))
        return
    queues = sorted({s["queue"] for s in snaps})
    table = Table(title="teacherq datasets" + (f" (queue {queues[0]})" if len(queues) == 1 else ""))
    width = max([len(s["dataset_id"]) for s in snaps] + [7])
    table.add_column("dataset", no_wrap=True, min_width=width)
    if len(queues) > 1:
        table.add_column("queue")
    table.add_column("state")
    for col in ("queued/rows", "done", "failed", "rate", "eta"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in snaps:
        rate, eta = s["rate_rows_per_s"], s["eta_s"]
        table.add_row(
            s["dataset_id"],
            *([s["queue"]] if len(queues) > 1 else []),
            s["state"] + (f": {s['error'][:60]}" if s["error"] else ""),
            f"{s['rows_queued']}/{'?' if s['total_rows'] is None else s['total_rows']}",
            str(s["rows_done"]),
            str(s["rows_failed"] + s["rows_rejected"]),
            "" if rate is None else f"{rate:,.1f}/s",
            "" if eta is None else ("≥" if s["eta_is_lower_bound"] else "") + _age(eta),
        )
    out.print(table)


def worker_cmd(
    burst: bool = typer.Option(False, "--burst", help="Exit once the queues are empty."),
    name: str = typer.Option(None, help="Worker name (default: random)."),
) -> None:
    """Run an rq worker for the dataset queues (teacherq-ingest, teacherq-export)."""
    from producer.datasets import run_worker

    settings = _settings()
    run_worker(settings, burst=burst, name=name)


def dataset_replay_cmd(
    dataset_id: Annotated[str, typer.Argument(help="Dataset id.")],
    queue: str = typer.Option(None, help="Queue of the dataset (default: search every queue)."),
) -> None:
    """Requeue a dataset's failed rq jobs and re-submit its dead-lettered jobs."""
    from producer.datasets import DatasetError, replay_dataset

    settings = _settings()
    try:
        summary = replay_dataset(settings, dataset_id, queue=queue)
    except DatasetError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary))


def register(app: typer.Typer) -> None:
    """Add submit-dataset, datasets, worker and dataset-replay to the `teacherq` app."""
    app.command("submit-dataset")(submit_dataset_cmd)
    app.command("datasets")(datasets_cmd)
    app.command("worker")(worker_cmd)
    app.command("dataset-replay")(dataset_replay_cmd)
