"""The gateway process: one asyncio loop, one aiohttp server, one `AsyncTeacherClient`.

`Gateway` binds its socket in the constructor (a taken port fails before anything starts),
then `run()` serves every dialect's routes on it until stopped: no thread per request, a
listen backlog sized for bursts (`gateway.backlog`), bodies capped at `gateway.max_body_bytes`
(413), every scoring request under a deadline (`gateway.request_timeout_s`, or the request's
own `timeout_s`: 504 naming which), a client that disconnects cancels its jobs (aiohttp
cancels its handler), and SIGTERM stops accepting and lets requests in flight finish within
`gateway.shutdown_grace_s`. What the handlers share (jobs, answers, the consumers' state) is
`Core` (core.py); this module only adds the socket, the lifecycle and the list of routes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from aiohttp import web

from producer.gateway import generate, sglang, slime, trl, vllm
from producer.gateway.common import json_response
from producer.gateway.core import Core, Handler
from shared.errors import TeacherqError
from shared.log import get_logger
from shared.settings import Settings

log = get_logger("teacherq.gateway")

# Every module with a `routes(gw)`; a new dialect is one module and one entry here.
DIALECTS = (generate, slime, sglang, vllm, trl)


class ListenError(TeacherqError):
    """The gateway cannot listen on its address (a taken port, an unknown host)."""


class Gateway(Core):
    """The gateway's process: `Core` plus its socket, its routes and its lifecycle."""

    def __init__(self, settings: Settings, *, host: str, port: int) -> None:
        try:
            backlog = settings.gateway.backlog
            self.sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
        except OSError as exc:
            raise ListenError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(set --port / --host, or TEACHERQ_GATEWAY__PORT / TEACHERQ_GATEWAY__HOST)"
            ) from exc
        super().__init__(settings)
        self._stop: asyncio.Event | None = None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on (port 0 in settings: the one it got)."""
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def app(self) -> web.Application:
        """The aiohttp application with every dialect's routes."""
        app = web.Application(client_max_size=self.g.max_body_bytes, middlewares=[_json_not_found])
        for dialect in DIALECTS:
            app.add_routes(dialect.routes(self))
        return app

    async def run(self) -> None:
        """Serve until `stop()` (or SIGTERM/SIGINT under `serve`), then drain and close."""
        self._stop = asyncio.Event()
        await self.open()
        runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,  # a client that leaves cancels its handler
            shutdown_timeout=self.g.shutdown_grace_s,
            access_log=None,
        )
        await runner.setup()
        site = web.SockSite(
            runner, self.sock, backlog=self.g.backlog, shutdown_timeout=self.g.shutdown_grace_s
        )
        await site.start()
        host, port = self.address
        log.info("gateway.listening", host=host, port=port, queue=self.queue)
        try:
            await self._stop.wait()
        finally:
            log.info("gateway.draining", grace_s=self.g.shutdown_grace_s)
            await runner.cleanup()  # stops accepting, waits for handlers up to the grace
            await self.close()
            log.info("gateway.stopped")

    def stop(self) -> None:
        """Ask `run` to stop (from the loop's thread: a signal handler)."""
        if self._stop is not None:
            self._stop.set()


@web.middleware
async def _json_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes and methods answer JSON, as every other error does."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        return json_response(
            {"error": f"no route {request.method} {request.path}"}, status=exc.status
        )


def serve(gw: Gateway) -> None:
    """Run a gateway in the foreground until SIGINT or SIGTERM (entry of `teacherq serve`):
    the first signal stops accepting and drains, as `run` says."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _stopping, gw, sig)
        await gw.run()

    asyncio.run(main())


def _stopping(gw: Gateway, sig: int) -> None:
    log.info("gateway.stopping", signal=int(sig), pid=os.getpid())
    gw.stop()
