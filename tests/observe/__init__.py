"""What operators read (`guards.observe`): logs, Prometheus metrics and alert rules, and the
privacy of both."""
