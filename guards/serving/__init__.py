"""Serving a guarded app in production: the connection guards under `python -m guards.serve`
(slow clients, trickled bodies, idle keep-alives) for h11 and httptools. Imports
`guards.contracts`, `guards.observe` and `guards.streams`.
"""

__all__: list[str] = []
