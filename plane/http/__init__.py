"""The plane's HTTP API: the server, its route groups mounted, and `nvpair plane serve`."""
