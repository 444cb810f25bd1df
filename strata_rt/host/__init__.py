"""Host-side passes over large arrays on a few threads, shared by the loaders (the expert
store's fill, synthetic weights) and the executors (a chunk's input and output)."""
