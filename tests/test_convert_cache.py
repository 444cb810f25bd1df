"""A conversion a config asks for is written once (tokenizer and every key included) and read
back by later opens: the same logits as a conversion in memory, a new conversion when the
source changes, a file of the cache's name that is not ours left alone, a damaged one of ours
redone, no room or no folder falling back to memory. F32 experts converted to fp16 (fast)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from strata_rt.engine import Engine
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf
from strata_rt.text.tokenizer_vocab import TokenizerVocab, synthetic_vocab
from strata_rt.weights import convert_cache
from strata_rt.weights.gguf_file.gguf_io import open_reader

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                 ffn=256, n_experts=4, top_k=2, context=256)
IDS = np.array([5, 17, 299, 0, 42])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("STRATA_CONVERT_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 5, "q2_blob")  # no GGUF type: experts written as F32


def source(folder: Path, model: Qwen3Model, **kw) -> Path:
    folder.mkdir(exist_ok=True)
    return write_qwen3_gguf(folder / "src.gguf", model, tokenizer=synthetic_vocab(SPEC.vocab),
                            keys={"tokenizer.chat_template": "{{ messages }}"}, **kw)


def logits(path: Path, cached: bool = True) -> np.ndarray:
    with Engine.open({"model": {"gguf": str(path), "format": "fp16", "convert_cache": cached},
                      "backend": "reference"}) as e:
        return e.prefill(IDS)[0]


def cached_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.gguf"))


def test_written_once_then_read(tmp_path, cache, model, caplog):
    src = source(tmp_path / "m", model)
    want = logits(src, cached=False)
    assert not cache.exists()
    with caplog.at_level(logging.INFO, "strata_rt.weights.convert_cache"):
        assert np.array_equal(logits(src), want)
        (made,) = cached_files(cache)
        assert made.name.startswith("src.fp16.") and "converted to fp16 once" in caplog.text
        stamp = made.stat().st_mtime_ns
        caplog.clear()
        assert np.array_equal(logits(src), want)
        assert "from the conversion cache" in caplog.text
    assert made.stat().st_mtime_ns == stamp and cached_files(cache) == [made]
    assert not list(cache.glob(".*partial"))


def test_the_cached_file_carries_every_key_and_the_tokenizer(tmp_path, cache, model):
    src = source(tmp_path / "m", model)
    made = convert_cache.converted_path(src, _fp16())
    assert made is not None and made.parent == cache
    a, b = open_reader(src), open_reader(made)
    assert TokenizerVocab.from_gguf(made) == TokenizerVocab.from_gguf(src)
    assert b.value("tokenizer.chat_template") == "{{ messages }}"
    assert set(a.keys) <= set(b.keys) | {"general.alignment"}
    assert b.value("strata.converted.format") == "fp16"
    types = {t.name: t.tensor_type.name for t in b.tensors}
    assert {types[n] for n in types if n.endswith("_exps.weight")} == {"F16"}
    assert {t.name for t in a.tensors} == set(types)
    assert convert_cache.converted_path(made, _fp16()) is None  # nothing left to convert


def _fp16():
    from strata_rt.formats.registry import registry

    return registry()["fp16"]


def test_a_changed_source_is_converted_again(tmp_path, cache, model):
    src = source(tmp_path / "m", model)
    first = convert_cache.converted_path(src, _fp16())
    other = Qwen3Model.synthetic(SPEC, 6, "q2_blob")
    os.unlink(src)
    source(tmp_path / "m", other)
    second = convert_cache.converted_path(src, _fp16())
    assert first != second and cached_files(cache) == sorted([first, second])
    assert np.array_equal(logits(src), logits(src, cached=False))


def test_a_file_that_is_not_ours_is_left_alone(tmp_path, cache, model):
    src = source(tmp_path / "m", model)
    key = convert_cache.source_key(open_reader(src), _fp16())
    cache.mkdir()
    theirs = cache / f"src.fp16.{key}.gguf"
    theirs.write_bytes(b"my notes, not a GGUF")
    assert convert_cache.converted_path(src, _fp16()) is None
    assert theirs.read_bytes() == b"my notes, not a GGUF"
    assert np.array_equal(logits(src), logits(src, cached=False))
    assert theirs.read_bytes() == b"my notes, not a GGUF"


def test_a_damaged_conversion_of_ours_is_redone(tmp_path, cache, model):
    src = source(tmp_path / "m", model)
    made = convert_cache.converted_path(src, _fp16())
    assert made is not None
    whole = made.read_bytes()
    made.write_bytes(whole[: len(whole) // 2])
    assert convert_cache.converted_path(src, _fp16()) == made
    assert made.read_bytes() == whole


def test_no_room_or_no_folder_converts_in_memory(tmp_path, cache, model, monkeypatch, caplog):
    src = source(tmp_path / "m", model)
    want = logits(src, cached=False)
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the folder would be")
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(logits(src), want)
    assert "cannot use the conversion cache" in caplog.text
    cache.unlink()
    monkeypatch.setattr(convert_cache.shutil, "disk_usage",
                        lambda p: type("U", (), {"free": 1 << 20})())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(logits(src), want)
    assert "GiB free; converting in memory" in caplog.text and not cached_files(cache)


def test_a_split_source_converts_to_one_file(tmp_path, cache, model):
    src = source(tmp_path / "s", model, split_max_tensors=9)
    assert src.name == "src-00001-of-00003.gguf"
    made = convert_cache.converted_path(src, _fp16())
    assert made is not None and not open_reader(made).shards
    assert np.array_equal(logits(src), logits(src, cached=False))


def test_a_model_read_from_a_gguf_is_written_with_its_tokenizer(tmp_path, model):
    """write_qwen3_gguf of a model read from a file keeps the file's tokenizer keys, with
    their types (the chat template included)."""
    from strata_rt.models.qwen3 import read_qwen3_gguf

    src = source(tmp_path / "m", model)
    back = write_qwen3_gguf(tmp_path / "again.gguf", read_qwen3_gguf(src, "fp16"))
    a, b = open_reader(src), open_reader(back)
    assert TokenizerVocab.from_gguf(back) == TokenizerVocab.from_gguf(src)
    for name, kv in a.keys.items():
        if name.startswith("tokenizer."):
            assert (b.keys[name].type, b.keys[name].elem_type) == (kv.type, kv.elem_type)
            assert b.value(name) == a.value(name)


def test_a_nan_is_refused_as_in_memory_and_nothing_is_written(tmp_path, cache, model):
    from strata_rt.errors import GGUFError

    gate = np.stack([model.moe.dequantized(1, e)[0] for e in range(4)]).astype(np.float32)
    gate[2, 3, 4] = np.nan
    src = source(tmp_path / "n", model, tensors={"blk.1.ffn_gate_exps.weight": (gate, None)})
    msgs = []
    for cached in (False, True):
        with pytest.raises(GGUFError) as e:
            logits(src, cached)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "NaN or Inf in the weights of 1 expert(s): expert 2" in msgs[0]
    assert not cache.exists() or not list(cache.iterdir())
