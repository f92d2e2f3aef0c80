"""Everything an agent does with the plane it is enrolled in: sync up, desired state down."""
