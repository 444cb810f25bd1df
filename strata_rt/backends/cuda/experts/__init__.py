"""The expert products of a layer on the CUDA backend: per-group and table launches, the
decode step's routed experts, the routed walk's switched copies, and the device tables of blob
addresses they read."""
