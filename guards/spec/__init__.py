"""What a guarded route is once declared, as the request path reads it: every decoration-time
check of its declaration (`_route_checks`, one module), the spec built from what passed
(`GuardedRoute` and its `Leg`s), what the app's requests share (`Shared`), and the two app-wide
services a request consults on its way: service levels and tracing. Imports the layers below
it, never `guards.walk` or above.
"""

__all__: list[str] = []
