"""The broker: supervises the workload manager, keeps node records and the Jobs store.

Arrives with the node-agent issue; the package exists so the dependency direction
(agent -> broker -> workload_manager -> certs) is fixed from the start.
"""
