"""One chunk's schedule. Here, what every part reads: the Plan, one chunk's ops as plain data
(`plan`), the keys the driver caches plans by (`plan_keys`) and what their ops add to the
counters (`plan_counts`); what a backend is to the driver (`executor`); the chunk driver
(`driver`) and its choice of how a chunk streams (`prefill_stream`). Below, a folder per step:
`planners/` make plans, `vram/` says what the device holds and how a budget sizes it,
`hazards/` checks a plan against CUDA's stream and event rules, `split/` cuts the layers over
several devices."""
