"""What a run reports: counters, GPU timing, progress, the CLI's logging, and how a signal ends a
run."""
