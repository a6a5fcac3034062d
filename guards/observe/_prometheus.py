"""prometheus-client, imported on first use: guards' metrics as declared (`Metric`), made in
its default registry when first needed, and the files of its multiprocess mode.

prometheus-client itself is imported, and guards' metrics made in its default registry, when
first needed (`Metric.made`): by the first flush (`FLUSH_INTERVAL_S` after a process's first
request), `render_metrics()`, the status page, or a store failure counted at once. `import
guards` and building an app import none of it; until then a tally only counts, and a gauge
(`GaugeTally`) keeps its value and the time it was set, which the first flush writes.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["METRICS", "Metric", "multiprocess", "worker_files"]

#: Every metric declared (`guards.observe._families`), in order: `render_metrics()` makes them all.
METRICS: list[Metric] = []
_make_lock = threading.Lock()


class Metric:
    """One of guards' metrics: declared at import, made in prometheus-client's default
    registry (a `Counter`, `Gauge` or `Histogram` of the same name, help, labels and options)
    the first time it is needed (`made()`), so that importing guards does not import
    prometheus-client. Tallies (`counter`, `histogram`, `gauge`) take one of these or a
    prometheus-client metric of the kind."""

    __slots__ = ("_documentation", "_kind", "_labelnames", "_made", "_name", "_options")

    def __init__(
        self,
        kind: Literal["Counter", "Gauge", "Histogram"],
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        **options: Any,
    ) -> None:
        self._kind = kind
        #: As prometheus-client names it (a counter's without `_total`), and its label names.
        self._name = name
        self._labelnames = tuple(labelnames)
        self._documentation = documentation
        self._options = options
        self._made: Any = None
        METRICS.append(self)

    def made(self) -> Any:
        """The prometheus-client metric (imported, made and registered by the first call)."""
        made = self._made
        if made is None:
            with _make_lock:
                if self._made is None:
                    import prometheus_client

                    kind = getattr(prometheus_client, self._kind)
                    self._made = kind(self._name, self._documentation, self._labelnames, **self._options)
                made = self._made
        return made

    def labels(self, *values: object, **labels: object) -> Any:
        """The prometheus-client child of these label values, made now (prometheus-client is
        imported then if no flush did it yet): for rare events, a store failure counted at once;
        a request's counts go through tallies."""
        return self.made().labels(*values, **labels)

    def upper_bounds(self) -> tuple[float, ...]:
        """A histogram's bucket bounds as prometheus-client keeps them: +Inf last."""
        bounds = [float(bound) for bound in self._options["buckets"]]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        return tuple(bounds)


def multiprocess() -> bool:
    """True in prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


class _WorkerFiles:
    """prometheus-client's `MultiProcessCollector`, minus the files no worker has written yet.

    A worker creates its file, then sizes it: for a moment it is empty, and prometheus-client
    fails the whole merge on it (`struct.error`, every worker's metrics lost with it). A worker
    killed in that moment leaves the empty file for good, and every scrape and status page
    after it would fail (prometheus/client_python issue 1199). An empty file holds no count:
    it is left out."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        with os.scandir(self.directory) as entries:
            files = [entry.path for entry in entries if entry.name.endswith(".db") and _holds_counts(entry)]
        return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def _holds_counts(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file() and entry.stat().st_size > 0
    except OSError:  # removed meanwhile (`mark_process_dead`)
        return False


def worker_files() -> _WorkerFiles:
    """The collector of every worker's file in the multiprocess directory."""
    # The lower-case name is the deprecated one prometheus-client still reads.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ["prometheus_multiproc_dir"]  # noqa: SIM112
    return _WorkerFiles(directory)
