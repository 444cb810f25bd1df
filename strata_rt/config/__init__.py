"""What a run and an engine are given, checked before anything is built: run configs (`run/`),
the engine's settings and the environment switches (`settings/`), the user's files read and
written safely (`files/`), and the host-memory check that a run config's validation and
Engine.open both make (`hostmem`)."""
