-- Each job's token usage and times, sent by its originating node with the job's final
-- record (`SyncBatch.usage`), and a rollup of tokens per model and key (the job's
-- requesterId; '' without keys) that the fleet summary reads. Counts only, never text.
-- A job's usage is written once: a replayed batch changes nothing, and the sync adds each
-- new row to the rollup in the same statement that inserts it (docs/plane.md).

CREATE TABLE job_usage (
    cluster_id text NOT NULL,
    origin text NOT NULL,
    run_id text NOT NULL,
    id text NOT NULL,
    prompt_tokens bigint CHECK (prompt_tokens >= 0),
    completion_tokens bigint CHECK (completion_tokens >= 0),
    ttft_ms bigint CHECK (ttft_ms >= 0),
    total_ms bigint CHECK (total_ms >= 0),
    PRIMARY KEY (cluster_id, origin, run_id, id),
    FOREIGN KEY (cluster_id, origin, run_id, id)
        REFERENCES jobs (cluster_id, origin, run_id, id) ON DELETE CASCADE
);

CREATE TABLE usage_rollup (
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    model text NOT NULL,
    requester text NOT NULL,  -- the job's requesterId, '' when it has none
    prompt_tokens bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    jobs bigint NOT NULL,
    PRIMARY KEY (cluster_id, model, requester)
);
