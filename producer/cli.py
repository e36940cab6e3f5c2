"""The `teacherq` command line: a thin layer over TeacherClient and the services."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from producer import cli_datasets, cli_observe
from shared.settings import Settings, SettingsError, load_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
out = Console()
err = Console(stderr=True, soft_wrap=True)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"teacherq {version('teacherq')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("teacherq (not installed)")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    pass


def _settings() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def _setup_logging(settings: Settings) -> None:
    from shared.log import configure_logging

    configure_logging(level=settings.log.level, fmt=settings.log.format)


def _client(settings: Settings):
    from producer.client import TeacherClient
    from shared.spans import install_sink

    client = TeacherClient(settings)
    # The CLI's own spans (submit) go to Redis too, so `teacherq trace` shows the whole tree.
    install_sink(client.r, settings.queue.name, process="teacherq cli")
    return client


def _tty() -> bool:
    return sys.stdout.isatty()


@app.command()
def demo(jobs: int = typer.Option(40, help="Number of random jobs to submit.")) -> None:
    """Run the whole pipeline locally: embedded Redis, one consumer, a few dozen jobs."""
    from producer.demo import run_demo

    settings = _settings()
    _setup_logging(
        settings.model_copy(update={"log": settings.log.model_copy(update={"level": "warning"})})
    )
    report = run_demo(settings, jobs=jobs)
    table = Table(title="teacherq demo", show_header=False)
    table.add_row("jobs", f"{report.jobs} ({report.failed} failed)")
    table.add_row("tokens", str(report.tokens))
    table.add_row("tokens/s (end to end)", f"{report.tokens_per_s:,.0f}")
    table.add_row("model", report.model_version)
    table.add_row("redis", report.redis_url)
    table.add_row("results", f"Redis + {report.storage_url}")
    table.add_row("consumer log", report.consumer_log)
    table.add_row("try", f"teacherq results {report.sample_job} --json")
    out.print(table)
    if report.failed:
        raise typer.Exit(1)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="JSONL file, one TeacherRequest per line.")],
    wait: bool = typer.Option(False, "--wait", help="Wait for the results."),
    timeout: float = typer.Option(None, help="With --wait: give up after this many seconds."),
) -> None:
    """Enqueue requests from a JSONL file; prints one job id per line."""
    settings = _settings()
    _setup_logging(settings)
    requests = []
    with file.open() as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                requests.append(json.loads(line))
            except json.JSONDecodeError as exc:
                err.print(f"[red]{file}:{n}: not valid JSON: {exc}[/red]")
                raise typer.Exit(2) from None
    from shared.errors import InvalidJob

    client = _client(settings)
    try:
        ids = client.submit(requests)
    except InvalidJob as exc:
        err.print(f"[red]invalid request: {exc}[/red]")
        raise typer.Exit(2) from None
    for job_id in ids:
        typer.echo(job_id)
    if wait:
        results = client.wait(ids, timeout=timeout)
        failed = [r for r in results if not r.ok]
        err.print(f"{len(results) - len(failed)} done, {len(failed)} failed")
        if failed:
            raise typer.Exit(1)


@app.command()
def results(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.")],
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    wait: bool = typer.Option(False, "--wait", help="Block until the jobs finish."),
    timeout: float = typer.Option(None, help="With --wait: give up after this many seconds."),
) -> None:
    """Print the results of jobs (not-finished jobs are reported as pending)."""
    settings = _settings()
    _setup_logging(settings)
    client = _client(settings)
    found = client.wait(job_ids, timeout=timeout) if wait else client.results(job_ids)
    missing = 0
    for job_id, res in zip(job_ids, found, strict=True):
        if res is None:
            missing += 1
            if as_json or not _tty():
                typer.echo(json.dumps({"job_id": job_id, "status": "pending"}))
            else:
                out.print(f"[yellow]{job_id}: pending[/yellow]")
            continue
        if as_json or not _tty():
            typer.echo(json.dumps(res.to_json()))
            continue
        table = Table(title=f"{job_id} ({'ok' if res.ok else 'FAILED'})", show_header=False)
        table.add_row("model", res.model_version)
        if res.error:
            table.add_row("error", res.error)
        for name, arr in res.arrays().items():
            preview = ", ".join(f"{x:.4g}" for x in arr.reshape(-1)[:6])
            table.add_row(
                name, f"{list(arr.shape)} {arr.dtype}: [{preview}{', ...' if arr.size > 6 else ''}]"
            )
        out.print(table)
    if missing:
        raise typer.Exit(3)


@app.command()
def cancel(job_ids: Annotated[list[str], typer.Argument(help="Job ids to cancel.")]) -> None:
    """Cancel jobs: not computed if not started; a result they already have is dropped."""
    settings = _settings()
    client = _client(settings)
    for job_id in job_ids:
        client.cancel(job_id)
        typer.echo(f"cancelled {job_id}")


@app.command()
def replay(
    job_ids: list[str] = typer.Option(None, "--job-id", help="Replay only these job ids."),
    queue: str = typer.Option(None, "--queue", help="Queue (default: TEACHERQ_QUEUE__NAME)."),
    reason: str = typer.Option(None, help="Only dead letters whose reason contains this."),
    since: str = typer.Option(None, help="Only dead letters since: 30m, 2h, 1d, ISO time."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show what would happen; change nothing."
    ),
    force: bool = typer.Option(False, help="Replay even succeeded or often-replayed jobs."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """Move dead-lettered jobs back onto the jobs stream (dry-run first)."""
    from producer.replay import parse_since
    from producer.replay import replay as do_replay

    settings = _settings()
    if queue:
        settings = settings.model_copy(
            update={"queue": settings.queue.model_copy(update={"name": queue})}
        )
    try:
        since_ts = parse_since(since) if since else None
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    decisions = do_replay(
        _client(settings), job_ids=job_ids or None, reason=reason, since=since_ts,
        dry_run=dry_run, force=force,
    )  # fmt: skip
    if as_json or not _tty():
        for d in decisions:
            typer.echo(json.dumps(d.to_json()))
        return
    table = Table(title=f"replay{' (dry run)' if dry_run else ''}: {len(decisions)} dead letters")
    for col in ("job id", "dead-lettered because", "action"):
        table.add_column(col)
    for d in decisions:
        table.add_row(d.job_id, d.reason, d.action)
    out.print(table)


@app.command("update-weights")
def update_weights(
    path: Annotated[str, typer.Argument(help="Checkpoint directory every replica can read.")],
    wait: bool = typer.Option(True, help="Wait until every live replica serves it."),
    timeout: float = typer.Option(1800.0, help="With --wait: give up after this many seconds."),
) -> None:
    """Make every consumer of the queue drain in-flight work and reload from PATH."""
    from shared.weights import UpdateInProgress

    settings = _settings()
    try:
        req = _client(settings).update_weights(path, wait=wait, timeout=timeout)
    except UpdateInProgress as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None
    how = "joined the running update" if req.coalesced else "started"
    state = "served by every live replica" if wait else "requested"
    typer.echo(f"generation {req.generation}: {how}, {state} (request {req.request_id})")


@app.command()
def serve(
    host: str = typer.Option(None, help="Listen address (default: gateway.host)."),
    port: int = typer.Option(None, help="Port (default: gateway.port, 7999)."),
    temperature: float = typer.Option(None, help="Default temperature of /generate."),
) -> None:
    """HTTP gateway in the API of slime's Megatron teacher server (docs/gateway.md)."""
    from pydantic import ValidationError

    from producer.gateway import serve as run_gateway
    from shared.settings import GatewaySettings

    settings = _settings()
    given = {"host": host, "port": port, "temperature": temperature}
    try:
        gateway = GatewaySettings.model_validate(
            {**settings.gateway.model_dump(), **{k: v for k, v in given.items() if v is not None}}
        )
    except ValidationError as exc:
        err.print(f"[red]invalid option: {exc.errors()[0]['msg']}[/red]")
        raise typer.Exit(2) from None
    settings = settings.model_copy(update={"gateway": gateway})
    _setup_logging(settings)
    try:
        run_gateway(settings)
    except OSError as exc:  # the listening socket (taken port, unknown address)
        err.print(
            f"cannot listen on {gateway.host}:{gateway.port}: {exc.strerror or exc} "
            "(set --host/--port or TEACHERQ_GATEWAY__HOST/__PORT)",
            style="red",
            markup=False,
        )
        raise typer.Exit(2) from None


@app.command()
def consumer() -> None:
    """Run a consumer in this process (same as `python -m consumer`)."""
    try:
        import consumer.service  # noqa: F401 - loads torch and megatron, which main() needs
        from consumer.__main__ import main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("torch", "megatron"):
            raise
        # markup off: rich would read [consumer] as a style tag
        err.print(
            "the consumer needs torch and megatron-core: pip install 'teacherq[consumer]'",
            style="red",
            markup=False,
        )
        raise typer.Exit(2) from None

    raise typer.Exit(main())


@app.command("redis")
def redis_cmd(
    action: Annotated[str, typer.Argument(help="start | stop | url")] = "start",
) -> None:
    """Manage the embedded valkey-server under ./.teacherq/ (start prints its URL)."""
    from shared.redis_server import ensure_embedded, stop_embedded

    settings = _settings()
    home = Path(settings.redis.home)
    if action in ("start", "url"):
        url, started = ensure_embedded(home)
        typer.echo(url)
        if started:
            err.print(f"started embedded valkey-server in {home.resolve()} (AOF on)")
    elif action == "stop":
        typer.echo("stopped" if stop_embedded(home) else "not running")
    else:
        err.print(f"[red]unknown action {action!r}; expected start, stop or url[/red]")
        raise typer.Exit(2)


from producer.cli_observe import register as _register_observe  # noqa: E402 - after app exists

_register_observe(app)


cli_datasets.register(app)
cli_observe.register(app)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
