"""What the agent serves besides the facade: the local API (14322) and the node API (14321)."""
