"""The machinery side: plane operations, events, components, cache residency and the warm set."""
