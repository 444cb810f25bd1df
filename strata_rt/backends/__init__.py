"""The executors of a plan (cuda/, reference/); the host passes they share with the loaders
live in strata_rt.host."""
