"""Tests of this member's artifacts: the store (issue 28)."""
