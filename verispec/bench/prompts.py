"""Prompt sets for benchmarks: Spec-Bench's question.jsonl (the default), or any JSONL of prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from ..errors import InvalidRequest
from ..jsonl import records

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        """Spec-Bench reports the eight MT-bench categories as one group."""
        return "mt_bench" if self.category in MT_BENCH else self.category


PACKAGED = Path(__file__).parent / "data" / "specbench" / "question.jsonl"
# prompt sets shipped with the package, by the name --prompts takes
NAMED = {"spec-bench": PACKAGED, "code": Path(__file__).parent / "data" / "code" / "question.jsonl",
         "repetition": Path(__file__).parent / "data" / "repetition" / "extract.jsonl"}


def default_prompts_path() -> Path | None:
    """Spec-Bench's question.jsonl: $VERISPEC_SPECBENCH when set, else the copy shipped in the package
    (Apache-2.0, see data/specbench/SOURCE.md)."""
    if os.environ.get("VERISPEC_SPECBENCH"):
        return Path(os.environ["VERISPEC_SPECBENCH"])
    return PACKAGED if PACKAGED.is_file() else None


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Read a prompt file (or a shipped set by name: ``NAMED``). Each line is a Spec-Bench record {"question_id", "category", "turns": [...]}
    or a plain {"prompt": "..."} (then the id is the line number and the category "prompts")."""
    if path is None:
        path = default_prompts_path()
        if path is None:
            raise InvalidRequest("no prompt set found: pass --prompts FILE (Spec-Bench's question.jsonl or JSONL "
                                 'lines {"prompt": "..."}), or set VERISPEC_SPECBENCH to question.jsonl')
    if str(path) in NAMED and not Path(path).is_file():
        path = NAMED[str(path)]
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"prompt file {path} does not exist (shipped sets: {', '.join(NAMED)})")
    questions = [_question(row, n, path) for n, row in records(path)]
    if not questions:
        raise InvalidRequest(f"{path} holds no prompts")
    return questions


def _question(row, n: int, path: Path) -> Question:
    if not isinstance(row, dict):
        raise InvalidRequest(f"{path}:{n}: expected a JSON object per line")
    if "turns" in row:
        turns = row["turns"]
    elif "prompt" in row:
        turns = [row["prompt"]]
    else:
        raise InvalidRequest(f'{path}:{n}: a line needs "turns": [...] (Spec-Bench) or "prompt": "..."')
    if isinstance(turns, str):
        turns = [turns]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidRequest(f"{path}:{n}: turns must be non-empty strings")
    return Question(str(row.get("question_id", row.get("id", n))), str(row.get("category", "prompts")), tuple(turns))


def select(questions: list[Question], categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """Questions of the named groups or categories (all when None), at most ``limit`` per name. Within
    mt_bench the eight categories take turns, so a small limit still samples all of them."""
    if limit is not None and limit < 1:
        raise InvalidRequest(f"--limit must be >= 1, got {limit}")
    names = categories or list(dict.fromkeys(q.group for q in questions))
    known = {q.group for q in questions} | {q.category for q in questions}
    unknown = [c for c in names if c not in known]
    if unknown:
        raise InvalidRequest(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                             f"this prompt set has: {', '.join(sorted(known))}")
    chosen: list[Question] = []
    for name in names:
        members = [q for q in questions if name in (q.group, q.category)]
        by_category: dict[str, list[Question]] = {}
        for q in members:
            by_category.setdefault(q.category, []).append(q)
        interleaved = [q for row in zip_longest(*by_category.values()) for q in row if q is not None]
        chosen.extend(q for q in interleaved[:limit] if q not in chosen)
    return chosen
