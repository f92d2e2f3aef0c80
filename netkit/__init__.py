"""The plumbing every nvpair process shares: binding a bounded site (caps, timeouts, handshake
rations), the per-request pin check and the pinned connector, kept connections, owned tasks
that report their death, retry backoff, and whether a process runs."""
