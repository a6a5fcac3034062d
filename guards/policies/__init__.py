"""What is decided per model and per key, across requests: budgets (and their local fallback),
cooldowns, the retry budget, the call guard's bounded retry, fallback chains, task settings, the
last good answer and the rejected-credentials warning. Each is enforced through a store. Imports
`guards.contracts`, `guards.observe`, `guards.waits` and `guards.stores`.
"""

__all__: list[str] = []
