"""The supply side: enrolment, each node's signed sync merged (jobs, replicas, usage), and the
fleet's read views."""
