"""Prometheus metrics of the local API: counts and gauges only, never a prompt."""
