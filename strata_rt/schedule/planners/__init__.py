"""The planners: residency, ring state and (on the staging ring) the routed set in, a Plan out.
`planner` holds the walk, staging-ring, routed and decode planners and the ring sizing rule the
config's budget check uses too; `ring_builder` the issuer/consumer rules of the streaming design
they all share; `layer_pass` the layer-major plan of a prompt of several chunks; `dense_schedule`
where a whole model's Attention and DenseCopy ops go; `layer_products` the transform that merges
a whole-resident layer's products into one LayerProducts after planning. They emit plan.py's ops
and see a backend only through the Executor protocol (executor.py): the chunk driver calls them,
and the executors and the hazard checker read what they make."""
