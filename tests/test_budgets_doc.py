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
    # The page states the last line it prints (cost rounded): the code and the page agree.
    [stated] = re.findall(r"its pause reason and its cost: `(\[[\d, ]+\]) cost ([\d.]+)`", DOC.read_text())
    allowances, reason, cost = done.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    assert "[call c52]" in done.stdout
    assert (allowances, reason, round(float(cost), 5)) == (stated[0], "cost", float(stated[1]))
