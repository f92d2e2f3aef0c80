"""What each cluster fetches down: its desired state, the endpoints and the routing table."""
