"""The `teacherq` command line: a thin layer over TeacherClient and the services."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from producer import cli_datasets, cli_exporter, cli_observe
from producer.cli_common import verb_settings
from shared import exitcodes
from shared.settings import Settings

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help=__doc__ + "\n\nExit codes (every verb): " + exitcodes.SUMMARY,
    pretty_exceptions_enable=False,
)
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


def _setup_logging(settings: Settings) -> None:
    """Logging of a one-shot verb: stderr, at `log.level` when it is set (environment or
    config file), else warning: a verb's output is its answer, not one log line per job."""
    from shared.log import configure_logging

    level = settings.log.level if "level" in settings.log.model_fields_set else "warning"
    configure_logging(level=level, fmt=settings.log.format)


def _client(settings: Settings):
    from producer.client import TeacherClient

    # The CLI's own spans (submit) go to Redis too, so `teacherq trace` shows the whole tree.
    return TeacherClient(settings, trace_process="teacherq cli")


def _tty() -> bool:
    return sys.stdout.isatty()


@app.command()
def demo(jobs: int = typer.Option(40, help="Number of random jobs to submit.")) -> None:
    """Run the whole pipeline locally: embedded Redis, one consumer, a few dozen jobs."""
    from producer.demo import run_demo

    settings = verb_settings()
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
    file: Annotated[
        str, typer.Argument(help="JSONL file, one TeacherRequest per line; - for stdin.")
    ],
    wait: bool = typer.Option(False, "--wait", help="Wait for the results."),
    timeout: float = typer.Option(None, help="With --wait: give up after this many seconds."),
) -> None:
    """Enqueue requests from a JSONL file; prints one job id per line."""
    from shared.errors import InvalidJob
    from shared.messages import check_limits, parse_request

    settings = verb_settings()
    _setup_logging(settings)
    name = "<stdin>" if file == "-" else file
    client = _client(settings)
    limits = client.limits()
    requests = []
    with contextlib.ExitStack() as stack:
        fh = sys.stdin if file == "-" else stack.enter_context(open(file, encoding="utf-8"))
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                req = parse_request(json.loads(line))
                check_limits(req, limits)
            except json.JSONDecodeError as exc:
                raise InvalidJob(
                    f"{name}:{n}: not valid JSON: {exc.msg} (column {exc.colno})"
                ) from None
            except InvalidJob as exc:
                raise InvalidJob(f"{name}:{n}: {exc}") from None
            requests.append(req)
    ids = client.submit(requests)
    for job_id in ids:
        typer.echo(job_id)
    if wait:
        results = client.wait(ids, timeout=timeout, progress=sys.stderr.isatty())
        failed = [r for r in results if not r.ok]
        err.print(f"{len(results) - len(failed)} done, {len(failed)} failed")
        if failed:
            raise typer.Exit(exitcodes.FAILED)


@app.command()
def results(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.")],
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    wait: bool = typer.Option(False, "--wait", help="Block until the jobs finish."),
    timeout: float = typer.Option(None, help="With --wait: give up after this many seconds."),
) -> None:
    """Print the results of jobs (not-finished jobs are reported as pending). Exit 1 if a job
    failed, 3 if one is still pending, 2 for an unknown job id."""
    settings = verb_settings()
    _setup_logging(settings)
    client = _client(settings)
    found: list = (
        client.wait(job_ids, timeout=timeout, progress=sys.stderr.isatty())
        if wait
        else client.results(job_ids)
    )
    missing = failed = 0
    for job_id, res in zip(job_ids, found, strict=True):
        if res is None:
            missing += 1
            if as_json or not _tty():
                typer.echo(json.dumps({"job_id": job_id, "status": "pending"}))
            else:
                out.print(f"[yellow]{job_id}: pending[/yellow]")
            continue
        failed += not res.ok
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
    if failed:
        err.print(f"{failed} of {len(job_ids)} jobs failed")
        raise typer.Exit(exitcodes.FAILED)
    if missing:
        raise typer.Exit(exitcodes.NOT_DONE)


@app.command()
def cancel(job_ids: Annotated[list[str], typer.Argument(help="Job ids to cancel.")]) -> None:
    """Cancel jobs: not computed if not started; a result they already have is dropped. An
    unknown job id is an error (exit 2) and cancels nothing."""
    settings = verb_settings()
    _setup_logging(settings)
    client = _client(settings)
    client.check_known(job_ids)  # raises UnknownJob before anything is cancelled
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
    from producer.cli_common import parse_since
    from producer.dead_letter_replay import replay as do_replay

    settings = verb_settings(queue)
    try:
        since_ts = parse_since(since) if since else None
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    decisions = do_replay(
        _client(settings),
        job_ids=job_ids or None,
        reason=reason,
        since=since_ts,
        dry_run=dry_run,
        force=force,
    )
    if as_json or not _tty():
        for d in decisions:
            typer.echo(json.dumps(d.to_json()))
        return
    table = Table(
        title=f"replay{' (dry run)' if dry_run else ''}: {len(decisions)} dead-lettered jobs"
    )
    for col in ("job id", "dead-lettered because", "action"):
        table.add_column(col)
    for d in decisions:
        table.add_row(d.job_id, d.reason, d.action)
    out.print(table)


@app.command("update-weights")
def update_weights(
    path: Annotated[
        str | None, typer.Argument(help="Checkpoint directory every replica can read.")
    ] = None,
    reset: bool = typer.Option(
        False, "--reset", help="Return every consumer to its configured model instead."
    ),
    check: bool = typer.Option(
        True, help="Check PATH here first (--no-check: a path only the consumers can see)."
    ),
    wait: bool = typer.Option(True, help="Wait until every live replica serves it."),
    timeout: float = typer.Option(1800.0, help="With --wait: give up after this many seconds."),
) -> None:
    """Make every consumer of the queue drain in-flight work and reload from PATH.

    PATH is checked first (exists, config.json parses, a served family); a consumer that cannot
    load it keeps its weights and the update fails (exit 1, reason and consumer named)."""
    if reset == (path is not None):
        raise typer.BadParameter("give a checkpoint PATH or --reset (not both)")
    settings = verb_settings()
    _setup_logging(settings)
    if path is not None and check:
        from shared.checkpoint_probe import probe_checkpoint

        probe_checkpoint(path)  # before connecting: a typo starts nothing
    client = _client(settings)
    if reset:
        req = client.reset_weights(wait=wait, timeout=timeout)
    else:
        assert path is not None
        req = client.update_weights(path, wait=wait, timeout=timeout, check=False)  # done above
    target = "configured models" if reset else path
    how = "joined the running update" if req.coalesced else "started"
    if req.no_consumer:
        state = "no live consumer: the next one to start loads it"
    else:
        state = "served by every live consumer" if wait else "requested"
    typer.echo(f"generation {req.generation} ({target}): {how}, {state} (request {req.request_id})")


@app.command()
def serve(
    host: str = typer.Option(None, help="Listen address (default: gateway.host)."),
    port: int = typer.Option(None, help="Port (default: gateway.port, 7999)."),
    temperature: float = typer.Option(
        None, help="Temperature of slime's /generate (its --rollout-temperature)."
    ),
) -> None:
    """HTTP gateway in the dialects trainers call: slime's teacher server, SGLang, vLLM, TRL
    (docs/gateway.md)."""
    from pydantic import ValidationError

    from producer.gateway import Gateway, ListenError
    from producer.gateway import serve as run_gateway
    from shared.log import configure_logging
    from shared.settings import GatewaySettings

    settings = verb_settings()
    given = {"host": host, "port": port, "temperature": temperature}
    try:
        gateway = GatewaySettings.model_validate(
            {**settings.gateway.model_dump(), **{k: v for k, v in given.items() if v is not None}}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        err.print(f"invalid --{first['loc'][0]}: {first['msg']}", style="red", markup=False)
        raise typer.Exit(exitcodes.USAGE) from None
    settings = settings.model_copy(update={"gateway": gateway})
    # A service: it logs at log.level (info unless set), like the consumer.
    configure_logging(level=settings.log.level, fmt=settings.log.format)
    try:
        gw = Gateway(settings, host=gateway.host, port=gateway.port)  # binds first
    except ListenError as exc:
        err.print(str(exc), style="red", markup=False)
        raise typer.Exit(exitcodes.USAGE) from None
    run_gateway(gw)


@app.command()
def consumer() -> None:
    """Run a consumer in this process (same as `python -m consumer`)."""
    try:
        import consumer.serve.service  # noqa: F401 - loads torch and megatron, which main() needs
        from consumer.__main__ import leave, main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("torch", "megatron"):
            raise
        # markup off: rich would read [consumer] as a style tag
        err.print(
            "the consumer needs torch and megatron-core: pip install 'teacherq[consumer]'",
            style="red",
            markup=False,
        )
        raise typer.Exit(exitcodes.USAGE) from None

    leave(main())


@app.command("redis")
def redis_cmd(
    action: Annotated[str, typer.Argument(help="start | stop | url")] = "start",
) -> None:
    """Manage the embedded valkey-server (one per project or per user; see
    TEACHERQ_REDIS__HOME). `start` starts it if needed and prints its URL; `url` prints the
    running server's URL without starting anything (exit 69 when none runs); `stop` stops it."""
    from shared.redis_server import ensure_embedded, running_url, stop_embedded

    settings = verb_settings()
    home = Path(settings.redis.home)
    if settings.redis.url:
        err.print(
            f"note: TEACHERQ_REDIS__URL={settings.redis.url} is set; commands use it, "
            "not the embedded server"
        )
    if action == "url":
        url = running_url(home)
        if url is None:
            err.print(f"no embedded server runs in {home} (`teacherq redis start` starts one)")
            raise typer.Exit(exitcodes.UNAVAILABLE)
        typer.echo(url)
    elif action == "start":
        url, started = ensure_embedded(home)
        typer.echo(url)
        err.print(
            f"{'started' if started else 'already running:'} embedded valkey-server "
            f"in {home} (AOF on)"
        )
    elif action == "stop":
        typer.echo("stopped" if stop_embedded(home) else "not running")
    else:
        raise typer.BadParameter(f"unknown action {action!r}; expected start, stop or url")


cli_datasets.register(app)
cli_observe.register(app)
cli_exporter.register(app)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """teacherq: an offline teacher pipeline (Redis streams -> Megatron-core consumers)."""
    # --debug is read by producer.cli_errors.run_app before the verb runs; declared here for
    # the help text.


def main() -> None:
    """Console-script entry point: errors become one- or two-line messages and the exit
    codes of `shared.exitcodes` (producer.cli_errors)."""
    from producer.cli_errors import run_app

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_app(app, sys.argv[1:]))


if __name__ == "__main__":
    main()
