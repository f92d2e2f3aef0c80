"""GPU-aware ranking of nodes for a request: pure functions over node snapshots.

Arrives with the facade and scheduler issue.
"""
