"""What a route is once declared and the app-wide services a request consults (`guards.spec`):
service levels and shedding, and OpenTelemetry traces."""
