"""The public test kit (`guards.testing`): the pytest plugin, the fakes as strict as the
providers (each wire, in process and over HTTP, and as OpenAI's SDK sees them)."""
