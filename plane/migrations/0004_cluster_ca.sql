-- The cluster CA whose certificates a cluster's nodes sign their syncs with (docs/plane.md,
-- "Only a node speaks for itself"). Bound on the cluster's first signed sync, or at
-- enrolment (`enrol-cluster --ca`), and never changed after: a sync presenting another CA
-- is refused. Compared by the SHA-256 of the CA's SubjectPublicKeyInfo (the key is the
-- trust, as in the pin store); the DER is kept for operators. NULL until bound.
ALTER TABLE clusters
    ADD COLUMN ca_spki_sha256 bytea CHECK (length(ca_spki_sha256) = 32),
    ADD COLUMN ca_der bytea,
    ADD COLUMN ca_bound_at timestamptz,
    ADD CONSTRAINT clusters_ca_whole CHECK ((ca_spki_sha256 IS NULL) = (ca_der IS NULL));
