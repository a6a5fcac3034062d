"""What operators read: logs, Prometheus metrics and alert rules, traces, and the privacy of all
of them."""
