"""Reading a GGUF file as downloaded: its header, keys, tensor table and string arrays, split
shards read as one model, the open-time checks of every tensor's extent and values, and the
kept descriptor through which run-time reads go (so a file changed after open is an error, not
a crash). The weights package above builds models and stores from what this reads."""
