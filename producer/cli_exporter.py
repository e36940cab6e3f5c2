"""`teacherq exporter`: queue-level Prometheus metrics (shared/queue_metrics.py) on
`/metrics`, for any number of queues, from one small process next to Redis.

`register(app)` adds the command to the `teacherq` Typer app (called from producer/cli.py).
"""

from __future__ import annotations

import signal
import threading
from typing import Annotated
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
import typer
from prometheus_client import CollectorRegistry, make_wsgi_app

from producer.cli_common import verb_settings
from shared.settings import Settings


def queue_registry(settings: Settings, r: redis.Redis, queues: list[str]) -> CollectorRegistry:
    """A registry holding only the queue collector: no process or platform series."""
    from shared.queue_metrics import QueueCollector

    c = settings.consumer
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        QueueCollector(
            r,
            queues,
            group=settings.queue.group,
            live_after_s=c.live_after_s,
        )
    )
    return registry


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No access log: a scrape every few seconds would drown the log."""


def exporter(
    port: Annotated[int, typer.Option("--port", help="Port to serve /metrics on.")] = 9108,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "0.0.0.0",
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", "-q", help="A queue to export (repeatable); default: queue.name."),
    ] = None,
) -> None:
    """Serve queue-level Prometheus metrics (teacherq_queue_lag, _in_flight, _pending_tokens,
    _dead_letters, _live_consumers, _oldest_pending_seconds) until SIGTERM or Ctrl-C. Run one
    per set of queues: each scrape reads Redis once per queue."""
    from shared.log import configure_logging, get_logger
    from shared.redis_client import connect

    settings = verb_settings()
    configure_logging(level=settings.log.level, fmt=settings.log.format)
    queues = queue or [settings.queue.name]
    registry = queue_registry(settings, connect(settings.redis), queues)
    server = make_server(host, port, make_wsgi_app(registry), handler_class=_Quiet)

    def _stop(*_: object) -> None:  # shutdown() waits for serve_forever: not on its thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    get_logger("teacherq.exporter").info(
        "exporter.serving", host=host, port=server.server_port, queues=queues
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def register(app: typer.Typer) -> None:
    """Add `exporter` to the teacherq CLI."""
    app.command("exporter")(exporter)
