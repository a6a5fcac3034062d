"""What a guarded route is once declared, as the request path reads it: the decoration-time
checks of its settings, the spec built from them (`GuardedRoute` and its `Leg`s), what the
app's requests share (`Shared`), and the two app-wide services a request consults on its way:
service levels and tracing. Imports the layers below it, never `guards.walk` or above.
"""

__all__: list[str] = []
