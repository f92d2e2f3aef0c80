"""This node's side of the cluster: membership, heartbeat, probes, repair, operations, its facts."""
