"""What the device holds for a prompt, and the rules that size it, as pure Python: which experts
live in VRAM slots and the routing profiles that choose them (`residency`), the cached
group-buffer images of resident experts (`image_cache`), whether products read resident
experts in place (`in_place`), how many compute lanes, each a set of group buffers, a chunk
uses (`lanes`), and the device memory plan that splits a VRAM budget among them
(`memory_plan`). The config checks, the planners, the executors and the benchmarks read the
same rules, and none of them needs CUDA to do so."""
