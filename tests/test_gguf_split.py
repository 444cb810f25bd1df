"""Split GGUFs (<model>-00001-of-0000N.gguf ...) written by our writer read as one model: the
same tensors and the same reference-backend logits as the unsplit file; a later shard names
the first; a missing shard, a shard of another split or model, a tensor in two shards, a
folder in a shard's place are each one GGUFError (exit 1 from `strata inspect` and `run`); a
damaged tensor of a later shard is named with that shard, and a tensor whose name is damaged
there with the shards read (and that shard)."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from strata_rt.engine import Engine
from strata_rt.errors import GGUFError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf
from strata_rt.weights.gguf_file.gguf_header import parse
from strata_rt.weights.gguf_file.gguf_io import open_reader, scan_moe
from tests._gguf_bytes import Doc
from tests.test_hostile_gguf import cli

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                 ffn=256, n_experts=4, top_k=2, context=256)
IDS = np.array([5, 17, 299, 0, 42, 42, 7, 130])
U16 = 2


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 3, "fp16")


@pytest.fixture(scope="module")
def files(tmp_path_factory, model) -> tuple[Path, Path]:
    """(the unsplit file, the first of 3 shards of the same model)."""
    d = tmp_path_factory.mktemp("split")
    return (write_qwen3_gguf(d / "whole.gguf", model),
            write_qwen3_gguf(d / "m.gguf", model, split_max_tensors=10))


def shard_dir(tmp_path: Path, first: Path) -> Path:
    """A copy of the 3 shards in tmp_path (a test edits its own)."""
    for i in (1, 2, 3):
        shutil.copy(first.with_name(f"m-0000{i}-of-00003.gguf"), tmp_path)
    return tmp_path / "m-00001-of-00003.gguf"


def test_the_writer_names_shards_as_gguf_split(files):
    _, first = files
    assert first.name == "m-00001-of-00003.gguf"
    assert sorted(p.name for p in first.parent.glob("m-*.gguf")) == [
        f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_same_tensors_as_the_unsplit_file(files):
    whole, first = files
    a, b = open_reader(whole), open_reader(first)
    assert len(b.shards) == 3 and b.shards[0] == first and not a.shards
    assert {t.file for t in b.tensors} == {str(s) for s in b.shards}
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert ta.keys() == tb.keys()
    for name, t in ta.items():
        assert t.shape == tb[name].shape and t.tensor_type == tb[name].tensor_type
        assert np.array_equal(t.data, tb[name].data), name
    ma, mb = scan_moe(whole), scan_moe(first)
    assert ma.dims == mb.dims and np.array_equal(ma.router, mb.router)


def test_same_reference_logits_as_the_unsplit_file(files):
    whole, first = files
    out = []
    for path in (whole, first):
        with Engine.open({"model": {"gguf": str(path), "format": "fp16"},
                          "backend": "reference", "prefill": 4}) as engine:
            logits, _ = engine.prefill(IDS, all_logits=True)
            out.append(logits)
    assert np.array_equal(out[0], out[1])


def test_a_later_shard_names_the_first(files):
    _, first = files
    second = first.with_name("m-00002-of-00003.gguf")
    with pytest.raises(GGUFError) as e:
        open_reader(second)
    assert str(e.value) == (f"{second}: this file is shard 2 of 3 of a split GGUF; give the "
                            f"first shard, {first} (strata_rt finds the other shards beside it)")


def test_a_later_shard_without_the_first_says_so(files, tmp_path):
    _, first = files
    second = tmp_path / "m-00002-of-00003.gguf"
    shutil.copy(first.with_name(second.name), second)
    with pytest.raises(GGUFError) as e:
        open_reader(second)
    assert str(e.value).endswith(f"give the first shard, {tmp_path / first.name} (it is not "
                                 "beside this one: every shard must be in one folder)")


def test_inspect_shows_the_shards(files, capsys):
    from strata_rt.cli import main

    _, first = files
    assert main(["inspect", str(first)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert "split GGUF: 3 shards, 27 tensors, read as one model" in out
    for i in (1, 2, 3):
        assert f"| m-0000{i}-of-00003.gguf |" in out


def _set_u16(doc: Doc, key: str, v: int) -> Doc:
    return doc.set(key, U16, payload=struct.pack("<H", v))


def _rename_tensor(doc: Doc, old: str, new: str) -> Doc:
    doc.tensor(old)[0] = new
    return doc


def _hostile(tmp_path: Path, first: Path, case: str) -> tuple[Path, str]:
    path = shard_dir(tmp_path, first)
    second, third = (path.with_name(f"m-0000{i}-of-00003.gguf") for i in (2, 3))
    if case == "missing shard":
        third.unlink()
        return path, ("a split GGUF of 3 shards: 1 shard is missing beside it "
                      "(m-00003-of-00003.gguf)")
    if case == "folder in a shard's place":
        third.unlink()
        third.mkdir()
        return path, f"shard 3 of 3, {third}: is a directory"
    if case == "wrong count":
        _set_u16(Doc.of(second), "split.count", 4).write(second)
        return path, ("shard m-00002-of-00003.gguf says split.count = 4, the first shard 3: "
                      "the shards are of different splits")
    if case == "wrong number":
        _set_u16(Doc.of(second), "split.no", 2).write(second)
        return path, "shard m-00002-of-00003.gguf says split.no = 2 (shard 3); its name says"
    if case == "duplicate tensor":
        d2, d3 = Doc.of(second), Doc.of(third)
        _rename_tensor(d3, d3.tensors[0][0], d2.tensors[0][0]).write(third)
        return path, (f"tensor {d2.tensors[0][0]} is in shard m-00002-of-00003.gguf and in "
                      "shard m-00003-of-00003.gguf")
    if case == "shard of another model":
        other = Qwen3Model.synthetic(Qwen3Spec(**{**SPEC.__dict__, "n_layers": 3}), 4, "fp16")
        d = tmp_path / "other"
        d.mkdir()
        write_qwen3_gguf(d / "m.gguf", other, split_max_tensors=14)
        shutil.copy(d / "m-00002-of-00003.gguf", second)
        return path, "says split.tensors.count = 39, the first shard 27: shards of different"
    if case == "whole file in a shard's place":
        shutil.copy(first.with_name("whole.gguf"), third)
        return path, ("shard m-00003-of-00003.gguf carries no split.count > 1: it is a whole "
                      "GGUF, not shard 3 of 3")
    raise AssertionError(case)


CASES = ["missing shard", "folder in a shard's place", "wrong count", "wrong number",
         "duplicate tensor", "shard of another model", "whole file in a shard's place"]


@pytest.mark.parametrize("case", CASES)
def test_hostile_shards_are_refused_by_name(files, tmp_path, capsys, case):
    _, first = files
    path, want = _hostile(tmp_path, first, case)
    with pytest.raises(GGUFError) as e:
        open_reader(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and want in msg, msg
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and want in err, err


def test_a_shard_of_another_model_with_the_same_tensor_count_is_refused(files, tmp_path):
    """Same split, same tensor names and count, other keys: a later shard that carries keys
    the first shard has must agree with them."""
    _, first = files
    path = shard_dir(tmp_path, first)
    second = path.with_name("m-00002-of-00003.gguf")
    d = Doc.of(second)
    d.keys.append(["general.architecture", 8, struct.pack("<Q", 5) + b"llama"])
    d.write(second)
    with pytest.raises(GGUFError) as e:
        open_reader(path)
    assert ("shard m-00002-of-00003.gguf: key general.architecture differs from the first "
            "shard's: a shard of another model") in str(e.value)


def test_an_output_onto_a_later_shard_is_refused(files, tmp_path, capsys):
    """A run's --json written over shard 2 would destroy the model: refused before the run,
    as an output onto the first shard is."""
    import yaml

    from strata_rt.cli import main

    _, first = files
    path = shard_dir(tmp_path, first)
    second = path.with_name("m-00002-of-00003.gguf")
    before = second.read_bytes()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"gguf": str(path)}, "prompts": [4]}))
    assert main(["run", str(cfg), "--backend", "reference", "--json", str(second)]) == 2
    err = capsys.readouterr().err
    assert "shard 2 of the model's GGUF" in err, err
    assert second.read_bytes() == before


def _in_shard(path: Path, shard: int, ggml_type: int) -> tuple[Path, str, int]:
    """(the shard's file, the name and the absolute data offset of its first tensor of the
    type) in a copy of the split model whose first shard is `path`."""
    file = path.with_name(f"m-0000{shard}-of-00003.gguf")
    t = next(t for t in parse(file).tensors if int(t.tensor_type) == ggml_type)
    return file, t.name, t.offset


@pytest.mark.parametrize("shard", [2, 3])
def test_a_damaged_tensor_names_the_shard_it_lies_in(files, tmp_path, capsys, shard):
    """A NaN in a later shard's weights, or a tensor of the wrong shape there, was reported
    as a problem of the first shard, the model's file: the damaged file is named."""
    from strata_rt.models.qwen3.gguf_full import read_qwen3_gguf

    _, first = files
    path = shard_dir(tmp_path, first)
    file, name, offset = _in_shard(path, shard, 0)  # an F32 tensor: a norm's weights
    raw = bytearray(file.read_bytes())
    raw[offset: offset + 4] = struct.pack("<f", float("nan"))
    file.write_bytes(bytes(raw))
    want = f"tensor {name} in shard {file.name}: NaN or Inf in the "
    with pytest.raises(GGUFError, match=re.escape(want)):
        read_qwen3_gguf(path)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and want in err, err
    d = Doc.of(file)  # then a shape the keys do not give, in the same shard
    d.tensor(name)[1] = [d.tensor(name)[1][0] // 2 or 1, *d.tensor(name)[1][1:]]
    d.write(file)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and f"tensor {name} in shard {file.name} has shape [" in err, err


def test_a_tensor_of_the_first_shard_is_named_as_before(files, tmp_path, capsys):
    _, first = files
    path = shard_dir(tmp_path, first)
    _, name, offset = _in_shard(path, 1, 0)
    raw = bytearray(path.read_bytes())
    raw[offset: offset + 4] = struct.pack("<f", float("inf"))
    path.write_bytes(bytes(raw))
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and f"{path}: tensor {name} (layer 0" in err and "NaN or Inf" in err, err
    assert "in shard" not in err


@pytest.mark.parametrize("new", ["blk.1.attn_v.weighX", "zzzz.weight"])
def test_a_tensor_name_damaged_in_a_later_shard_names_the_shards(files, tmp_path, capsys,
                                                                  new):
    """A tensor whose name is damaged in shard 3 was `tensor X is missing`, naming no shard:
    the shards read are named, and the one holding a tensor of a name close to it."""
    from strata_rt.models.qwen3.gguf_full import read_qwen3_gguf

    _, first = files
    path = shard_dir(tmp_path, first)
    third = path.with_name("m-00003-of-00003.gguf")
    _rename_tensor(Doc.of(third), "blk.1.attn_v.weight", new).write(third)
    want = ("; the 3 shards read (m-00001-of-00003.gguf, m-00002-of-00003.gguf, "
            "m-00003-of-00003.gguf) hold no tensor of that name")
    near = f"; shard m-00003-of-00003.gguf holds a tensor named {new}: is that its name"
    with pytest.raises(GGUFError) as e:
        read_qwen3_gguf(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: tensor blk.1.attn_v.weight is missing (qwen3moe.block_"
                          "count = 2 says layer 1 exists)") and want in msg, msg
    assert (near in msg) == (new != "zzzz.weight"), msg
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and f"tensor blk.1.attn_v.weight is missing{want}" in err, err
    assert (near in err) == (new != "zzzz.weight"), err
    # a sibling's name (attn_k, attn_q_norm: in every layer) is never offered in its place
    assert "blk.1.attn_k.weight" not in err and "blk.0.attn_v.weight" not in err, err


def test_a_damaged_name_of_an_moe_tensor_names_the_shard(files, tmp_path):
    """Through the MoE layers' scan too (its problems list)."""
    _, first = files
    path = shard_dir(tmp_path, first)
    _rename_tensor(Doc.of(path), "blk.1.ffn_up_exps.weight", "blk.1.ffn_up_exps.weigh").write(
        path)
    with pytest.raises(GGUFError, match=re.escape(
            "tensor blk.1.ffn_up_exps.weight is missing (qwen3moe.block_count = 2 says layer 1 "
            "exists); the 3 shards read (") + ".*" + re.escape(
            "shard m-00001-of-00003.gguf holds a tensor named blk.1.ffn_up_exps.weigh")):
        scan_moe(path).raise_problems()
