"""The request path itself (`guards.walk`): the walk along a fallback chain, context windows and
content filters, rejected answers moving on, refusals known without a store operation, and what
a request's calls cost."""
