"""Waiting with a bound (`guards.waits`): the walk's deadline from the request's arrival, first
output and stream idle limits, and admission to a provider's connection pool."""
