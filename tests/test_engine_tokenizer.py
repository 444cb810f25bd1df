"""Engine.tokenizer() builds its tokenizer once per engine: reading a GGUF's vocabulary or
building the synthetic one is paid on the first call, and later calls (every prompt of
`strata run` and `strata generate`) get the same object back."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_rt.engine import Engine
from strata_rt.errors import GGUFError
from strata_rt.models.qwen3 import TINY_SPEC, Qwen3Model, write_qwen3_gguf
from strata_rt.text import tokenizer as tokenizer_mod
from strata_rt.text.tokenizer_vocab import TokenizerVocab, synthetic_vocab

pytest.importorskip("tokenizers")


def _open(model: dict) -> Engine:
    return Engine.open({"model": model, "backend": "reference", "prefill": 64})


@pytest.fixture
def synthetic_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each synthetic vocabulary the tokenizer module builds, by size."""
    calls: list[int] = []
    real = tokenizer_mod.synthetic_vocab

    def counting(n_vocab: int = 1024) -> TokenizerVocab:
        calls.append(n_vocab)
        return real(n_vocab)

    monkeypatch.setattr(tokenizer_mod, "synthetic_vocab", counting)
    return calls


@pytest.fixture
def gguf_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each GGUF file whose tokenizer keys are read."""
    calls: list[str] = []
    real = TokenizerVocab.from_gguf

    def counting(cls: type[TokenizerVocab], path: str | Path) -> TokenizerVocab:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(TokenizerVocab, "from_gguf", classmethod(counting))
    return calls


def test_synthetic_vocabulary_is_built_once_per_engine(synthetic_builds):
    with _open({"qwen3": "tiny", "seed": 1, "format": "fp16"}) as eng:
        assert synthetic_builds == []  # opening an engine builds no tokenizer
        first = eng.tokenizer()
        assert synthetic_builds == [eng.qwen3_spec.vocab]
        assert eng.tokenizer() is first and eng.tokenizer() is first
        assert synthetic_builds == [eng.qwen3_spec.vocab], "later calls must not rebuild"
        ids = first.encode("hello world")
        assert ids and first.decode(ids) == "hello world"
    with _open({"qwen3": "tiny", "seed": 1, "format": "fp16"}) as other:
        assert other.tokenizer() is not first, "each engine keeps its own tokenizer"
        assert len(synthetic_builds) == 2
        assert other.tokenizer().encode("hello world") == ids


def test_gguf_tokenizer_is_read_once(tmp_path, gguf_reads):
    model = Qwen3Model.synthetic(TINY_SPEC, 1, "fp16")
    vocab = synthetic_vocab(TINY_SPEC.vocab)
    path = write_qwen3_gguf(tmp_path / "text.gguf", model, keys=vocab.gguf_keys())
    with _open({"gguf": str(path), "format": "fp16"}) as eng:
        first = eng.tokenizer()
        assert gguf_reads == [str(path)]
        assert eng.tokenizer() is first
        assert gguf_reads == [str(path)], "later calls must not read the file again"
        assert first.tokens == vocab.tokens


def test_a_missing_tokenizer_is_refused_on_every_call(tmp_path, gguf_reads):
    """A failure is not kept as a result: each call reads the file again and raises again."""
    path = write_qwen3_gguf(tmp_path / "bare.gguf", Qwen3Model.synthetic(TINY_SPEC, 1, "fp16"))
    with _open({"gguf": str(path), "format": "fp16"}) as eng:
        for _ in range(2):
            with pytest.raises(GGUFError, match="no tokenizer"):
                eng.tokenizer()
        assert gguf_reads == [str(path)] * 2
