"""Run configs: the YAML a `strata` command runs, validated all at once. `run_config` holds the
validated objects and `load_config`; `schema` the checks, one per part of the schema; `whole`
a whole model's keys, `prompts` the prompts and their files, `sampling` the `generate` keys,
`outputs` where results go, `host_parts` the host memory the run allocates, by part;
`problem_sink` the interface the key checks report their problems through."""
