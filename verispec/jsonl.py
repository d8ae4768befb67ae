"""Reading JSONL files (prompts, questions, text corpora) with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .errors import InvalidRequest


def records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line of ``path``; a line that is not JSON is an
    ``InvalidRequest`` naming the file and line."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{path}:{n} is not valid JSON ({exc.msg})") from None
            yield n, value
