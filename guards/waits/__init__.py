"""Every wait a request makes, each with its bound: a walk's deadline (and the arrival it counts
from), a stream's alarm on its next piece, the admission queue in front of a provider's
connection pool, the first-output limit, and the throttle that paces a binding. Imports only
`guards.contracts`.
"""

__all__: list[str] = []
