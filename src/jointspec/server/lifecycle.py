"""Run the app under uvicorn with a shutdown that drains: :func:`serve`.

uvicorn's own SIGTERM handling stops accepting connections, waits for the open ones and then, past its graceful
timeout, cancels them: a stream still decoding is cut off without an answer. Here the first SIGTERM (or Ctrl-C)
runs the app's ``drain`` first, while the port stays open: new requests get 503, requests in flight get
``drain_timeout`` seconds to finish and an error envelope after that, and only then is uvicorn told to stop. A
second signal stops at once, as uvicorn's does.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI

from jointspec.server.app import ServerSettings

log = logging.getLogger(__name__)

# After the drain every request has its answer; uvicorn gets this long to close the connections that carried them.
CLOSE_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the app before the server stops."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn calls this from a signal handler (on the loop's thread); tests call it from theirs.
        if self._signalled or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal, or no loop yet: stop now
            return
        self._signalled = True
        log.warning("draining: finishing the requests in flight, refusing new ones")
        self._loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


def serve(app: FastAPI, settings: ServerSettings) -> None:
    """Serve ``app`` (from :func:`~jointspec.server.app.create_app`) until SIGTERM or Ctrl-C, then drain."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=CLOSE_SECONDS)
    DrainingServer(config, app.state.drain).run()
