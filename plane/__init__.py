"""The Postgres plane (Wingsmith object model): enrolment, sync, fleet views.

Arrives with the plane issue.
"""
