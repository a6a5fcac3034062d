"""The provider adapters (Workers AI, OpenAI-compatible) against the fake providers: HTTP
bindings, streams and SSE parsing, compressed answers, and the fakes themselves."""
