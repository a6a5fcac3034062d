"""The supervisor of `python -m guards.serve`: the parent process, which starts the workers and
watches them. SIGINT or SIGTERM stops them gracefully (a second signal forces them, a third
kills what is left), a worker that dies is replaced, and a worker that fails while starting
stops the server (exit status 3). It imports neither FastAPI nor the engine: the workers do."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from ._worker import STREAMS_STOP_S, Options, run_worker

__all__ = ["STARTUP_FAILURE", "Supervisor"]

logger = logging.getLogger("uvicorn.error")

#: The exit status of a server whose worker failed to start.
STARTUP_FAILURE = 3


@dataclasses.dataclass
class _Slot:
    process: BaseProcess
    ready: Connection | None  # None once the worker said it is ready (or closed the pipe)
    started: bool = False


class Supervisor:
    """Runs `workers` worker processes serving as `options` say, until a signal stops them."""

    def __init__(self, options: Options, workers: int) -> None:
        self.options = options
        self.workers = workers
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[_Slot] = []
        self.signals = 0

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM (handled while it runs); the exit status."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
        old_wakeup = signal.set_wakeup_fd(wake_w)  # a signal's number is written there
        try:
            logger.info(
                "guards.serve: http://%s:%d, %d worker(s), %s + %s, limit_concurrency %d, "
                "timeout_header %g s, timeout_body %g s + 1 s per %d bytes (Press CTRL+C to quit)",
                self.options.host,
                self.options.port,
                self.workers,
                self.options.loop,
                self.options.http,
                self.options.limit_concurrency,
                self.options.timeout_header_s,
                self.options.timeout_body_s,
                self.options.min_body_rate,
            )
            self.slots = [self._start() for _ in range(self.workers)]
            status = self._supervise(wake_r)
            return self._stop(wake_r, status)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)

    def _start(self) -> _Slot:
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(target=run_worker, args=(self.options, writer), name="guards-worker")
        process.start()
        writer.close()  # the worker holds the only writer: its exit closes the pipe
        return _Slot(process, reader)

    def _supervise(self, wake_r: int) -> int | None:
        """Until a signal (None) or a worker that fails to start (its exit status)."""
        while True:
            events = wait([wake_r, *self._watched()])
            if wake_r in events:
                self.signals += len(os.read(wake_r, 64))
                return None
            for index, slot in enumerate(self.slots):
                if slot.ready is not None and slot.ready in events:
                    slot.started = _said_ready(slot.ready)
                    slot.ready.close()
                    slot.ready = None
                if slot.process.sentinel in events and slot.ready is None:
                    slot.process.join()
                    code = slot.process.exitcode
                    if not slot.started:
                        logger.error("Worker [%d] failed to start (exit status %s).", slot.process.pid, code)
                        return STARTUP_FAILURE
                    logger.warning(
                        "Worker [%d] died (exit status %s): starting another.", slot.process.pid, code
                    )
                    self.slots[index] = self._start()

    def _watched(self) -> list[Connection | int]:
        # A worker's death is handled once its ready pipe is read (it closes with the worker).
        return [slot.ready if slot.ready is not None else slot.process.sentinel for slot in self.slots]

    def _stop(self, wake_r: int, status: int | None) -> int:
        """Stop every worker gracefully (SIGTERM), forcing them (SIGINT) on a second signal and
        killing what is left after the graceful timeout."""
        self._signal_workers(signal.SIGTERM)  # first: nothing may delay it, not even a log line
        logger.info("Stopping %d worker(s).", len(self.slots))
        deadline = time.monotonic() + self.options.timeout_graceful_shutdown_s + STREAMS_STOP_S + 5
        give_up = False
        while (alive := [s.process.sentinel for s in self.slots if s.process.is_alive()]) and not give_up:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            events = wait([wake_r, *alive], timeout=remaining)
            if wake_r in events:
                self.signals += len(os.read(wake_r, 64))
                self._signal_workers(signal.SIGINT)
                give_up = self.signals > 2  # a third signal: kill what is left now
        killed = False
        for slot in self.slots:
            if slot.process.is_alive():
                logger.error("Worker [%d] did not stop in time: killed.", slot.process.pid)
                slot.process.kill()
                killed = True
            slot.process.join()
            if slot.ready is not None:
                slot.ready.close()
        if status is not None:
            return status
        return 1 if killed else 0

    def _signal_workers(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.process.is_alive() and slot.process.pid is not None:
                os.kill(slot.process.pid, sig)


def _said_ready(ready: Connection) -> bool:
    try:
        return ready.recv_bytes() == b"ready"
    except (EOFError, OSError):
        return False  # the worker exited before it was ready
