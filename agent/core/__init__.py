"""What every part of the agent shares: typed errors, the home's rules, JSON from outside decoded
or refused, structured lifetimes, the advertised address, a request's identity, bounded metric
labels."""
