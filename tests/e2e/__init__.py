"""Tests that need real server processes or sockets: serving (python -m guards.serve, uvicorn,
hypercorn, granian), slow clients, body limits over a socket, state shared across processes,
overload, the SDK under Node, the OpenAPI conformance run; with the helpers those processes load
(served.py, serve_probe.py, serve_spend.py)."""
