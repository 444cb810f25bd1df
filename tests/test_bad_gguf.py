"""Bad GGUF files: NaN/Inf in what the engine reads, truncated files, directories, missing or
misshapen expert tensors. Each is one GGUFError naming the file, tensor, layer and expert, the
same exit code from `strata run` and `strata inspect`, and never a traceback or a numpy
message."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from strata_rt.cli import main
from strata_rt.errors import GGUFError
from strata_rt.weights.gguf_file.gguf_checks import F16_SCALES, bad_counts, dequantizable
from strata_rt.weights.gguf_file.gguf_io import scan_moe, tensor_names, write_moe_gguf
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore

SPEC = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=4, top_k=2)
Q = GGMLQuantizationType
NAN16 = struct.pack("<H", 0x7E00)
NUMPY_WORDS = ("reshape", "out of bounds", "divisor", "mmap", "dtype", "axis")


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.synthetic(SPEC, 21)


@pytest.fixture
def good(tmp_path, model) -> Path:
    return write_moe_gguf(tmp_path / "m.gguf", model)


def poke(path: Path, tensor: str, at: int, data: bytes) -> None:
    """Overwrites bytes of `tensor` in the file, `at` bytes into its data."""
    ref = scan_moe(path).tensors[tensor]
    assert 0 <= at and at + len(data) <= ref.nbytes
    with open(path, "r+b") as f:
        f.seek(ref.offset + at)
        f.write(data)


def iq3_d(path: Path, layer: int, part: str, expert: int, block: int) -> None:
    """NaN into the fp16 d of one 98-byte IQ3_XXS block of one expert."""
    ref = scan_moe(path).tensors[tensor_names(layer)[part]]
    poke(path, ref.name, expert * (ref.nbytes // ref.shape[0]) + block * 98, NAN16)


def load(path: Path, fmt: str = "iq3_xxs") -> ExpertStore:
    return ExpertStore(Model.from_gguf(path, fmt))


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not any(w in err for w in NUMPY_WORDS), err
    return code, err


def run_config(tmp_path: Path, gguf: Path) -> str:
    doc = {"model": {"gguf": str(gguf)}, "format": "iq3_xxs", "backend": "reference",
           "expert_cache": 0, "prompts": [3]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# ---------------------------------------------------------------------------- NaN / Inf
def test_nan_in_the_router_names_tensor_layer_and_expert(good):
    poke(good, "blk.1.ffn_gate_inp.weight", (2 * 256 + 5) * 4, struct.pack("<f", np.nan))
    with pytest.raises(GGUFError) as e:
        Model.from_gguf(good, "iq3_xxs")
    msg = str(e.value)
    assert str(good) in msg and "tensor blk.1.ffn_gate_inp.weight (layer 1, router)" in msg
    assert "expert 2 (column 5)" in msg


def test_inf_in_a_norm_names_tensor_layer_and_column(good):
    poke(good, "blk.0.ffn_norm.weight", 7 * 4, struct.pack("<f", -np.inf))
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_norm\.weight \(layer 0, norm\): "
                                        r"1 NaN or Inf value\(s\), at column\(s\) 7"):
        Model.from_gguf(good, "iq3_xxs")


def test_nan_iq3_block_scale_names_tensor_layer_and_expert(good, model):
    iq3_d(good, 1, "down", expert=3, block=10)
    with pytest.raises(GGUFError) as e:
        load(good)
    msg = str(e.value)
    assert "tensor blk.1.ffn_down_exps.weight (layer 1)" in msg
    assert "fp16 block scale d" in msg and "1 expert(s): expert 3 (1 of 256)" in msg
    # the same scale caught when one expert is read on its own, and on conversion to fp16
    with pytest.raises(GGUFError, match="expert 3"):
        Model.from_gguf(good, "iq3_xxs").expert_blob(1, 3)
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_down_exps\.weight \(layer 1\)"):
        load(good, "fp16")
    Model.from_gguf(good, "iq3_xxs").expert_blob(1, 2)  # its neighbours are fine


@pytest.mark.parametrize("fmt", ["iq3_xxs", "fp16"])
def test_inf_in_f16_expert_weights(tmp_path, model, fmt):
    """F16 experts: copied raw into fp16, converted into iq3_xxs; rejected either way."""
    w = np.random.default_rng(0).standard_normal((4, 256, 256)).astype(np.float16) * 0.05
    w[2, 100, 7] = np.inf
    path = write_moe_gguf(tmp_path / "f.gguf", model,
                          tensors={"blk.0.ffn_up_exps.weight": (w, None)})
    with pytest.raises(GGUFError) as e:
        load(path, fmt)
    assert "tensor blk.0.ffn_up_exps.weight (layer 0): NaN or Inf in the weights of 1 " \
           "expert(s): expert 2 (1 of 65,536)" in str(e.value)


def test_nan_q8_0_scale(tmp_path, model):
    w = np.random.default_rng(1).standard_normal((4, 256, 256)).astype(np.float32)
    raw = gguf_quantize(w, Q.Q8_0)
    # expert 2 (2,048 blocks of 34 bytes each), block 3
    raw.reshape(-1, 34)[2 * 2048 + 3, :2] = np.frombuffer(NAN16, np.uint8)
    path = write_moe_gguf(tmp_path / "q.gguf", model,
                          tensors={"blk.1.ffn_gate_exps.weight": (raw, Q.Q8_0)})
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_gate_exps\.weight \(layer 1\): NaN or "
                                        r"Inf in the fp16 block scale d of 1 expert\(s\): "
                                        r"expert 2 \(1 of 2,048\)"):
        load(path)


@pytest.mark.parametrize("qt", sorted(F16_SCALES))
def test_scale_table_points_at_the_scales_gguf_dequantizes_with(qt):
    """Each entry of F16_SCALES is a field the gguf package multiplies by: NaN there makes the
    block's values NaN, fp16 1.0 there leaves them finite."""
    if not dequantizable(qt):
        pytest.skip(f"the gguf package has no dequantizer for {Q(qt).name}")
    _, size = GGML_QUANT_SIZES[Q(qt)]
    blocks = np.random.default_rng(qt).integers(0, 256, (4, size), dtype=np.uint8)
    one = np.frombuffer(struct.pack("<e", 1.0), np.uint8)
    for off in F16_SCALES[qt]:
        blocks[:, off: off + 2] = one
    counts, per, _ = bad_counts(blocks, qt, 2, size)
    assert per == 2 and counts.tolist() == [0, 0]
    assert np.isfinite(dequantize(blocks, Q(qt))).all()
    for off in F16_SCALES[qt]:
        poisoned = blocks.copy()
        poisoned[3, off: off + 2] = np.frombuffer(NAN16, np.uint8)
        assert bad_counts(poisoned, qt, 2, size)[0].tolist() == [0, 1]
        vals = dequantize(poisoned, Q(qt)).reshape(4, -1)
        assert np.isfinite(vals[:3]).all() and not np.isfinite(vals[3]).all()


def test_types_without_a_scale_entry_are_dequantized_and_checked(tmp_path, model, capsys):
    """IQ1_M keeps its fp16 d in the top nibbles of its four scale words: no F16_SCALES entry,
    so the check dequantizes it."""
    assert 29 not in F16_SCALES
    blocks = np.random.default_rng(5).integers(0, 256, (4, 256, 256 // 256, 56), np.uint8)
    blocks[..., 49:56:2] &= 0x0F               # d = 0: finite
    blocks[1, 17, 0, 53] |= 0xE0                # d = 0x7E00 (NaN) in one block of expert 1
    blocks[1, 17, 0, 55] |= 0x70
    raw = blocks.reshape(4, 256, 56)
    path = write_moe_gguf(tmp_path / "m1.gguf", model,
                          tensors={"blk.0.ffn_down_exps.weight": (raw, Q.IQ1_M)})
    code, err = cli(["inspect", str(path)], capsys)
    assert code == GGUFError.exit_code
    assert ("tensor blk.0.ffn_down_exps.weight (layer 0): NaN or Inf in the dequantized "
            "weights of 1 expert(s): expert 1") in err
    with pytest.raises(GGUFError, match=r"dequantized weights of 1 expert\(s\): expert 1"):
        load(path)


def test_run_and_inspect_reject_the_same_file_with_the_same_code(tmp_path, good, capsys):
    iq3_d(good, 0, "gate", expert=1, block=0)
    iq3_d(good, 1, "up", expert=0, block=5)
    poke(good, "blk.1.ffn_norm.weight", 0, struct.pack("<f", np.nan))
    code_run, err = cli(["run", run_config(tmp_path, good)], capsys)
    assert code_run == GGUFError.exit_code
    assert "blk.1.ffn_norm.weight (layer 1, norm)" in err
    code, err = cli(["inspect", str(good)], capsys)
    assert code == code_run
    assert "3 problems" in err                         # every problem, not the first
    for where in ("blk.1.ffn_norm.weight (layer 1, norm)",
                  "blk.0.ffn_gate_exps.weight (layer 0)", "expert 1 (1 of 256)",
                  "blk.1.ffn_up_exps.weight (layer 1)", "expert 0 (1 of 256)"):
        assert where in err
    good2 = write_moe_gguf(tmp_path / "ok.gguf", Model.synthetic(SPEC, 3))
    code, _ = cli(["inspect", str(good2)], capsys)
    assert code == 0


def test_run_names_a_bad_expert_scale(tmp_path, good, capsys):
    iq3_d(good, 1, "gate", expert=2, block=3)
    code, err = cli(["run", run_config(tmp_path, good)], capsys)
    assert code == GGUFError.exit_code
    assert "blk.1.ffn_gate_exps.weight (layer 1)" in err and "expert 2" in err


# ---------------------------------------------------------------------------- structure
def test_inspect_lists_missing_and_misshapen_expert_tensors(tmp_path, model, capsys):
    path = write_moe_gguf(tmp_path / "s.gguf", model, omit=["blk.1.ffn_up_exps.weight"],
                          tensors={"blk.0.ffn_down_exps.weight":
                                   (np.zeros((4, 256, 128), np.float32), None)})
    code, err = cli(["inspect", str(path)], capsys)
    assert code == GGUFError.exit_code
    assert "tensor blk.1.ffn_up_exps.weight is missing" in err
    assert "tensor blk.0.ffn_down_exps.weight has shape [4, 256, 128]" in err
    code_run, err = cli(["run", run_config(tmp_path, path)], capsys)
    assert code_run == code and "blk.1.ffn_up_exps.weight is missing" in err


def test_a_type_nothing_reads_is_a_problem_for_inspect_and_run(tmp_path, model, capsys):
    path = write_moe_gguf(tmp_path / "i.gguf", model, tensors={
        "blk.1.ffn_gate_exps.weight": (np.zeros((4, 256, 256), np.int32), None)})
    code, err = cli(["inspect", str(path)], capsys)
    assert code == GGUFError.exit_code and "blk.1.ffn_gate_exps.weight has type I32" in err
    code_run, err = cli(["run", run_config(tmp_path, path)], capsys)
    assert code_run == code and "blk.1.ffn_gate_exps.weight has type I32" in err


def test_truncated_file_names_tensor_and_bytes(tmp_path, good, capsys):
    ref = scan_moe(good).tensors["blk.1.ffn_gate_exps.weight"]
    cut = ref.offset + 1000
    data = good.read_bytes()
    good.write_bytes(data[:cut])
    want = (f"the file is truncated: tensor blk.1.ffn_gate_exps.weight needs bytes "
            f"{ref.offset:,}..{ref.offset + ref.nbytes:,} ({ref.nbytes:,} bytes); the file "
            f"has {cut:,} bytes")
    with pytest.raises(GGUFError) as e:
        Model.from_gguf(good, "iq3_xxs")
    assert want in str(e.value) and "blk.1.ffn_down_exps.weight" in str(e.value)
    code, err = cli(["inspect", str(good)], capsys)
    assert code == GGUFError.exit_code and want in err


def test_every_cut_point_gives_a_clear_message(tmp_path, good):
    data = good.read_bytes()
    cut_file = tmp_path / "cut.gguf"
    points = sorted({*range(0, 2000, 7), *range(2000, len(data), 9973), len(data) - 1})
    for cut in points:
        cut_file.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as e:
            Model.from_gguf(cut_file, "iq3_xxs")
        msg = str(e.value)
        assert not any(w in msg for w in NUMPY_WORDS), (cut, msg)
        assert ("truncated" in msg or "cut short" in msg or "empty" in msg
                or "magic" in msg), (cut, msg)


def test_a_directory_is_called_a_directory(tmp_path, capsys):
    with pytest.raises(GGUFError, match="is a directory; expected a GGUF file"):
        Model.from_gguf(tmp_path, "iq3_xxs")
    code, err = cli(["inspect", str(tmp_path)], capsys)
    assert code == GGUFError.exit_code and "is a directory" in err
