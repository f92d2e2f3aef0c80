-- The demand, binding and machinery sides (issue 16): what the plane API declares, what the
-- clusters fetch (deployments, routes, operations, the warm set) and what they report back
-- (replicas, allocations, events, components, cache residency, operation phases).
-- docs/plane-objects.md describes every object; this file only shapes the tables.

-- Clusters carry declared attributes that policies test.
ALTER TABLE clusters
    ADD COLUMN region text NOT NULL DEFAULT '',
    ADD COLUMN residency text NOT NULL DEFAULT '',
    ADD COLUMN cost_per_device_hour real NOT NULL DEFAULT 0 CHECK (cost_per_device_hour >= 0),
    ADD COLUMN desired_generation bigint NOT NULL DEFAULT 1;  -- bumped when its desired state changes

-- A node's facade (for an endpoint that routes to this cluster from another).
ALTER TABLE nodes ADD COLUMN facade_url text NOT NULL DEFAULT '';

ALTER TABLE tenants
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
CREATE UNIQUE INDEX tenants_host ON tenants (lower(host)) WHERE host IS NOT NULL;

-- A tenant's API keys: only the SHA-256 of each is kept (the key is shown once).
CREATE TABLE tenant_keys (
    hash text PRIMARY KEY,
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    name text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX tenant_keys_tenant ON tenant_keys (tenant_id);

ALTER TABLE projects ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();

-- One ceiling per project, device class and scope (a cluster, or NULL: fleet-wide).
CREATE UNIQUE INDEX quotas_scope
    ON quotas (project_id, device_class, coalesce(cluster_id, ''));

ALTER TABLE priority_classes ADD COLUMN description text NOT NULL DEFAULT '';

-- Policies belong to a tenant (NULL: the admin's, e.g. attached to a cluster).
ALTER TABLE policies
    ADD COLUMN tenant_id text REFERENCES tenants (id) ON DELETE CASCADE,
    ADD COLUMN name text NOT NULL DEFAULT '',
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX policies_attached ON policies (attached_to);

ALTER TABLE pools ADD COLUMN name text NOT NULL DEFAULT '';

-- Artifacts are a tenant's: the same digest under two tenants is two rows.
ALTER TABLE artifacts
    DROP CONSTRAINT artifacts_digest_key,
    ADD COLUMN tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    ADD COLUMN name text NOT NULL DEFAULT '',
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT artifacts_tenant_digest UNIQUE (tenant_id, digest);

-- A workload's name is the model name its deployments serve in each cluster: unique in the
-- plane, since two workloads on one cluster cannot share a deployment name.
ALTER TABLE workloads
    ADD COLUMN name text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$'),
    ADD COLUMN replicas integer NOT NULL DEFAULT 1 CHECK (replicas >= 0),
    ADD COLUMN constraints jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN paused boolean NOT NULL DEFAULT false,
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT workloads_scale CHECK (0 <= min_replicas AND min_replicas <= max_replicas);

-- One deployment per workload and cluster. A managed one is rendered and converged by the
-- cluster; an observed one names the running engine (url, node) and is only watched.
ALTER TABLE deployments
    ADD COLUMN url text NOT NULL DEFAULT '',
    ADD COLUMN node text NOT NULL DEFAULT '',
    ADD COLUMN generation bigint NOT NULL DEFAULT 1,
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT deployments_one_per_cluster UNIQUE (workload_id, cluster_id),
    ADD CONSTRAINT deployments_replicas CHECK (replicas >= 0);

-- Replicas as their nodes report them (the node that runs one is its one writer).
ALTER TABLE replicas
    ADD COLUMN deployment_name text NOT NULL DEFAULT '',
    ADD COLUMN state text NOT NULL DEFAULT 'starting',
    ADD COLUMN drift text NOT NULL DEFAULT '',
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX replicas_deployment ON replicas (deployment_id);
CREATE INDEX replicas_node ON replicas (node_id);

ALTER TABLE allocations
    ADD COLUMN cluster_id text REFERENCES clusters (id) ON DELETE CASCADE,
    ADD COLUMN node_id text NOT NULL DEFAULT '';

-- An endpoint resolves by weights, or by failover order (the first target that is up).
-- targets: [{"deployment": "dep_...", "weight": 90, "order": 0}, ...]
ALTER TABLE endpoints
    ADD COLUMN mode text NOT NULL DEFAULT 'weighted' CHECK (mode IN ('weighted', 'failover')),
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();

-- Operations are carried out by one cluster; payload holds what the kind needs (force, ...).
ALTER TABLE operations
    ADD COLUMN cluster_id text REFERENCES clusters (id) ON DELETE CASCADE,
    ADD COLUMN tenant_id text REFERENCES tenants (id) ON DELETE CASCADE,
    ADD COLUMN payload jsonb NOT NULL DEFAULT '{}',
    ADD CONSTRAINT operations_phase
        CHECK (phase IN ('pending', 'running', 'succeeded', 'failed'));
CREATE INDEX operations_cluster_phase ON operations (cluster_id, phase);

ALTER TABLE components
    ADD COLUMN node_id text NOT NULL DEFAULT '',
    ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT components_one UNIQUE (cluster_id, node_id, name);

ALTER TABLE events ADD COLUMN node_id text NOT NULL DEFAULT '';

-- Residency observed per node; the warm set declared per cluster (node_id '').
ALTER TABLE cache_entries ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
