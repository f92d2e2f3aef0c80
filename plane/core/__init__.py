"""The plane's vocabulary, shared by every slice: ids, the serving digest, errors with their HTTP
status, tokens, what crosses the wire."""
