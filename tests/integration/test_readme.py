"""The README's examples marked runnable run as written, each in a fresh directory, and
print what their comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MARK = "<!-- runnable: tests/integration/test_readme.py runs this block -->"


def blocks() -> list[tuple[int, str]]:
    text = (ROOT / "README.md").read_text()
    found = []
    for match in re.finditer(re.escape(MARK) + r"\n```python\n(.*?)```", text, re.S):
        found.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return found


def test_the_readme_has_runnable_examples():
    assert len(blocks()) >= 5


@pytest.mark.parametrize("line,code", blocks(), ids=[f"README.md:{line}" for line, _ in blocks()])
def test_a_readme_example_runs_and_prints_what_its_comments_say(tmp_path, line, code):
    pytest.importorskip("msgspec", reason="msgspec not installed (pip install -e '.[dev]')")
    (tmp_path / "example.py").write_text(code)
    ran = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert ran.returncode == 0, f"README.md:{line}\n{ran.stderr[-3000:]}"
    # "print(...)   # TEXT": the example printed TEXT.
    for expected in re.findall(r"^print\(.*\)\s+#\s+(.+)$", code, re.M):
        assert expected.strip() in ran.stdout, (expected, ran.stdout)
