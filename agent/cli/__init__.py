"""The `nvpair` command line: each command group, and how commands reach the running agent."""
