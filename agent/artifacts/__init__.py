"""This member's artifacts (issue 28): the content-addressed store of weights; next, the
fetch from the members that hold them."""
