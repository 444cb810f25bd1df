"""One chunk's schedule: the Plan, its planners and their ring builder, the chunk driver and its
streaming choice, the hazard checker, residency, the image cache, lanes and the device memory
plan."""
