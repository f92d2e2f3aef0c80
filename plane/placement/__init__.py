"""Placement across clusters: the pure decision, what it reads, apportioning replicas, scale and
pause."""
