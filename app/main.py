"""The example service as its environment configures it: `uvicorn app.main:app`,
`hypercorn app.main:app`, `granian --interface asgi app.main:app` or `python -m guards.serve
app.main:app`.

Importing this module builds the app: it reads the settings (`app.settings`), opens the store
and configures the log. Tests and tools that build the app with settings of their own import
`create_app` from `app.service`, which reads nothing when imported.
"""

from __future__ import annotations

from .service import create_app

__all__ = ["app"]

app = create_app()
