"""Cluster identity: CA, node certificates, the trusted/ pin store, invites, TLS contexts.

Arrives with the cluster-identity issue.
"""
