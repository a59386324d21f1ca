"""The README's Python example runs as written (on a smaller quickstart, so the test
stays fast: one round on fewer images)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    [block] = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert 'overrides=["federation.rounds=5"]' in block
    cheap = '["federation.rounds=1", "data.max_train=300", "federation.local_epochs=1"]'
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block.replace('["federation.rounds=5"]', cheap), "README.md", "exec"), namespace)  # noqa: S102
    accuracy, total = capsys.readouterr().out.split()
    assert 0.0 <= float(accuracy) <= 1.0 and int(total) > 0
    table = namespace["table"]  # the rows as a DataFrame, nested values as columns
    assert list(table.index) == [1] and table.loc[1, "test_accuracy"] == float(accuracy)
    assert table.loc[1, "bytes.total"] == int(total)
    assert (tmp_path / "runs" / "qs-py" / "summary.json").is_file()
