"""The documentation stays in step with the code."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_config_reference_is_up_to_date():
    result = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_opens_with_the_two_commands_and_ci_calls_the_test_one():
    head = (REPO / "README.md").read_text().splitlines()[:15]
    assert any("make train" in line for line in head) and any("make test" in line for line in head)
    assert "make test" in (REPO / ".ci" / "run").read_text()
