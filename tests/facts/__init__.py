"""Tests of `facts`: the cluster's signed facts and membership, in memory."""
