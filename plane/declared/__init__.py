"""The binding side's declared objects: tenants, keys, projects, quotas, policies, pools, workloads
-- checked and stored."""
