"""The node daemon's composition and lifetime: configuration, the home, start-up, the upkeep
loops."""
