"""Availability traces (``systems.availability.trace``, fedkit/core/availability.py): a CSV
trace is read in bulk and gives exactly the windows the row-by-row reader gives (merged,
per trace client, on hand-made and on random rows), and a bad row is still named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedkit.core.availability import Windows, csv_columns, read_windows, windows_by_row
from fedkit.errors import RecipeError


def write_csv(path, rows, header="client,start,end") -> str:
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return str(path)


def same(a: Windows, b: Windows) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("starts", "ends", "offsets"))


def test_a_csv_trace_is_read_in_bulk_with_overlapping_windows_merged(tmp_path):
    rows = [  # shuffled; client 0: a long window swallows two, one touches; client 1 apart
        (1, 50.5, 60),
        (0, 10, 20),
        (0, 0, 100),
        (0, 100, 150),
        (1, 0, 10.25),
        (0, 30, 40),
        (0, 300, 400),
        (2, 5, 6),
    ]
    path = write_csv(tmp_path / "trace.csv", rows)
    assert csv_columns(path) is not None  # the bulk reader took it
    bulk = read_windows(path, period=1000.0)
    assert bulk.starts.tolist() == [0, 300, 0, 50.5, 5]
    assert bulk.ends.tolist() == [150, 400, 10.25, 60, 6]
    assert bulk.offsets.tolist() == [0, 2, 4, 5]
    assert same(bulk, Windows.of(windows_by_row(path, 1000.0), 1000.0))
    assert bulk.until(0, 120.0) == 150.0 and bulk.until(0, 200.0) is None
    assert bulk.until(4, 2055.0) == 2060.0  # client 4 follows trace client 1; repeats
    lines = [json.dumps({"client": c, "start": s, "end": e}) for c, s, e in rows]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")
    assert same(read_windows(str(tmp_path / "trace.jsonl"), 1000.0), bulk)


def test_random_traces_give_the_row_by_row_windows(tmp_path):
    rng = np.random.default_rng(0)
    n = 5000
    client = np.concatenate([np.arange(300), rng.integers(0, 300, n - 300)])
    start = rng.uniform(0, 900, n).round(2)
    end = np.minimum(start + rng.pareto(1.2, n) * 20 + 0.5, 1000.0).round(2)
    path = write_csv(tmp_path / "trace.csv", zip(client, start, end, strict=True))
    bulk = read_windows(path, 1000.0)
    assert csv_columns(path) is not None
    assert same(bulk, Windows.of(windows_by_row(path, 1000.0), 1000.0))
    assert len(bulk.starts) < n  # windows were merged
    merged = windows_by_row(path, 1000.0)
    for c, t in zip(rng.integers(0, 900, 300), rng.uniform(0, 3000, 300), strict=True):
        inside = [e for s, e in merged[c % 300] if s <= t % 1000 < e]
        expected = t - t % 1000 + inside[0] if inside else None
        assert bulk.until(int(c), float(t)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rows", "header", "match"),
    [
        ([(0, 0, 10), (1, 20, 20)], "client,start,end", "start < end.*row 2"),
        ([(0, 0, 10), (1, 20, "")], "client,start,end", "number in column 'end' \\(row 2\\)"),
        ([(0, 0, 10), (2, 0, 5)], "client,start,end", "numbered 0..D-1"),
        ([(0, 0, 10)], "client,begin,end", "column 'start'"),
        ([(0, -1, 10)], "client,start,end", "≥ 0 in column 'start' \\(row 1\\)"),
    ],
)
def test_a_bad_csv_row_is_named(tmp_path, rows, header, match):
    path = write_csv(tmp_path / "trace.csv", rows, header)
    with pytest.raises(RecipeError, match=match):
        read_windows(path, 100.0)
