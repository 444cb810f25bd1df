"""The reference executor: the engine's plans op by op in numpy."""
