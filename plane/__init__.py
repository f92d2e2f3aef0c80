"""The Postgres plane (Wingsmith object model): enrolment, sync, fleet views.

`plane.core.wire` (what nodes send), `plane.fleet.node_signing` (how they sign it) and
`plane.core.errors` load no database driver; the store, the server and the service do. This
package imports none of them, so a node that only builds sync batches never loads psycopg.
"""
