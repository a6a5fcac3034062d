"""What guards promises its clients and asks of its providers: the closed vocabularies, the
public errors and the envelope, the classifier of provider signals, the binding and streaming
protocols, the output guard's checks (schema, tools, Unicode), the token estimate, and the checks
every setting goes through. The bottom layer: it imports nothing else of guards.
"""

__all__: list[str] = []
