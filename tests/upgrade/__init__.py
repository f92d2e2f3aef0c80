"""The mixed-release tier (issue 27): the previous release, built from this repository's
history, runs beside this checkout; a cluster is upgraded one member at a time under load
and one member rolled back (docs/upgrade.md)."""
