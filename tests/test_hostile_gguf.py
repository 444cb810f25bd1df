"""Hostile GGUF headers: keys of the wrong type or out of range, counts and lengths past the
file, absurd dims, tensors sharing bytes or off the alignment, and model paths that are not
files. Each is one GGUFError naming the file and the problem, exit code 1 from `strata
inspect` and `strata run` alike, no traceback, no hang, and nothing allocated by a count the
file gives before it is checked against the file's size."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from strata_rt.cli import main
from strata_rt.errors import GGUFError
from strata_rt.weights.gguf_file.gguf_header import ARRAY, STRING
from strata_rt.weights.gguf_file.gguf_io import (
    MAX_PROBLEMS,
    problems_error,
    scan_moe,
    write_moe_gguf,
)
from strata_rt.weights.model import Model, MoESpec
from tests._cli import strata
from tests._gguf_bytes import BOOL, F32, I32, U8, U32, U64, Doc

SPEC = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=4, top_k=2)
A = "qwen3moe."
EPS = A + "attention.layer_norm_rms_epsilon"
NUMPY_WORDS = ("reshape", "out of bounds", "divisor", "mmap", "dtype", "axis", "Errno")


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> Doc:
    path = write_moe_gguf(tmp_path_factory.mktemp("good") / "m.gguf",
                          Model.synthetic(SPEC, 21))
    return Doc.of(path)


def key(name: str, t: int, v=None, elem=None, payload=None) -> Callable[[Doc], Doc]:
    return lambda d: d.set(name, t, v, elem, payload=payload)


def tensor(name: str, field: int, value) -> Callable[[Doc], Doc]:
    def change(d: Doc) -> Doc:
        entry = d.tensor(name)
        entry[field] = value(entry[field]) if callable(value) else value
        return d
    return change


def same_bytes(d: Doc) -> Doc:
    """Layer 1's gate tensor pointing at layer 0's bytes."""
    d.tensor("blk.1.ffn_gate_exps.weight")[3] = d.tensor("blk.0.ffn_gate_exps.weight")[3]
    return d


def duplicate_tensor(d: Doc) -> Doc:
    name, dims, t, _ = d.tensor("blk.0.ffn_norm.weight")
    d.tensors.append([name, list(dims), t, len(d.data) - 1024])
    return d


def duplicate_key(d: Doc) -> Doc:
    d.keys.append([A + "expert_count", U32, struct.pack("<I", 4)])
    return d


#: id -> (change, text the message holds); the message must also name the file
CASES: dict[str, tuple[Callable[[Doc], Doc], str]] = {
    "block_count NaN": (key(A + "block_count", F32, math.nan),
                        "key qwen3moe.block_count = nan (float32); expected an integer "
                        "1..65,536"),
    "block_count inf": (key(A + "block_count", F32, math.inf), "block_count = inf (float32)"),
    "block_count 2^63": (key(A + "block_count", U64, 2**63),
                         "block_count = 9223372036854775808 (uint64); expected an integer"),
    "expert_count 2^63": (key(A + "expert_count", U64, 2**63),
                          "key qwen3moe.expert_count = 9223372036854775808 (uint64)"),
    "block_count negative": (key(A + "block_count", I32, -1), "block_count = -1 (int32)"),
    "block_count bool": (key(A + "block_count", BOOL, True), "block_count = True (bool)"),
    "block_count beyond the layers": (
        key(A + "block_count", U32, 40_000),
        "key qwen3moe.block_count = 40,000, but the file holds tensors of layers blk.0 .. "
        "blk.1 (2 layers)"),
    "block_count 999,992": (key(A + "block_count", U32, 999_992),
                            "block_count = 999992 (uint32); expected an integer 1..65,536"),
    "block_count short of the layers": (key(A + "block_count", U32, 1), "block_count = 1, but"),
    "epsilon string": (key(EPS, STRING, "1e-6"),
                       f"key {EPS} = '1e-6' (string); expected a finite number [1e-12, 0.1]"),
    "epsilon array": (key(EPS, ARRAY, [1e-6], F32),
                      f"key {EPS} = an array of float32 (1 value); expected a finite number"),
    "epsilon zero": (key(EPS, F32, 0.0), f"key {EPS} = 0.0 (float32)"),
    "epsilon one": (key(EPS, F32, 1.0), f"key {EPS} = 1.0 (float32)"),
    "epsilon NaN": (key(EPS, F32, math.nan), f"key {EPS} = nan (float32)"),
    "architecture uint32": (key("general.architecture", U32, 5),
                            "key general.architecture = 5 (uint32); expected a string"),
    "architecture of a million characters": (
        key("general.architecture", STRING, "q" * 1_000_000),
        "(1,000,000 characters); expected an architecture name such as 'qwen3moe'"),
    "a layer number that is not ASCII": (tensor("blk.0.ffn_norm.weight", 0,
                                                "blk.\u00b2.ffn_norm.weight"),
                                         "tensor blk.0.ffn_norm.weight is missing"),
    "architecture missing": (lambda d: d.drop("general.architecture"),
                             "key general.architecture is missing"),
    "ffn huge": (key(A + "expert_feed_forward_length", U64, 2**40),
                 "expert_feed_forward_length = 1099511627776 (uint64)"),
    "hidden unlike the tensors": (key(A + "embedding_length", U32, 512),
                                  "blk.0.ffn_gate_inp.weight has shape [4, 256]; expected "
                                  "[4, 512]"),
    "top_k above the experts": (key(A + "expert_used_count", U32, 9),
                                "expert_used_count = 9 exceeds qwen3moe.expert_count = 4"),
    "duplicate key": (duplicate_key, "key qwen3moe.expert_count appears twice"),
    "unknown value type": (key(A + "x", 42, payload=b""), "value type id 42"),
    "array of arrays": (key(A + "x", ARRAY, payload=struct.pack("<IQ", ARRAY, 1)),
                        "key qwen3moe.x is an array of arrays"),
    "array of 2^63": (key(A + "x", ARRAY, payload=struct.pack("<IQ", U8, 2**63)),
                      "claims 9,223,372,036,854,775,808 uint8 values"),
    "2^40 strings": (key(A + "x", ARRAY, payload=struct.pack("<IQ", STRING, 2**40)),
                     "claims 1,099,511,627,776 strings"),
    "5 million empty strings": (
        key(A + "x", ARRAY, payload=struct.pack("<IQ", STRING, 5_000_000)
            + bytes(8 * 5_000_000)),
        "key qwen3moe.x holds 5,000,000 strings, 5,000,000 with the array keys before it; "
        "strata_rt reads at most 4,194,304"),
    "string past the file": (key("general.name", STRING, payload=struct.pack("<Q", 2**60)),
                             "the string value of key general.name at byte"),
    "key name not UTF-8": (key(b"\xff\xfeoops", U32, 1), "is not valid UTF-8"),
    "bool byte 7": (key(A + "x", BOOL, 7), "key qwen3moe.x is a bool holding byte 7"),
    "alignment zero": (key("general.alignment", U32, 0),
                       "key general.alignment = 0; expected a power of two"),
    "alignment string": (key("general.alignment", STRING, "32"),
                         "key general.alignment is a string; GGUF stores it as uint32"),
    "two tensors on one byte range": (
        same_bytes, "tensors share bytes: tensor blk.0.ffn_gate_exps.weight (dims [256, 256, 4] "
                    "of IQ3_XXS, bytes"),
    "offset off the alignment": (tensor("blk.1.ffn_up_exps.weight", 3, lambda o: o + 2),
                                 "tensor blk.1.ffn_up_exps.weight starts at offset"),
    "absurd dims": (tensor("blk.0.ffn_down_exps.weight", 1, [256, 2**40, 4]),
                    "tensor blk.0.ffn_down_exps.weight has dims [256, 1099511627776, 4] of "
                    "IQ3_XXS"),
    "dims past 2^64": (tensor("blk.0.ffn_down_exps.weight", 1, [2**63, 2**63, 2**63]),
                       "IQ3_XXS: more than 2^64 bytes, more than the whole file"),
    "7 dims": (tensor("blk.0.ffn_norm.weight", 1, [1] * 7),
               "tensor blk.0.ffn_norm.weight (entry"),
    "0 dims": (tensor("blk.0.ffn_norm.weight", 1, []), "has 0 dimensions"),
    "a dim of 0": (tensor("blk.0.ffn_norm.weight", 1, [0]),
                   "tensor blk.0.ffn_norm.weight has dims [0]; every dimension must be at "
                   "least 1"),
    "unknown tensor type": (tensor("blk.1.ffn_norm.weight", 2, 99),
                            "tensor blk.1.ffn_norm.weight has type id 99"),
    "duplicate tensor": (duplicate_tensor,
                         "tensor blk.0.ffn_norm.weight appears twice in the tensor list"),
    "offset past the file": (tensor("blk.1.ffn_down_exps.weight", 3, 2**62),
                             "tensor blk.1.ffn_down_exps.weight starts at byte"),
    "version 1": (lambda d: setattr(d, "version", 1) or d, "GGUF version 1; strata_rt reads"),
    "big-endian": (lambda d: setattr(d, "version", 3 << 16) or d, "a big-endian GGUF file"),
}
#: counts in the fixed header: (tensor count, key count) -> message
COUNTS = {
    "tensor count 2^63": ({"n_tensors": 2**63},
                          "holds 9,223,372,036,854,775,808 tensors; strata_rt reads at most"),
    "key count 2^40": ({"n_keys": 2**40}, "1,099,511,627,776 keys; strata_rt reads at most"),
    "key count past the file": ({"n_keys": 60_000},
                                "its header is cut short or its keys count is wrong: it lists "
                                "60,000 keys"),
}


def hostile(doc: Doc, tmp_path: Path, case: str) -> tuple[Path, str]:
    if case in COUNTS:
        counts, want = COUNTS[case]
        return doc.write(tmp_path / "bad.gguf", **counts), want
    change, want = CASES[case]
    return change(doc.copy()).write(tmp_path / "bad.gguf"), want


def run_config(tmp_path: Path, gguf: Path) -> str:
    doc = {"model": {"gguf": str(gguf)}, "format": "iq3_xxs", "backend": "reference",
           "expert_cache": 0, "prompts": [3]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert not any(w in err for w in NUMPY_WORDS), err
    return code, err


ALL = sorted(CASES) + sorted(COUNTS)


@pytest.mark.parametrize("case", ALL)
def test_library_refuses_with_one_message(doc, tmp_path, case):
    path, want = hostile(doc, tmp_path, case)
    with pytest.raises(GGUFError) as e:
        Model.from_gguf(path, "iq3_xxs")
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and want in msg, msg
    assert len(msg.splitlines()) <= MAX_PROBLEMS + 2


@pytest.mark.parametrize("case", ALL)
def test_inspect_and_run_exit_1_naming_file_and_problem(doc, tmp_path, capsys, case):
    path, want = hostile(doc, tmp_path, case)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and err.startswith(f"strata inspect: {path}: ") and want in err, err
    code, err = cli(["run", run_config(tmp_path, path)], capsys)
    assert code == 1 and err.startswith(f"strata run: {path}: ") and want in err, err


def test_a_wrong_block_count_is_one_line_not_a_million(doc, tmp_path, capsys):
    for case in ("block_count beyond the layers", "block_count 999,992"):
        path, _ = hostile(doc, tmp_path, case)
        code, err = cli(["inspect", str(path)], capsys)
        assert code == 1 and len(err.splitlines()) == 1, err[:2000]


def test_problem_lists_are_capped(doc, tmp_path, capsys):
    d = doc.copy()
    for i in range(25):
        d.tensors.append([f"extra.{i}.weight", [32], 99, 0])
    code, err = cli(["inspect", str(d.write(tmp_path / "many.gguf"))], capsys)
    assert code == 1 and f"25 problems (the first {MAX_PROBLEMS}):" in err
    assert err.count("  - tensor extra.") == MAX_PROBLEMS and "  ... and 5 more" in err
    assert "extra.19.weight" in err and "extra.20.weight" not in err
    msg = str(problems_error(Path("m.gguf"), [f"p{i}" for i in range(999_990)]))
    assert len(msg.splitlines()) == MAX_PROBLEMS + 2 and "... and 999,970 more" in msg


def test_every_byte_flip_of_the_header_is_a_clear_message_or_a_good_file(doc, tmp_path):
    """Each header byte set to 0xFF in turn: the file opens, or fails with a GGUFError
    naming it; never another exception."""
    data = bytearray(doc.to_bytes())
    h_end = len(data) - len(doc.data)
    path = tmp_path / "flip.gguf"
    for at in range(0, h_end, 3):
        flipped = bytearray(data)
        flipped[at] = 0xFF
        path.write_bytes(flipped)
        try:
            scan_moe(path)
        except GGUFError as e:
            assert str(e).startswith(f"{path}: "), (at, str(e))


def test_a_stray_byte_in_an_unused_string_does_not_refuse_the_file(doc, tmp_path):
    path = doc.copy().set("general.name", STRING, b"caf\xe9").write(tmp_path / "n.gguf")
    assert scan_moe(path).problems == []


# ---------------------------------------------------------------------------- not files
def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "pipe.gguf")
    return tmp_path / "pipe.gguf"


def _loop(tmp_path: Path) -> Path:
    os.symlink(tmp_path / "b.gguf", tmp_path / "a.gguf")
    os.symlink(tmp_path / "a.gguf", tmp_path / "b.gguf")
    return tmp_path / "a.gguf"


def _dangling(tmp_path: Path) -> Path:
    os.symlink(tmp_path / "gone.gguf", tmp_path / "link.gguf")
    return tmp_path / "link.gguf"


NOT_FILES = {"FIFO": (_fifo, "is a FIFO (named pipe); expected a GGUF file"),
             "device": (lambda _: Path("/dev/null"), "is a character device; expected a GGUF"),
             "symlink loop": (_loop, "is a symlink loop"),
             "dangling symlink": (_dangling, "which does not exist; expected a GGUF file")}


@pytest.mark.parametrize("kind", sorted(NOT_FILES))
def test_a_path_that_is_not_a_file_is_named_and_never_read(tmp_path, capsys, kind):
    make, want = NOT_FILES[kind]
    path = make(tmp_path)
    with pytest.raises(GGUFError, match=r"^" + str(path).replace(".", r"\.") + ": "):
        scan_moe(path)
    with pytest.raises(GGUFError) as e:
        Model.from_gguf(path, "iq3_xxs")
    assert want in str(e.value)
    # inspect reads the file itself (exit 1, a GGUF problem); run meets it as a config key
    # (exit 2, named with the key, as every input path of a config is)
    for args, exit_code, named in ((["inspect", str(path)], 1, f"{path}: "),
                                   (["run", run_config(tmp_path, path)], 2,
                                    f"model.gguf: got '{path}'")):
        if kind == "FIFO":  # a fresh interpreter with a timeout: a FIFO read would hang
            r = strata(*args)
            code, err = r.returncode, r.stderr
            assert "Traceback" not in err
        else:
            code, err = cli(args, capsys)
        assert code == exit_code and named in err, err
        assert want.split("; expected")[0].split(" (")[0] in err or kind == "dangling symlink", err


def test_a_nul_in_a_config_model_path_is_named(tmp_path, capsys):
    code, err = cli(["run", run_config(tmp_path, Path("m\0.gguf"))], capsys)
    assert code == 2 and "model.gguf: got" in err and "a path cannot hold a NUL character" in err


def test_a_missing_file_is_called_missing(tmp_path, capsys):
    code, err = cli(["inspect", str(tmp_path / "absent.gguf")], capsys)
    assert code == 1 and "absent.gguf: no such GGUF file" in err
