-- The plane's first schema: seed 000's objects and seed 002's jobs.
-- Observed objects carry the generation (or seq) of their one writer: a newer one wins.

CREATE TABLE admin (
    id integer PRIMARY KEY CHECK (id = 1),
    token_hash text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE clusters (
    id text PRIMARY KEY CHECK (id ~ '^clu_[0-9a-hjkmnp-tv-z]{26}$'),
    name text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 128),
    token_hash text NOT NULL,
    revoked_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    last_sync_at timestamptz
);

-- Supply (observed, except pools)
CREATE TABLE nodes (
    id text PRIMARY KEY CHECK (id ~ '^nod_[0-9a-hjkmnp-tv-z]{26}$'),
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    name text NOT NULL,
    reachable boolean NOT NULL,
    cordoned boolean NOT NULL,
    version text NOT NULL,
    generation bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX nodes_cluster ON nodes (cluster_id);

CREATE TABLE devices (
    id text PRIMARY KEY CHECK (id ~ '^dev_[0-9a-hjkmnp-tv-z]{26}$'),
    node_id text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    uuid text NOT NULL,
    device_class text NOT NULL,
    health text NOT NULL CHECK (health IN ('ok', 'degraded', 'failed')),
    memory_total bigint NOT NULL,
    memory_used bigint NOT NULL,
    utilization real,
    domain_id text,
    generation bigint NOT NULL
);
CREATE INDEX devices_cluster_class ON devices (cluster_id, device_class);

CREATE TABLE topology_domains (
    id text PRIMARY KEY CHECK (id ~ '^tpd_[0-9a-hjkmnp-tv-z]{26}$'),
    node_id text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    kind text NOT NULL,
    device_ids text[] NOT NULL,
    generation bigint NOT NULL
);

CREATE TABLE pools (
    id text PRIMARY KEY CHECK (id ~ '^pol_[0-9a-hjkmnp-tv-z]{26}$'),
    cluster_id text REFERENCES clusters (id) ON DELETE CASCADE,
    device_class text NOT NULL,
    min_nodes integer NOT NULL DEFAULT 0,
    max_nodes integer NOT NULL,
    spec jsonb NOT NULL DEFAULT '{}'
);

-- Binding (declared, except allocations)
CREATE TABLE tenants (
    id text PRIMARY KEY CHECK (id ~ '^ten_[0-9a-hjkmnp-tv-z]{26}$'),
    name text NOT NULL UNIQUE,
    host text
);

CREATE TABLE projects (
    id text PRIMARY KEY CHECK (id ~ '^prj_[0-9a-hjkmnp-tv-z]{26}$'),
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name text NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE quotas (
    id text PRIMARY KEY CHECK (id ~ '^qta_[0-9a-hjkmnp-tv-z]{26}$'),
    project_id text NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    device_class text NOT NULL,
    cluster_id text REFERENCES clusters (id) ON DELETE CASCADE,  -- NULL: fleet-wide
    max_devices integer NOT NULL CHECK (max_devices >= 0),
    guaranteed integer NOT NULL DEFAULT 0,
    over_quota_weight real NOT NULL DEFAULT 0
);

CREATE TABLE priority_classes (
    id text PRIMARY KEY CHECK (id ~ '^prc_[0-9a-hjkmnp-tv-z]{26}$'),
    name text NOT NULL UNIQUE,
    value integer NOT NULL,
    preemptible boolean NOT NULL DEFAULT false
);

CREATE TABLE policies (
    id text PRIMARY KEY CHECK (id ~ '^plc_[0-9a-hjkmnp-tv-z]{26}$'),
    attached_to text NOT NULL,  -- a tenant, endpoint, workload or cluster id
    spec jsonb NOT NULL
);

-- Demand
CREATE TABLE artifacts (
    id text PRIMARY KEY CHECK (id ~ '^art_[0-9a-hjkmnp-tv-z]{26}$'),
    digest text NOT NULL UNIQUE,
    kind text NOT NULL,
    locations text[] NOT NULL DEFAULT '{}'
);

CREATE TABLE workloads (
    id text PRIMARY KEY CHECK (id ~ '^wkl_[0-9a-hjkmnp-tv-z]{26}$'),
    project_id text NOT NULL REFERENCES projects (id),
    artifact_id text NOT NULL REFERENCES artifacts (id),
    kind text NOT NULL DEFAULT 'service' CHECK (kind = 'service'),
    serving_digest text NOT NULL CHECK (serving_digest ~ '^svg_[0-9a-f]{64}$'),
    serving jsonb NOT NULL,
    min_replicas integer NOT NULL DEFAULT 1,
    max_replicas integer NOT NULL DEFAULT 1,
    priority_class_id text REFERENCES priority_classes (id)
);

CREATE TABLE deployments (
    id text PRIMARY KEY CHECK (id ~ '^dep_[0-9a-hjkmnp-tv-z]{26}$'),
    workload_id text NOT NULL REFERENCES workloads (id) ON DELETE CASCADE,
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    replicas integer NOT NULL,
    authority text NOT NULL CHECK (authority IN ('observed', 'managed'))
);

CREATE TABLE replicas (
    id text PRIMARY KEY CHECK (id ~ '^rep_[0-9a-hjkmnp-tv-z]{26}$'),
    deployment_id text REFERENCES deployments (id) ON DELETE SET NULL,
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    node_id text NOT NULL,
    ready boolean NOT NULL,
    engine_version text,
    generation bigint NOT NULL
);

CREATE TABLE endpoints (
    id text PRIMARY KEY CHECK (id ~ '^end_[0-9a-hjkmnp-tv-z]{26}$'),
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    model_name text NOT NULL,
    targets jsonb NOT NULL DEFAULT '[]',
    UNIQUE (tenant_id, model_name)
);

CREATE TABLE allocations (
    id text PRIMARY KEY CHECK (id ~ '^alc_[0-9a-hjkmnp-tv-z]{26}$'),
    replica_id text NOT NULL REFERENCES replicas (id) ON DELETE CASCADE,
    device_ids text[] NOT NULL
);

-- Machinery
CREATE TABLE operations (
    id text PRIMARY KEY CHECK (id ~ '^opr_[0-9a-hjkmnp-tv-z]{26}$'),
    kind text NOT NULL,
    target text NOT NULL,
    requester text NOT NULL,
    reason text NOT NULL DEFAULT '',
    phase text NOT NULL,
    result text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE components (
    id text PRIMARY KEY CHECK (id ~ '^cmp_[0-9a-hjkmnp-tv-z]{26}$'),
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    name text NOT NULL,
    declared_version text,
    observed_version text
);

CREATE TABLE events (
    id text PRIMARY KEY CHECK (id ~ '^evt_[0-9a-hjkmnp-tv-z]{26}$'),
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    about text NOT NULL,
    kind text NOT NULL,
    message text NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX events_cluster_at ON events (cluster_id, at);

CREATE TABLE cache_entries (
    artifact_id text NOT NULL REFERENCES artifacts (id) ON DELETE CASCADE,
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    node_id text NOT NULL DEFAULT '',
    resident boolean NOT NULL,
    declared_warm boolean NOT NULL DEFAULT false,
    PRIMARY KEY (artifact_id, cluster_id, node_id)
);

-- Seed 002's workload records: one row per job per cluster; the originating node writes it.
-- Never a prompt: the columns are the record's metadata and nothing else.
CREATE TABLE jobs (
    cluster_id text NOT NULL REFERENCES clusters (id) ON DELETE CASCADE,
    origin text NOT NULL,
    run_id text NOT NULL,
    id text NOT NULL,
    seq bigint NOT NULL CHECK (seq >= 1),
    state text NOT NULL CHECK (state IN ('queued', 'running', 'completed', 'failed', 'cancelled')),
    model text NOT NULL,
    engine text NOT NULL,
    scheduled_on text,
    requester_id text,
    created_at bigint NOT NULL,
    started_at bigint,
    completed_at bigint,
    error text,
    PRIMARY KEY (cluster_id, origin, run_id, id)
);
CREATE INDEX jobs_cluster_state ON jobs (cluster_id, state);
CREATE INDEX jobs_keyset ON jobs (created_at DESC, cluster_id, origin, run_id, id);
CREATE INDEX jobs_model ON jobs (model);
