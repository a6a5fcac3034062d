"""Serving a guarded app in production under `python -m guards.serve`: the supervisor that
starts and watches the workers (`_supervisor`: it imports neither FastAPI nor the engine), each
worker's uvicorn server (`_worker`), the connection guards (slow clients, trickled bodies, idle
keep-alives) for h11 and httptools, and uvicorn's log lines escaped and written behind guards'
writer (`_logs`). Imports `guards.contracts`, `guards.observe` and `guards.streams`.
"""

__all__: list[str] = []
