"""The example service of app/: its routes (draft reply, summary, the UI message stream, chains,
CORS, invalid requests)."""
