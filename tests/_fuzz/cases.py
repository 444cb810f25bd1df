"""The seed inputs and the seeded stream of cases drawn from them.

Seeds: two small GGUF files written by strata_rt's own writers (MoE layers alone: 2 layers of
4 IQ3_XXS experts, hidden 256; a whole model: 1 layer, vocab 64, context 256), a run config
for each, a token file and a hidden-state file. Every seed runs clean (exit 0) in about a
tenth of a second in process, so most of a case's time is the mutant's.

Case i of seed s is drawn from random.Random(f"{s}:{i}"), so any case can be rebuilt alone
(`case(i, seed)`) from the description a failure prints.
"""

from __future__ import annotations

import functools
import io
import random
from dataclasses import dataclass

import numpy as np
import yaml

from .gguf_layout import Layout, parse
from .gguf_mutators import mutate_gguf
from .harness import Case
from .text_mutators import mutate_config, mutate_hidden, mutate_tokens

HIDDEN = 256
VOCAB = 64
MOE_CONFIG = {"model": {"gguf": "m.gguf"}, "format": "iq3_xxs", "backend": "reference",
              "expert_cache": 2, "prefill": "auto", "prompts": [3, {"hidden_file": "h.npy"}],
              "repeats": 1, "seed": 0, "output": {"json": "out.json"}}
WHOLE_CONFIG = {"model": {"gguf": "w.gguf"}, "format": "iq3_xxs", "backend": "reference",
                "expert_cache": 2, "context": 64, "prompts": [{"file": "toks.txt"}, 2],
                "generate": {"tokens": 2}, "output": {"json": "out.json"}}
#: (kind, weight): GGUF files, configs, prompt files
KINDS = (("gguf-moe", 22), ("gguf-whole", 18), ("config-moe", 15), ("config-whole", 15),
         ("tokens", 15), ("hidden", 15))


@dataclass(frozen=True)
class Seeds:
    files: dict[str, bytes]
    layouts: dict[str, Layout]


@functools.lru_cache(maxsize=1)
def seeds() -> Seeds:
    """The seed files, built once per process with strata_rt's writers."""
    import tempfile
    from pathlib import Path

    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model, MoESpec

    with tempfile.TemporaryDirectory() as tmp:
        moe = write_moe_gguf(Path(tmp) / "m.gguf", Model.synthetic(
            MoESpec(n_layers=2, hidden=HIDDEN, ffn=256, n_experts=4, top_k=2), 21))
        spec = Qwen3Spec(n_layers=1, hidden=HIDDEN, n_heads=2, n_kv_heads=1, head_dim=32,
                         vocab=VOCAB, ffn=256, n_experts=4, top_k=2, context=256)
        whole = write_qwen3_gguf(Path(tmp) / "w.gguf", Qwen3Model.synthetic(spec, 5, "iq3_xxs"))
        files = {"m.gguf": moe.read_bytes(), "w.gguf": whole.read_bytes()}
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(3).standard_normal((3, HIDDEN)).astype(np.float32))
    files.update({"run.yaml": yaml.safe_dump(MOE_CONFIG, sort_keys=False).encode(),
                  "whole.yaml": yaml.safe_dump(WHOLE_CONFIG, sort_keys=False).encode(),
                  "toks.txt": b"1\n2\n3\n4\n", "h.npy": buf.getvalue()})
    return Seeds(files, {n: parse(files[n]) for n in ("m.gguf", "w.gguf")})


def _named_outputs(raw: bytes) -> frozenset[str]:
    """The output paths a (mutated) config names: files the run may write."""
    try:
        doc = yaml.safe_load(raw)
    except Exception:  # noqa: BLE001  (a config YAML cannot read names nothing)
        return frozenset()
    out = doc.get("output") if isinstance(doc, dict) else None
    if not isinstance(out, dict):
        return frozenset()
    return frozenset(str(v) for k, v in out.items() if k in ("json", "dump_r")
                     and isinstance(v, str))


def case(index: int, seed: int) -> Case:
    """Case `index` of the stream seeded by `seed`."""
    rng = random.Random(f"{seed}:{index}")
    kinds, weights = zip(*KINDS)
    kind = rng.choices(kinds, weights)[0]
    s = seeds()
    files = dict(s.files)
    whole = kind.endswith("whole") or kind == "tokens"
    config = "whole.yaml" if whole else "run.yaml"
    argv: tuple[str, ...] = ("-q", "run", config)
    valid: bool | None = None
    outputs: frozenset[str] = frozenset()
    if kind.startswith("gguf"):
        name = "w.gguf" if whole else "m.gguf"
        files[name], what = mutate_gguf(files[name], s.layouts[name], rng)
        if rng.random() < 0.5:
            argv = ("-q", "inspect", name)
    elif kind.startswith("config"):
        name = config
        files[name], what = mutate_config(files[name].decode(), rng)
        outputs = _named_outputs(files[name])
    elif kind == "tokens":
        name = "toks.txt"
        files[name], what, valid = mutate_tokens(VOCAB, rng)
    else:
        name = "h.npy"
        files[name], what, valid = mutate_hidden(HIDDEN, rng)
    return Case(index, kind, files, name, what, argv, valid, outputs,
                VOCAB if whole else None)
