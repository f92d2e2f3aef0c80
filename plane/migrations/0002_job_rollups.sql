-- Rollups the fleet summary reads instead of scanning every job: counts by state and model,
-- and histograms of queue and run times (log buckets ~10 % wide) per hour of creation.
-- Kept exact by the sync merge, which applies each job's change to them in the same
-- statement (docs/plane.md).

CREATE TABLE job_rollup (
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    state text NOT NULL,
    model text NOT NULL,
    jobs bigint NOT NULL,
    PRIMARY KEY (cluster_id, state, model)
);

CREATE TABLE job_timing (
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    hour bigint NOT NULL,  -- created_at / 3,600,000
    kind "char" NOT NULL CHECK (kind IN ('q', 'r')),  -- queue time or run time
    bucket integer NOT NULL,  -- floor(ln(1 + ms) / ln(1.1))
    jobs bigint NOT NULL,
    PRIMARY KEY (cluster_id, hour, kind, bucket)
);

INSERT INTO job_rollup (cluster_id, state, model, jobs)
SELECT cluster_id, state, model, count(*) FROM jobs GROUP BY 1, 2, 3;

INSERT INTO job_timing (cluster_id, hour, kind, bucket, jobs)
SELECT cluster_id, created_at / 3600000, 'q',
       floor(ln(1 + greatest(started_at - created_at, 0)) / ln(1.1))::int, count(*)
FROM jobs WHERE started_at IS NOT NULL GROUP BY 1, 2, 3, 4;

INSERT INTO job_timing (cluster_id, hour, kind, bucket, jobs)
SELECT cluster_id, created_at / 3600000, 'r',
       floor(ln(1 + greatest(completed_at - started_at, 0)) / ln(1.1))::int, count(*)
FROM jobs WHERE started_at IS NOT NULL AND completed_at IS NOT NULL GROUP BY 1, 2, 3, 4;
