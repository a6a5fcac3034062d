"""The request path: the route decorator, chains, retries and the retry budget, deadlines, the
breaker, budgets, admission, effort routing, hints, last good answers, tasks, service levels,
streaming, attribution, cooldowns and the classifier."""
