"""The stream relay: a provider's stream events turned into the client's, in guards' own
Server-Sent Events or the AI SDK's UI message stream, up to a commit point and then as they
come. Imports the layers below it (`contracts`, `observe`, `waits`, `stores`, `policies`).
"""

__all__: list[str] = []
