"""The fault harness (issue 11): real agents behind fault-injecting proxies, process faults,
and a client that checks every member lists exactly what it was told (docs/reliability.md)."""
