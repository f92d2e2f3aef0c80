-- Index-only scans for the fleet summary's aggregates over devices and the job rollup.
CREATE INDEX devices_summary ON devices (cluster_id, device_class, health)
    INCLUDE (memory_total, memory_used);
CREATE INDEX job_rollup_model ON job_rollup (model) INCLUDE (jobs);
