"""The config keys of a whole Qwen3-MoE model (token ids in, logits out).

A synthetic model becomes whole when `model.synthetic` names its attention and vocabulary
(`n_heads`, `n_kv_heads`, `head_dim`, `vocab`; optional `rope_theta`, `context`, `tied`,
`dense_type`, and `pool_layers`: draw that many distinct dense layers and repeat them, for the
large shapes); a GGUF is whole when it carries `token_embd.weight` (its keys give the rest).
The top-level `context` caps the KV cache (default: the model's context length), which is
what sizes its VRAM; `dense` says whether the dense weights stay resident or stream per layer
(`auto`: resident when the budget holds them beside one chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...models.qwen3.gguf_full import read_dense_types, read_qwen3_spec
from ...models.qwen3.spec import Qwen3Spec
from ...models.qwen3.whole_memory import DenseLayout, DenseTypes, WholeSizing
from ...weights.whole_model import WHOLE_MODEL_TENSOR, is_whole_gguf
from ..settings.engine_config import DENSE_POLICIES, dense_gemm_switch, embedding_switch
from .problem_sink import Problems

if TYPE_CHECKING:
    from ...weights.model import MoESpec
    from .prompts import Prompt


#: the keys that make a synthetic model whole (all four, or none)
WHOLE_REQUIRED = ("n_heads", "n_kv_heads", "head_dim", "vocab")
WHOLE_OPTIONAL = ("rope_theta", "context", "tied", "dense_type", "pool_layers")
WHOLE_KEYS = WHOLE_REQUIRED + WHOLE_OPTIONAL
#: KV-cache positions beyond any model's context (larger ones overflowed the sizes)
MAX_CONTEXT = 1 << 24

#: dense tensor types a synthetic whole model may store (norms stay F32)
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0")


def check_whole(p: Problems, doc: dict, geom: MoESpec | None, gguf: Path | None
                ) -> tuple[Qwen3Spec | None, dict[str, Any], DenseTypes | None]:
    """-> (the whole model's spec or None for MoE layers alone, synthetic options
    {tied, dense_type}, the GGML types of its dense matrices)."""
    spec, options = _check_whole(p, doc, geom, gguf)
    if spec is None:
        return None, options, None
    if gguf is not None:
        return spec, options, read_dense_types(gguf)
    return spec, options, DenseTypes.uniform(spec.n_layers, options["dense_type"],
                                             options["tied"] is True)


def _check_whole(p: Problems, doc: dict, geom: MoESpec | None, gguf: Path | None
                 ) -> tuple[Qwen3Spec | None, dict[str, Any]]:
    if geom is None:
        return None, {}
    if gguf is not None:
        if not is_whole_gguf(gguf):
            return None, {}
        spec, _ = read_qwen3_spec(gguf)  # a broken file raises GGUFError (exit code 1)
        return spec, {}
    syn = doc["model"]["synthetic"]
    given = [k for k in WHOLE_REQUIRED if k in syn]
    if not given:
        extra = [k for k in WHOLE_OPTIONAL if k in syn]
        if extra:
            p.add(f"model.synthetic.{extra[0]}", syn[extra[0]],
                  f"only for a whole model: give {', '.join(WHOLE_REQUIRED)} too")
        return None, {}
    missing = [k for k in WHOLE_REQUIRED if k not in syn]
    if missing:
        p.add("model.synthetic", {k: syn[k] for k in given},
              f"a whole model needs all of {', '.join(WHOLE_REQUIRED)}; missing "
              f"{', '.join(missing)}")
        return None, {}
    options = {"tied": syn.get("tied", False), "dense_type": syn.get("dense_type", "F32")}
    if "pool_layers" in syn:
        pool = syn["pool_layers"]
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            p.add("model.synthetic.pool_layers", pool, "expected a number of layers >= 1")
        else:
            options["pool_layers"] = pool
    if not isinstance(options["tied"], bool):
        p.add("model.synthetic.tied", options["tied"], "expected true or false")
    if options["dense_type"] not in DENSE_TYPES:
        p.add("model.synthetic.dense_type", options["dense_type"],
              f"allowed: {', '.join(DENSE_TYPES)}")
        options["dense_type"] = "F32"  # the run is refused; the sizes are still estimated
    fields = {k: syn[k] for k in WHOLE_REQUIRED + ("rope_theta", "context") if k in syn}
    context = fields.get("context")
    if isinstance(context, int) and context > MAX_CONTEXT:
        p.add("model.synthetic.context", context, f"at most {MAX_CONTEXT:,} positions")
        return None, {}
    try:
        spec = Qwen3Spec(n_layers=geom.n_layers, hidden=geom.hidden, ffn=geom.ffn,
                         n_experts=geom.n_experts, top_k=geom.top_k, rms_eps=geom.rms_eps,
                         **fields)
    except ConfigError as e:
        for problem in e.problems:
            p.items.append(f"model.synthetic: {problem}")
        return None, {}
    return spec, options


#: the keys only a whole model takes
WHOLE_ONLY_KEYS = ("context", "dense", "generate")


def check_moe_only_file(p: Problems, doc: dict, gguf: Path | None,
                        whole: Qwen3Spec | None) -> None:
    """Where a config gives keys only a whole model takes and its GGUF holds MoE layers alone,
    one line names the file and what it lacks (a whole model's file damaged or cut, or the
    wrong file), beside the keys' own lines."""
    given = [k for k in WHOLE_ONLY_KEYS if k in doc]
    if gguf is None or whole is not None or not given:
        return
    keys = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
    model = doc.get("model")
    shown = model.get("gguf", str(gguf)) if isinstance(model, dict) else str(gguf)
    p.add("model.gguf", shown, f"the file holds MoE layers alone (no {WHOLE_MODEL_TENSOR} "
          f"tensor), so {keys} cannot apply: a whole model's file has one ({gguf})")


def check_prompts_fit(p: Problems, doc: dict, prompts: Sequence[Prompt], positions: int
                      ) -> None:
    """A whole model's longest prompt must fit its KV cache (`positions`: the config's
    `context`, else the model's), checked before any prompt runs; with `generate` the check
    of its tokens covers this."""
    longest = max(prompts, key=lambda pr: pr.tokens, default=None)
    if longest is None or longest.tokens <= positions:
        return
    where = "context" if "context" in doc else "prompts"
    p.add(where, doc.get(where), f"prompts[{longest.index}] has {longest.tokens:,} tokens and "
          f"the KV cache holds {positions:,} positions: shorten it or raise `context`")


def check_context(p: Problems, doc: dict, whole: Qwen3Spec | None) -> int | None:
    """The top-level `context` (KV-cache positions), None when absent."""
    if "context" not in doc:
        return None
    v = doc["context"]
    if whole is None:
        p.add("context", v, "only for a whole model (MoE layers alone keep no KV cache)")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_CONTEXT:
        p.add("context", v, f"expected KV-cache positions, 1..{whole.context} or more (at "
              f"most {MAX_CONTEXT:,})")
        return None
    return v



def check_dense(p: Problems, doc: dict, whole: Qwen3Spec | None) -> str:
    """The top-level `dense` policy (auto when absent)."""
    v = doc.get("dense", "auto")
    if v not in DENSE_POLICIES:
        p.add("dense", v, f"allowed: {', '.join(DENSE_POLICIES)}")
        return "auto"
    if "dense" in doc and whole is None:
        p.add("dense", v, "only for a whole model (MoE layers alone have no dense weights)")
    return v


def whole_sizing(whole: Qwen3Spec | None, types: DenseTypes | None, context: int | None
                 ) -> WholeSizing | None:
    """How a whole model's device memory is sized (dense GEMM from STRATA_DENSE_GEMM, the
    embedding where STRATA_EMBEDDING puts it: embeds_on_gpu)."""
    if whole is None or types is None:
        return None
    return WholeSizing(whole, types, context or whole.context, False, dense_gemm_switch(),
                       embedding=embedding_switch() != "host", embedding_mode=embedding_switch())


#: bytes per value of the dense types a synthetic whole model may store
_TYPE_BYTES = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32}


def whole_host_parts(whole: Qwen3Spec | None, options: dict[str, Any],
                     types: DenseTypes | None, gguf: bool, dense_stream: bool
                     ) -> dict[str, int]:
    """Host bytes a whole model adds to a run, by part: its dense weights as generated (a
    GGUF's stay in the file's memory map) and, when the dense weights stream, their pinned
    slot images (the device takes every dense matrix in its stored type, so nothing is
    converted on the host)."""
    if whole is None or types is None:
        return {}
    parts: dict[str, int] = {}
    if not gguf:
        per = _TYPE_BYTES.get(options.get("dense_type", "F32"), 4.0)
        layers = min(whole.n_layers, options.get("pool_layers") or whole.n_layers)
        heads = 1 if options.get("tied") else 2
        parts["dense weights"] = int(per * (layers * whole.dense_params_per_layer()
                                            + heads * whole.vocab * whole.hidden))
    if dense_stream:
        parts["pinned dense slots"] = whole.n_layers * DenseLayout.of(whole, types).slot_bytes
    return parts
