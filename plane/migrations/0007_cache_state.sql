-- Residency from each node's artifact store (issue 28): resident, fetching (with the share of
-- pieces held) or missing. Rows a node of 0.1.0 writes say '' (only `resident` is known).
ALTER TABLE cache_entries
    ADD COLUMN state text NOT NULL DEFAULT '',
    ADD COLUMN progress real NOT NULL DEFAULT 0,
    ADD CONSTRAINT cache_entries_state CHECK (state IN ('', 'resident', 'fetching', 'missing')),
    ADD CONSTRAINT cache_entries_progress CHECK (progress >= 0 AND progress <= 1);
