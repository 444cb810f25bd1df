"""Run configs and their checks, the engine's configuration, the environment switches, input and
output paths."""
