"""Streaming routes (`guards.streams`): the relay (fallback before the first output, never
after; cuts, stalls, resume) and a stream's time, idle and size limits."""
