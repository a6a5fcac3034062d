"""`python -m guards.serve` (or plain `python -m uvicorn`) in a process of its own, for the tests
of serving: started on a free port, its log (stdout and stderr) in a file, stopped by signal."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Runs `guards.serve`'s command line under an open file limit (argv[1]; 0: unchanged).
_LAUNCH = (
    "import resource, sys\n"
    "limit = int(sys.argv[1])\n"
    "if limit:\n"
    "    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
    "from guards.serve import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


#: The two serving stacks, as `guards.serve` options: every protection is tested on each. The
#: second is what "auto" serves where the extra [serve] installed uvloop and httptools.
STACKS = [
    pytest.param(("--loop", "asyncio", "--http", "h11"), id="asyncio-h11"),
    pytest.param(
        ("--loop", "uvloop", "--http", "httptools"),
        id="uvloop-httptools",
        marks=pytest.mark.skipif(
            not (importlib.util.find_spec("uvloop") and importlib.util.find_spec("httptools")),
            reason="uvloop or httptools is not installed (they do not build here)",
        ),
    ),
]


class ServedApp:
    """`with ServedApp(log, "module:app", "--workers", "2") as served:` serves on `served.url`
    (`uvicorn=True`: plain `python -m uvicorn`, one process, with the same arguments)."""

    def __init__(
        self,
        log: Path,
        app: str,
        *args: str,
        env: dict[str, str] | None = None,
        open_files: int = 0,
        uvicorn: bool = False,
    ) -> None:
        self.log_path = log
        self._started = (
            r"Uvicorn running on http://127\.0\.0\.1:(\d+)"
            if uvicorn
            else r"guards\.serve: http://127\.0\.0\.1:(\d+)"
        )
        launch = ["-m", "uvicorn"] if uvicorn else ["-c", _LAUNCH, str(open_files)]
        command = [sys.executable, *launch, app, "--port", "0", *args]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
            )
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def started_pids(self) -> list[int]:
        """The process id of every worker started so far, in order."""
        return [int(pid) for pid in re.findall(r"Started server process \[(\d+)\]", self.log)]

    def wait_started(self, workers: int, timeout_s: float = 30.0) -> None:
        """Until `workers` workers in all have completed their start-up (bounded poll)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log
            found = re.search(self._started, log)
            if found and log.count("Application startup complete.") >= workers:
                self.port = int(found.group(1))
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{log}")
            time.sleep(0.05)  # polling the log, bounded by the deadline
        raise RuntimeError(f"the server did not start {workers} worker(s) in {timeout_s} s:\n{self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Send `sig` to the supervisor; its exit status (it must exit within `timeout_s`)."""
        self.process.send_signal(sig)
        return self.process.wait(timeout_s)

    def __enter__(self) -> ServedApp:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
