"""What the greedy-decoding and perplexity tests share: transformers' golden ids and
perplexities (tests/fixtures/generate), the cases of the tiny seeded models they were made from
(the `golden_models` fixture in conftest.py builds them), a small fast model with a short
context, and the bundled tiny config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from strata_rt.models.qwen3 import Qwen3Spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "tools"))
from make_qwen3_golden import CASES, build_case  # noqa: E402,F401

GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "generate" / "golden.json").read_text())
TINY_CONFIG = ROOT / "configs" / "tiny-qwen3moe.yaml"
#: small and quick; a short context for the limit tests
SMALL = Qwen3Spec(n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab=400,
                  ffn=128, n_experts=8, top_k=2, context=64)

