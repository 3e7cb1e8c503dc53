"""The worked example of docs/budgets.md runs, and its assertions hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parent.parent / "docs" / "budgets.md"


def test_the_worked_example_of_the_budgets_page_runs(tmp_path):
    [example] = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "[call c52]" in done.stdout and done.stdout.strip().endswith("cost 0.0035900000000000003")
