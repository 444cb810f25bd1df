"""More hostile GGUFs: a subnormal epsilon, an edited alignment (every tensor read shifted),
a million bad tensor entries, names that forge message lines, NUL bytes in values, dims whose
product wraps in int64, and a shard of a split GGUF given without the others. Each is one
GGUFError naming the file and the problem, exit code 1 from `strata inspect` and `strata run`, no traceback."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from strata_rt.errors import GGUFError
from strata_rt.weights.gguf_file.gguf_header import parse
from strata_rt.weights.gguf_file.gguf_io import (
    MAX_PROBLEMS,
    problems_error,
    read_header,
    scan_moe,
    write_moe_gguf,
)
from strata_rt.weights.gguf_file.gguf_keys import check_keys
from strata_rt.weights.gguf_file.gguf_problems import Problems
from strata_rt.weights.model import Model
from tests._gguf_bytes import F32, F64, U32, Doc
from tests.test_hostile_gguf import EPS, SPEC, cli, run_config

STRING = 8
ESC = "\x1b[2K\r"


@pytest.fixture(scope="module")
def good_path(tmp_path_factory) -> Path:
    return write_moe_gguf(tmp_path_factory.mktemp("good") / "m.gguf", Model.synthetic(SPEC, 21))


@pytest.fixture(scope="module")
def doc(good_path) -> Doc:
    return Doc.of(good_path)


def header_end(d: Doc) -> int:
    """Where the header ends (the data section starts on the alignment after it)."""
    return len(Doc(d.keys, d.tensors, b"", d.version, 1).to_bytes())


def shifted(alignment: int) -> Callable[[Doc], Doc]:
    """general.alignment edited to `alignment` in a file laid out at 32, with a header whose
    end puts the data section elsewhere under the edited alignment than under 32."""
    def change(d: Doc) -> Doc:
        for n in range(1, 64):
            d.set("general.name", STRING, "x" * n)
            d.set("general.alignment", U32, alignment)
            end = header_end(d)
            if (-end) % alignment != (-end) % 32:
                return d
        raise AssertionError("no name length moves the data section")
    return change


def key(name: str, t: int, v=None) -> Callable[[Doc], Doc]:
    return lambda d: d.set(name, t, v)


def tensor_name(i: int, raw: bytes) -> Callable[[Doc], Doc]:
    def change(d: Doc) -> Doc:
        d.tensors[i][0] = raw
        return d
    return change


def appended(d: Doc) -> Doc:
    d.data += bytes(64)
    return d


def split(count: int, no: int | None = 0, arch: bool = True) -> Callable[[Doc], Doc]:
    def change(d: Doc) -> Doc:
        d.set("split.count", 2, payload=struct.pack("<H", count))
        if no is not None:
            d.set("split.no", 2, payload=struct.pack("<H", no))
        return d if arch else d.drop("general.architecture")
    return change


#: id -> (change, text the message holds, file name); the message also names the file
CASES: dict[str, tuple[Callable[[Doc], Doc], str, str]] = {
    "epsilon 5e-324 (a float64 subnormal)": (
        key(EPS, F64, 5e-324),
        f"key {EPS} = 5e-324 (float64); expected a finite number [1e-12, 0.1]", "m.gguf"),
    "epsilon 1e-45 (a float32 subnormal)": (key(EPS, F32, 1e-45), f"key {EPS} = 1e-45 (float32)",
                                            "m.gguf"),
    "epsilon 0.5": (key(EPS, F32, 0.5), f"key {EPS} = 0.5 (float32)", "m.gguf"),
    "rope scale_linear 1e-300": (key("qwen3moe.rope.scale_linear", F64, 1e-300),
                                 "key qwen3moe.rope.scale_linear = 1e-300 (float64); expected a "
                                 "finite number [0.001, 1e+06]", "m.gguf"),
    "alignment 32 edited to 1": (shifted(1), "the data section does not start where the "
                                 "alignment (1) puts it", "m.gguf"),
    "alignment 32 edited to 16": (shifted(16), "where the alignment (16) puts it", "m.gguf"),
    "alignment 32 edited to 64": (shifted(64), "with the file's alignment (64) the data "
                                  "section starts at byte", "m.gguf"),
    "alignment 2^31": (key("general.alignment", U32, 1 << 31),
                       "with key general.alignment = 2,147,483,648 its data section would "
                       "start at byte 2,147,483,648, past the end of the file", "m.gguf"),
    "bytes appended": (appended, "the file holds 64 bytes past its last tensor", "m.gguf"),
    "tensor name not UTF-8": (tensor_name(3, b"blk.0.\xff\xfe.weight"),
                              "the name of tensor 3 at byte", "m.gguf"),
    "tensor name with a terminal escape": (
        tensor_name(2, b"blk.0.x\x1b[2K\r - fake line"),
        r"holds a control character ('blk.0.x\x1b[2K\r - fake line'); names are printable",
        "m.gguf"),
    "tensor name with a newline": (tensor_name(0, b"blk.0.x\nstrata run: ok"),
                                   r"('blk.0.x\nstrata run: ok')", "m.gguf"),
    "tensor name of 100 bytes": (tensor_name(1, b"t" * 100),
                                 "is 100 bytes long ('tttt", "m.gguf"),
    "key name with a NUL": (key("general.na\0me", U32, 1), r"('general.na\x00me')", "m.gguf"),
    "NUL in the architecture": (key("general.architecture", STRING, "qwen3moe\0"),
                                r"key general.architecture = 'qwen3moe\x00'", "m.gguf"),
    "dims whose product wraps in int64 to the right size": (
        lambda d: d.tensor("blk.0.ffn_gate_exps.weight").__setitem__(1, [256, 256, 4 + 2**62])
        or d, "has dims [256, 256, 4611686018427387908] of IQ3_XXS: more than 2^64 bytes",
        "m.gguf"),
    "split shard 1 of 3 alone": (split(3), "a split GGUF of 3 shards: 2 shards are missing "
                                 "beside it (m-00002-of-00003.gguf, m-00003-of-00003.gguf); "
                                 "every shard, m-00001-of-00003.gguf .. m-00003-of-00003.gguf, "
                                 "must be in", "m-00001-of-00003.gguf"),
    "split shard 2 alone (no architecture)": (split(3, 1, arch=False),
                                              "this file is shard 2 of 3 of a split GGUF; give "
                                              "the first shard, ", "m-00002-of-00003.gguf"),
    "split shard without split.no": (split(2, None), "key split.count = 2 says this file is a "
                                     "shard of a split GGUF, but key split.no (which shard) is "
                                     "missing", "model.gguf"),
    "split first shard of a plain name": (split(2), "the first shard of a split GGUF of 2 "
                                          "shards (key split.count = 2) must be named "
                                          "<model>-00001-of-00002.gguf", "model.gguf"),
    "split.no past split.count": (split(2, 5), "key split.no = 5 but split.count = 2", "m.gguf"),
    "split.count a string": (key("split.count", STRING, "3"),
                             "key split.count = '3' (string); expected an integer 1..65,535",
                             "m.gguf"),
}


def hostile(doc: Doc, tmp_path: Path, case: str) -> tuple[Path, str]:
    change, want, name = CASES[case]
    return change(doc.copy()).write(tmp_path / name), want


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_refuses_with_one_message(doc, tmp_path, case):
    path, want = hostile(doc, tmp_path, case)
    with pytest.raises(GGUFError) as e:
        Model.from_gguf(path, "iq3_xxs")
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and want in msg, msg
    assert msg.isprintable() or all(line.isprintable() for line in msg.splitlines()), msg


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_and_run_exit_1(doc, tmp_path, capsys, case):
    path, want = hostile(doc, tmp_path, case)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and err.startswith(f"strata inspect: {path}: ") and want in err, err
    assert "\0" not in err and "\x1b" not in err
    code, err = cli(["run", run_config(tmp_path, path)], capsys)
    assert code == 1 and err.startswith(f"strata run: {path}: ") and want in err, err


def test_a_shifted_read_is_caught_before_it_decodes_to_nan(doc, tmp_path):
    """Without the end check the edited file opens: every offset is still on the alignment
    and the shifted bytes hold no NaN; only the file's length gives it away."""
    path, _ = hostile(doc, tmp_path, "alignment 32 edited to 1")
    h = parse(path)
    assert len(h.problems) == 1 and "bytes past its last tensor" in next(iter(h.problems))
    assert h.data_start % 32 and all((t.offset - h.data_start) % 32 == 0 for t in h.tensors)


def test_what_writers_produce_opens(doc, good_path, tmp_path):
    """The gguf package pads the last tensor to the alignment; a file cut right after the
    last tensor's bytes (no padding) reads the same; so does an epsilon of 1e-12 in float32,
    and a split GGUF of one shard."""
    h = parse(good_path)
    end = max(t.offset + t.n_bytes for t in h.tensors)
    assert h.size == end + (-end) % 32
    whole = scan_moe(good_path)
    d = doc.copy()
    d.data = d.data[:end - h.data_start]
    d.set(EPS, F32, 1e-12).set("split.count", 2, payload=struct.pack("<H", 1))
    cut = d.write(tmp_path / "cut.gguf")
    moe = scan_moe(cut)
    assert moe.problems == [] and moe.dims["rms_eps"] == 1e-12
    assert (moe.router == whole.router).all() and (moe.norm == whole.norm).all()
    aligned = doc.copy().set("general.alignment", U32, 32).write(tmp_path / "a32.gguf")
    assert read_header(aligned)[1] == read_header(good_path)[1]


def million_bad_tensors(n: int = 1_000_000) -> bytes:
    """A header of n tensor entries of type id 99 (each 8 + 12 + 4 + 8 + 4 + 8 bytes)."""
    entries = [b"".join((struct.pack("<Q", 12), b"t%010d" % i + b".", struct.pack(
        "<IQIQ", 1, 32, 99, 0))) for i in range(n)]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(entries), 0)
    body = head + b"".join(entries)
    return body + bytes(-len(body) % 32 + 32)


def test_a_million_bad_tensor_entries_keep_20_lines_and_count_the_rest(tmp_path, capsys):
    path = tmp_path / "million.gguf"
    path.write_bytes(million_bad_tensors())
    t0 = time.perf_counter()
    h = parse(path)
    assert len(h.problems) == 1_000_000 and len(h.problems.lines) == MAX_PROBLEMS
    assert time.perf_counter() - t0 < 120  # about 5 s: one pass, no message per entry
    msg = str(problems_error(path, check_keys(h) + h.problems))
    assert msg.startswith(f"{path}: 1,000,000 problems (the first 20):")
    assert msg.endswith("  ... and 999,980 more") and len(msg.splitlines()) == 22
    small = tmp_path / "small.gguf"
    small.write_bytes(million_bad_tensors(3000))
    code, err = cli(["inspect", str(small)], capsys)
    assert code == 1 and f"{small}: 3,000 problems (the first 20)" in err
    assert "t0000000019." in err and "t0000000020." not in err and "... and 2,980 more" in err


def test_problems_keep_order_and_count_across_joins():
    a = Problems(f"a{i}" for i in range(30))
    joined = ["k0", "k1"] + a + Problems(["b0"])
    assert isinstance(joined, Problems) and len(joined) == 33
    assert list(joined) == ["k0", "k1"] + [f"a{i}" for i in range(18)]
    joined += ["c0"]
    assert len(joined) == 34 and joined != list(joined) and Problems(["x"]) == ["x"]
    assert not Problems() and math.isfinite(len(joined))
