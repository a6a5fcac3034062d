"""The status page, its HTML in a browser, and the Grafana dashboard."""
