"""Every `verispec ...` command written in the README and docs/ parses with today's command line.

Shell blocks are read from the Markdown files; each invocation (after `&&`, `|` or `;` splits) goes through the
real argument parser, so a renamed or removed option in the code fails here before a reader finds it."""

import re
import shlex
from pathlib import Path

import pytest

from verispec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
PREFIX = re.compile(r"^(?:\S*/)?verispec$")


def invocations(text: str) -> list[list[str]]:
    found = []
    for block in BLOCK.findall(text):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip().removesuffix("&").strip()  # a job sent to the background
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s(?:&&|\||;)\s", line):
                part = re.split(r"\s\d?>\s", part)[0]  # output redirected to a file
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                if words[:3] == ["python", "-m", "verispec"] or words[:3] == ["python3", "-m", "verispec"]:
                    found.append(words[3:])
                elif words and PREFIX.match(words[0]):
                    found.append(words[1:])
    return found


CASES = [(path.relative_to(ROOT).as_posix(), argv) for path in FILES for argv in invocations(path.read_text())]


def test_the_readme_shows_commands():
    readme = [argv for name, argv in CASES if name == "README.md"]
    assert len(readme) >= 10 and any(argv[:1] == ["generate"] for argv in readme)


@pytest.mark.parametrize("source,argv", CASES, ids=[f"{n}:{' '.join(a)[:60]}" for n, a in CASES])
def test_documented_command_parses(source, argv, capsys):
    parser = build_parser()
    if "--help" in argv or "-h" in argv or "--version" in argv:
        with pytest.raises(SystemExit) as done:
            parser.parse_args(argv)
        assert done.value.code == 0
        return
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse printed why
        pytest.fail(f"{source}: `verispec {' '.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
    assert args.command, f"{source}: `verispec {' '.join(argv)}` names no command"
