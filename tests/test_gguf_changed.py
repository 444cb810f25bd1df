"""A GGUF file cut short, grown or rewritten after the engine opened it: what a run reads from
it later (a prompt's embedding rows, looked up on the host; the reference backend's dense
weights, decoded on their first use) is a GGUFChangedError naming the file and how it changed,
exit 1 from the command line with the rows finished before kept, never SIGBUS from a read of
the memory map past the file's new end.

Every cut happens in a fresh interpreter: SIGBUS would end pytest itself, and here it fails
the test instead, by the child's exit status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from _cli import ROOT

from strata_rt.engine import Engine
from strata_rt.errors import GGUFChangedError, GGUFError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf
from strata_rt.text.tokenizer_vocab import synthetic_vocab
from strata_rt.weights.gguf_file.opened_file import OpenedFile, TensorBytes

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=2, n_kv_heads=1, head_dim=32, vocab=300,
                 ffn=256, n_experts=4, top_k=2, context=64)


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 3, "fp16")


@pytest.fixture
def gguf(tmp_path: Path, model: Qwen3Model) -> Path:
    return write_qwen3_gguf(tmp_path / "m.gguf", model,
                            keys=synthetic_vocab(SPEC.vocab).gguf_keys())


def header_end(path: Path) -> int:
    """The first byte of the data section: a cut there leaves the header whole."""
    from strata_rt.weights.gguf_file.gguf_header import parse

    return parse(path).data_start


#: the child: opens an engine, then runs `steps` ("cut", "touch" or a prompt of token ids);
#: prints the first StrataError as JSON. `unchecked` skips the size check before each read,
#: so that only the read itself can notice the cut (a cut between the check and the read).
CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from strata_rt.engine import Engine
    from strata_rt.errors import StrataError
    from strata_rt.weights.gguf_file.opened_file import OpenedFile
    args = json.loads(sys.argv[1])
    if args.get("unchecked"):
        OpenedFile.check = lambda self, what: None
    done = []
    with Engine.open(args["engine"]) as eng:
        try:
            for step in args["steps"]:
                if step == "cut":
                    os.truncate(args["cut"], args["size"])
                else:
                    logits, _ = eng.prefill(np.array(step, np.int64))
                    done.append(int(np.argmax(logits)))
        except StrataError as e:
            print(json.dumps({"error": type(e).__name__, "message": str(e), "done": done}))
            sys.exit(0)
    print(json.dumps({"error": None, "done": done}))
""")


def child(engine: dict, steps: list, cut: Path | None = None, size: int = 0,
          unchecked: bool = False) -> dict:
    args = {"engine": engine, "steps": steps, "cut": str(cut), "size": size,
            "unchecked": unchecked}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != -signal.SIGBUS, "the run ended with SIGBUS: " + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def reference(path: Path, embedding: str = "auto") -> dict:
    return {"model": {"gguf": str(path), "format": "fp16"}, "backend": "reference",
            "prefill": 16, "embedding": embedding}


def assert_changed(got: dict, path: Path, how: str = "it shrank from") -> str:
    assert got["error"] == "GGUFChangedError", got
    msg = got["message"]
    assert msg.startswith(f"{path}: the file changed after it was opened: {how}"), msg
    assert "can no longer be read as it was checked" in msg and "tensor " in msg, msg
    return msg


@pytest.mark.parametrize("embedding", ["auto", "host"])
@pytest.mark.parametrize("where", ["header", "middle"])
def test_a_cut_before_the_first_prompt(gguf, embedding, where):
    """The first prompt after the cut decodes its embedding rows (on the host with "host",
    in the backend's ChunkInput with "auto") and the dense weights: both read the file."""
    before = os.path.getsize(gguf)
    size = header_end(gguf) if where == "header" else before // 2
    got = child(reference(gguf, embedding), ["cut", [1, 2, 3]], gguf, size)
    assert_changed(got, gguf, f"it shrank from {before:,} to {size:,} bytes, so tensor ")


def test_a_cut_between_prompts(gguf):
    """After a prompt every dense weight is decoded and kept; the next prompt's embedding rows
    still come from the file. The prompt before the cut ran, the one after is refused."""
    got = child(reference(gguf, "host"), [[5, 6, 7], "cut", [8, 9]], gguf, header_end(gguf))
    assert_changed(got, gguf)
    assert len(got["done"]) == 1


@pytest.mark.parametrize("embedding", ["auto", "host"])
def test_a_cut_between_the_check_and_the_read(gguf, embedding):
    """With the check before each read left out, the short read itself refuses the file."""
    size = header_end(gguf)
    got = child(reference(gguf, embedding), ["cut", [1, 2, 3]], gguf, size, unchecked=True)
    assert f"to {size:,} bytes" in assert_changed(got, gguf)


def test_a_cut_shard_of_a_split_model_is_named(tmp_path, model):
    first = write_qwen3_gguf(tmp_path / "m.gguf", model, split_max_tensors=12)
    last = sorted(tmp_path.glob("m-*-of-*.gguf"))[-1]
    assert last != first
    got = child(reference(first), ["cut", [1, 2, 3]], last, 64)
    assert_changed(got, last)


def test_the_file_rewritten_in_place_is_refused(gguf):
    """Same size, new bytes (a NaN in the embedding) and a new modification time: the run
    refuses the file rather than reading bytes that were never checked. (No cut: nothing here
    could raise SIGBUS, so it runs in this process.)"""
    with Engine.open(reference(gguf, "host")) as eng:
        eng.prefill(np.array([1, 2], np.int64))
        emb = eng.whole.dense.token_embd
        assert emb.source is not None
        with open(gguf, "r+b") as f:
            f.seek(emb.source.offset)
            f.write(np.full(8, np.nan, np.float32).tobytes())
        st = os.stat(gguf)
        os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(GGUFChangedError, match=f"^{re.escape(str(gguf))}: the file changed "
                           r"after it was opened: it was rewritten in place \(still [\d,]+ "
                           "bytes"):
            eng.prefill(np.array([0, 1], np.int64))


def test_the_file_grown_is_refused(gguf):
    with Engine.open(reference(gguf, "host")) as eng:
        with open(gguf, "ab") as f:
            f.write(b"\0" * 100)
        with pytest.raises(GGUFChangedError, match="it grew from"):
            eng.prefill(np.array([1], np.int64))


# ---------------------------------------------------------------------------- the reads
def test_rows_and_whole_reads_match_the_file_and_refuse_a_short_one(tmp_path):
    data = np.arange(40 * 16, dtype=np.uint8).reshape(40, 16)
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 8 + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    t = TensorBytes(OpenedFile(path, fd, os.fstat(fd)), "t", 8, data.nbytes)
    ids = np.array([[3, 3, 39], [0, 17, 4]])
    assert np.array_equal(t.rows(ids, 16), data[ids.reshape(-1)])
    assert t.rows(np.zeros(0, np.int64), 16).shape == (0, 16)
    assert np.array_equal(t.read(), data.reshape(-1))
    with pytest.raises(IndexError, match="row 40 of tensor t, which has 40 rows"):
        t.rows(np.array([40]), 16)
    os.truncate(path, 8 + 20 * 16)
    t.file.check = lambda what: None  # type: ignore[method-assign]
    with pytest.raises(GGUFChangedError, match=r"it shrank from 648 to 328 bytes, so tensor t "
                                               r"\(bytes 8\.\.648\)"):
        t.rows(np.array([2, 30]), 16)
    with pytest.raises(GGUFChangedError, match="it shrank"):
        t.read()
    assert isinstance(GGUFChangedError("x"), GGUFError)  # exit 1, as every broken GGUF


# ---------------------------------------------------------------------------- the CLI
#: the command line in a fresh interpreter, the file cut (truncated to `size` bytes) once
#: the engine has opened ("open") or once its first prefill has returned ("prefill")
CLI_CHILD = textwrap.dedent("""
    import json, os, sys
    from strata_rt import engine as E
    from strata_rt.cli import main
    path, size, when, argv = json.loads(sys.argv[1])
    if when == "open":
        real_open = E.Engine.open.__func__
        def opened(cls, config):
            eng = real_open(cls, config)
            os.truncate(path, size)
            return eng
        E.Engine.open = classmethod(opened)
    else:
        real = E.Engine._prefill_tokens
        def prefill(self, *a, **k):
            out = real(self, *a, **k)
            if os.path.getsize(path) != size:
                os.truncate(path, size)
            return out
        E.Engine._prefill_tokens = prefill
    sys.exit(main(argv))
""")


def cli_child(gguf: Path, when: str, argv: list[str]) -> subprocess.CompletedProcess:
    size = header_end(gguf)
    proc = subprocess.run([sys.executable, "-c", CLI_CHILD,
                           json.dumps([str(gguf), size, when, argv])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != -signal.SIGBUS, "the run ended with SIGBUS: " + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def config(tmp_path: Path, gguf: Path, **more) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"gguf": str(gguf)}, "format": "fp16",
                                    "backend": "reference", "expert_cache": 0,
                                    "prompts": [4, 5], **more}))
    return str(path)


def test_run_exits_1_and_keeps_the_finished_prompt(tmp_path, gguf):
    out = tmp_path / "runs.json"
    proc = cli_child(gguf, "prefill", ["run", config(tmp_path, gguf), "--json", str(out)])
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert err.startswith(f"strata run: {gguf}: the file changed after it was opened: it "
                          "shrank from"), err
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and [r["prompt"] for r in doc["runs"]] == [0]


@pytest.mark.parametrize("when", ["open", "prefill"])
def test_generate_exits_1(tmp_path, gguf, when):
    """Cut at open, the tokenizer finds it (before: exit 2, blamed on its keys); cut after the
    prompt's prefill, the first decode step does."""
    pytest.importorskip("tokenizers")
    proc = cli_child(gguf, when, ["generate", config(tmp_path, gguf), "--prompt", "hi there",
                                  "-n", "4", "--ignore-eos"])
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"strata generate: {gguf}: the file changed after it was opened: "
                          "it shrank from"), err
    assert ("its tokenizer" if when == "open" else "tensor token_embd.weight") in err, err


# ---------------------------------------------------------------------------- the path
def other_vocab_keys() -> dict:
    """The tokenizer keys with two byte tokens swapped: a valid vocabulary that encodes
    "a" and "b" to each other's ids."""
    keys = synthetic_vocab(SPEC.vocab).gguf_keys()
    tokens = keys["tokenizer.ggml.tokens"]
    a, b = tokens.index("a"), tokens.index("b")
    tokens[a], tokens[b] = tokens[b], tokens[a]
    return keys


@pytest.mark.parametrize("how", ["renamed over", "symlink", "deleted"])
def test_the_tokenizer_is_not_read_from_another_file_at_the_path(tmp_path, gguf, model, how):
    """The engine reads its file through the descriptor kept from the open, but a tokenizer
    built later reads the keys by path: another GGUF renamed over it (a model updated in
    place) gave a tokenizer of that file's vocabulary beside the opened file's weights, a
    prompt encoded to the wrong ids with no error. Now the path is held to the opened file."""
    pytest.importorskip("tokenizers")
    other = write_qwen3_gguf(tmp_path / "other.gguf", model, keys=other_vocab_keys())
    with Engine.open(reference(gguf, "host")) as eng:
        eng.prefill(np.array([1, 2], np.int64))
        if how == "renamed over":
            os.replace(other, gguf)
        elif how == "symlink":
            gguf.unlink()
            gguf.symlink_to(other)
        else:
            gguf.unlink()
        eng.prefill(np.array([3], np.int64))  # the kept descriptor still reads the weights
        with pytest.raises(GGUFChangedError, match=f"^{re.escape(str(gguf))}: the file changed "
                           "after it was opened: its path now names another file or none"):
            eng.tokenizer()
