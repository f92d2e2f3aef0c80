"""The engines this node runs and calls: templates, processes, readiness, replicas, load, GPUs."""
