"""The plane's PostgreSQL: the one place a connection is taken, migrations, the store over a pool,
the embedded server."""
