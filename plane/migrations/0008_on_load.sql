-- Workloads whose count follows their load in each cluster (issue 30, item 5): the plane
-- places their maxReplicas (quotas and capacity counted at max), and each cluster runs its
-- share between its part of minReplicas and that share, on load.
ALTER TABLE workloads
    ADD COLUMN on_load boolean NOT NULL DEFAULT false;
