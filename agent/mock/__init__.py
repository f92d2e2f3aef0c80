"""`nvpair mock-engine`: the project's own model server, speaking the real engines' HTTP and
metrics."""
