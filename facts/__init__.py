"""The cluster's signed facts and who is a member, pure where it can be: node records, their
signatures and deltas, membership and probing decisions, declared deployments, API keys, and
the one signed, versioned set with tombstones under them."""
