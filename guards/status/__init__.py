"""The status page, `GET /status` (`Guards.status_router()`): the route, its content
negotiation and operator token in `_router.py`, what it shows and where each number comes from
(`StatusReport`) in `_report.py` (the counts over time in `_history.py`), and its HTML in
`_html.py`. Typed against `Shared`, what an app's requests share, never against `Guards`."""

from ._report import StatusReport
from ._router import bearer_token, status_router

__all__ = ["StatusReport", "bearer_token", "status_router"]
