"""What a client process pays at start-up: the worker every Ray actor, Flower node and
``fedkit run`` imports leaves scikit-learn's metrics until a score needs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a worker in a subprocess


def test_the_worker_imports_no_sklearn_metrics_until_a_score_asks():
    script = (
        "import sys, fedkit.core.worker\n"
        "assert 'sklearn.metrics' not in sys.modules, 'imported at start-up'\n"
        "from fedkit.evaluation import macro_f1\n"
        "print(macro_f1([0, 1, 1], [0, 1, 0], 2))\n"
        "assert 'sklearn.metrics' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert abs(float(done.stdout) - 2 / 3) < 1e-9
