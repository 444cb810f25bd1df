"""One chunk's schedule: the Plan, its planners, the chunk driver, the hazard checker, residency,
the image cache, lanes and the device memory plan."""
