"""The user's files, read and written without surprises: what a path is, told before it is
opened (`file_kinds`), input files read with bounded memory and no wait (`input_files`), YAML
read strictly and with bounds (`yaml_input`), whole numbers written as text, in a file, on the
command line or in the environment (`numbers`), and output paths checked before a run and
written atomically (`paths`). Nothing here knows a run config's keys: the run configs, the
engine's settings, the GGUF and plugin loaders and the CLI share it."""
