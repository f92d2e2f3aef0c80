"""The inference facade (14323): requests in, jobs, routing, the wait line, keys, usage."""
