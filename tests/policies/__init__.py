"""What is decided per model and per key across requests (`guards.policies`): budgets (keys,
local fallback, soft limits, tokens, prices), cooldowns of a provider's wait, the retry budget,
routing hints, the last good answer and multi-step tasks."""
