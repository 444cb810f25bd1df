"""Dimensions of a whole Qwen3-MoE model: what the MoE-only MoESpec leaves out.

Attention needs the head layout (query heads, key/value heads, head dimension), the output
head needs the vocabulary, RoPE needs its base and the KV cache the context length. These come
from a GGUF file's `qwen3moe.*` keys (strata_rt.models.qwen3.gguf_full) or are given for a synthetic
model. The sizes that decide a memory budget (dense parameters, KV bytes per token) are
computed here so the CLI, the budget planner and the tests share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...weights.model import MoESpec

_POSITIVE = ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "ffn",
             "n_experts", "top_k", "context")


@dataclass(frozen=True)
class Qwen3Spec:
    """Every dimension of a Qwen3-MoE model (every layer is an MoE layer, no shared expert)."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    ffn: int
    n_experts: int
    top_k: int
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    context: int = 32_768

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r} must be a positive integer" for k in _POSITIVE
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)
                    or getattr(self, k) <= 0]
        if not problems:
            if self.n_heads % self.n_kv_heads:
                problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads="
                                f"{self.n_kv_heads} (each key/value head serves a whole group)")
            if self.head_dim % 2:
                problems.append(f"head_dim={self.head_dim} must be even (RoPE rotates the two "
                                "halves of each head)")
            if self.top_k > self.n_experts:
                problems.append(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        for k in ("rope_theta", "rms_eps"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                problems.append(f"{k}={v!r} must be a number > 0")
        if problems:
            raise ConfigError(problems, source="Qwen3Spec")

    # ------------------------------------------------------------------ derived sizes
    @property
    def q_dim(self) -> int:
        """Width of the query projection (n_heads * head_dim; not hidden in general)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection."""
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def moe_spec(self, fmt: str = "iq3_xxs") -> MoESpec:
        """The MoE part, as the MoE-only runtime describes it."""
        return MoESpec(n_layers=self.n_layers, hidden=self.hidden, ffn=self.ffn,
                       n_experts=self.n_experts, top_k=self.top_k, rms_eps=self.rms_eps,
                       format=fmt)

    def dense_params_per_layer(self) -> int:
        """Parameters of one layer outside the experts: q, k, v, o, router and four norms."""
        H = self.hidden
        return (H * (self.q_dim + 2 * self.kv_dim) + self.q_dim * H + self.n_experts * H
                + 2 * H + 2 * self.head_dim)

    def dense_params(self, tied_output: bool = False) -> int:
        """Every parameter outside the experts: the layers, the embedding, the final norm and
        the output head (counted once when it is tied to the embedding)."""
        heads = 1 if tied_output else 2
        return (self.n_layers * self.dense_params_per_layer() + heads * self.vocab * self.hidden
                + self.hidden)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV cache bytes one token takes over all layers (fp16 by default)."""
        return self.n_layers * 2 * self.kv_dim * bytes_per_value

    def rope_inv_freq(self):
        """theta^(-2i/head_dim) for i < head_dim/2, float64 (numpy array)."""
        import numpy as np

        return self.rope_theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64)
                                   / self.head_dim)


#: the public shapes the performance work targets (MODEL.md geometry)
QWEN3_30B_A3B = Qwen3Spec(n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                          vocab=151_936, ffn=768, n_experts=128, top_k=8, context=40_960)
QWEN3_235B_A22B = Qwen3Spec(n_layers=94, hidden=4096, n_heads=64, n_kv_heads=4, head_dim=128,
                            vocab=151_936, ffn=1536, n_experts=128, top_k=8, context=40_960)
#: a seeded tiny full model: seconds on the reference backend
TINY_SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=512,
                      ffn=256, n_experts=8, top_k=2, context=4096)
