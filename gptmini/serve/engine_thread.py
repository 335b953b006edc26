"""The server's engine thread: one background thread steps the engine while it has work
and tells the event loop after each step, so request handlers wait on an asyncio event
instead of polling."""

import asyncio
import contextlib
import threading

from gptmini.generate.engine import Engine, Request
from gptmini.generate.sampling import SamplingParams

__all__ = ["EngineLoop", "Ticker"]


class EngineLoop:
    """Steps the engine on one background thread while it has work, and tells the event
    loop after each step (`on_step`), so handlers wake when their tokens are there."""

    def __init__(self, engine: Engine):
        self.engine, self._wake, self._stop = engine, threading.Event(), False
        self.error: BaseException | None = None
        self.on_step = lambda: None
        self._thread = threading.Thread(target=self._run, name="gptmini-engine", daemon=True)
        self._thread.start()

    def add(self, prompt: list[int], params: SamplingParams) -> Request:
        request = self.engine.add_request(prompt, params)
        self.wake()
        return request

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except BaseException as err:  # keep serving: fail the requests in flight
                self.error = err
                self.engine.abort("error")
            self.on_step()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


class Ticker:
    """An asyncio event set at every engine step: handlers await the next one."""

    def __init__(self):
        self._event = asyncio.Event()

    def tick(self) -> None:  # on the event loop, through call_soon_threadsafe
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def next(self, seconds: float) -> None:
        """Return at the next step, or after `seconds` at most."""
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), seconds)
