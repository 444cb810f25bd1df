"""bench/ncu_table.py reads Nsight Compute's CSV: durations by kernel name in microseconds
whatever unit ncu chose, the lines around the table skipped, other metrics ignored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from ncu_table import kernel_times, main, table  # noqa: E402

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"')


def _row(i: int, name: str, metric: str, unit: str, value: str) -> str:
    return (f'"{i}","1","python3","h","{name}","1","7","(128, 1, 1)","(96, 8, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


CSV = "\n".join([
    "==PROF== Connected to process 1",
    HEAD,
    _row(0, "ggml_gemv_gate_up_IQ3_XXS", "gpu__time_duration.sum", "usecond", "10.50"),
    _row(0, "ggml_gemv_gate_up_IQ3_XXS", "dram__bytes_read.sum", "Mbyte", "9.2"),
    _row(1, "decode_merge_hd128(const float *, int, float, __half *)",
         "gpu__time_duration.sum", "nsecond", "2,500"),
    _row(2, "ggml_gemv_gate_up_IQ3_XXS", "gpu__time_duration.sum", "usecond", "9.50"),
    _row(3, "gemv_f16_rows", "gpu__time_duration.sum", "msecond", "0.2"),
    "==PROF== Disconnected from process 1",
])


def test_durations_by_kernel_in_microseconds():
    got = kernel_times(CSV)
    assert got == {"ggml_gemv_gate_up_IQ3_XXS": [10.5, 9.5], "decode_merge_hd128": [2.5],
                   "gemv_f16_rows": [200.0]}
    text = table(got, per=2, layers=1)
    lines = text.splitlines()
    assert lines[2].startswith("| gemv_f16_rows | 0.5 | 100.0 | 200.00 | 89.9% | 100.00 |")
    assert lines[3].startswith("| ggml_gemv_gate_up_IQ3_XXS | 1 | 10.0 | 10.00 | 9.0% |")
    assert "2 launches, 0.111 ms of kernels a step" in text


def test_an_unknown_unit_and_an_empty_file_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="'cycle'"):
        kernel_times("\n".join([HEAD, _row(0, "k", "gpu__time_duration.sum", "cycle", "3")]))
    empty = tmp_path / "empty.csv"
    empty.write_text(HEAD + "\n")
    assert main([str(empty)]) == 1
    assert "no gpu__time_duration.sum rows" in capsys.readouterr().err
