"""Tests of `netkit`: the plumbing every server and client shares."""
