"""What an engine is opened with: EngineConfig, where every engine switch is resolved once
(`engine_config`; nothing below it reads the environment), the one list of environment
switches and how each value is checked (`env`), and the keys of Engine.open's settings
mapping (`settings_keys`)."""
