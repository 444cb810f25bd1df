"""The outputs of a run config (`output: {dir, json, dump_r}`), checked before the run: each
can be written (strata_rt.config.files.paths), and none is a file the run reads.

`output.json` and `output.dump_r` are relative to `output.dir` when that is set, else to the
config file's directory. An output that names the config itself, the model, a prompt or
profile file or the plugin list would destroy it when written (`output: {json: run.yaml}`
overwrote the config with results, exit 0): `input_paths` lists what a run reads, so the
config and the command line refuse those with `output_collisions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..files.paths import output_collisions, output_dir_problem, output_file_problem
from .prompts import Prompt
from .schema import Problems, file_path

OUTPUT_FILE_KEYS = ("dump_r", "json")

__all__ = ["OUTPUT_FILE_KEYS", "check_output", "input_paths", "output_collisions"]


def input_paths(source: Path | None, gguf: Path | None, prompts: Sequence[Prompt],
                profile: Path | None) -> dict[str, Path]:
    """What a run reads, by what it is: the config, the model, the prompt and profile files
    and the plugin list in use."""
    from ...formats.registry import plugin_list_path

    found = {"the config file": source, "the model's GGUF file": gguf,
             "the routing profile": profile, "the plugin list": plugin_list_path()}
    if gguf is not None:  # a split GGUF's later shards are read too
        from ...errors import GGUFError
        from ...weights.gguf_file.gguf_io import open_reader

        try:
            shards = open_reader(gguf).shards
        except GGUFError:  # named where the model is checked
            shards = ()
        for i, shard in enumerate(shards[1:], start=2):
            found[f"shard {i} of the model's GGUF"] = shard
    for pr in prompts:
        found[f"the file of prompts[{pr.index}]"] = pr.token_file or pr.hidden_file
    return {what: path for what, path in found.items() if path is not None}


def check_output(p: Problems, out_doc: dict, base: Path) -> dict[str, Path | None]:
    """output.dir / .json / .dump_r, each checked to be writable before the run starts."""
    p.unknown_keys("output", out_doc, ("dir", *OUTPUT_FILE_KEYS))
    out_dir = None
    if out_doc.get("dir") is not None:
        out_dir = file_path(p, "output.dir", out_doc["dir"], base, must_exist=False)
        why = None if out_dir is None else output_dir_problem(out_dir)
        if why is not None:
            p.add("output.dir", out_doc["dir"], f"{why} ({out_dir})")
        if out_dir is None or why is not None:
            return {}  # the files are under the folder: nothing more to say about them
    files: dict[str, Path | None] = {"dir": out_dir}
    for key in OUTPUT_FILE_KEYS:
        if out_doc.get(key) is None:
            continue
        target = file_path(p, f"output.{key}", out_doc[key], out_dir or base, must_exist=False)
        why = None if target is None else output_file_problem(target)
        if why is not None:
            p.add(f"output.{key}", out_doc[key], f"{why} ({target})")
        files[key] = target
    return files
