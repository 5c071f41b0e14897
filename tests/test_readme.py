"""The README's two commands stay the ones that work: CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)][:2]


def test_ci_runs_the_readme_test_command():
    start, test = _commands()
    assert "tandem try" in start and "pip install" in start
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test


def test_start_command_uses_an_existing_subcommand():
    import tandem_cli

    start = _commands()[0]
    sub = start.split("tandem ", 1)[1].split()[0]
    assert sub in tandem_cli.build_parser()._subparsers._group_actions[0].choices
