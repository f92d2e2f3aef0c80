"""The node daemon and the `nvpair` command line."""
