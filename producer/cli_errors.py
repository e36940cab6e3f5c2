"""How every `teacherq` verb fails: one table of exit codes (`shared.exitcodes`) and one- or
two-line messages that name what to fix; the full traceback only with `--debug`.

Verbs raise; `run_app` (called by `producer.cli.main`) turns each failure into its message
and exit code, so every verb answers the same failure the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import redis
from rich.console import Console

from shared import exitcodes
from shared.errors import (
    InvalidCheckpoint,
    InvalidJob,
    JobFailed,
    QueueFull,
    TeacherqError,
    UnknownJob,
    WeightUpdateFailed,
)
from shared.settings import SettingsError

err = Console(stderr=True, soft_wrap=True, highlight=False)


def _redis_unreachable(exc: BaseException) -> str:
    import os

    url = os.environ.get("TEACHERQ_REDIS__URL")
    where = (
        f"TEACHERQ_REDIS__URL={url}" if url else "the embedded server (TEACHERQ_REDIS__URL unset)"
    )
    return (
        f"cannot reach Redis at {where}: {exc}\n"
        "  fix: start that server, or set TEACHERQ_REDIS__URL to one that runs "
        "(`teacherq redis url` shows the embedded one)"
    )


def classify(exc: BaseException) -> tuple[int, str]:
    """The exit code and message for a failure that reached the command line."""
    from shared.weights import UpdateInProgress

    if isinstance(exc, SettingsError):
        return exitcodes.CONFIG, str(exc)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return exitcodes.UNAVAILABLE, _redis_unreachable(exc)
    if isinstance(exc, redis.ResponseError):
        return exitcodes.UNAVAILABLE, f"Redis refused a command: {exc}"
    if isinstance(exc, JobFailed | WeightUpdateFailed):
        return exitcodes.FAILED, str(exc)
    if isinstance(exc, UpdateInProgress | QueueFull):
        return exitcodes.BUSY, str(exc)
    if isinstance(exc, InvalidJob | InvalidCheckpoint | UnknownJob):
        return exitcodes.USAGE, str(exc)
    if isinstance(exc, TimeoutError):
        return exitcodes.NOT_DONE, f"timed out: {exc}"
    if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
        return exitcodes.USAGE, f"{exc.strerror}: {exc.filename}"
    if isinstance(exc, TeacherqError):
        return exitcodes.FAILED, str(exc)
    return exitcodes.INTERNAL, (
        f"internal error: {type(exc).__name__}: {exc}\n"
        "  run again with --debug for the traceback, and report it"
    )


def run_app(app: Callable[..., object], argv: list[str]) -> int:
    """Run the typer app on argv (without the program name); returns the exit code."""
    debug = "--debug" in argv
    args = [a for a in argv if a != "--debug"]
    try:
        # Standalone mode: click itself reports usage errors (exit 2) and --help; everything
        # else a verb raises comes here.
        app(args=args, standalone_mode=True, prog_name="teacherq")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        err.print("interrupted")
        return exitcodes.INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one boundary where every failure is a message
        code, message = classify(exc)
        if debug:
            err.print_exception()
        lines = message.splitlines()
        err.print(f"[red]error:[/red] {lines[0]}", markup=True)
        for line in lines[1:]:
            err.print(line, markup=False)
        return code
    return exitcodes.OK
