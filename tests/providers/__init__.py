"""The provider adapters (Workers AI, OpenAI-compatible) against the fake providers: HTTP
bindings, streams and SSE parsing (a stream of tiny events yields the loop), compressed answers."""
