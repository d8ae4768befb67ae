"""Run methods over questions, interleaved per question, writing one raw record per question, turn and method.

Interleaving (every method answers question 1, then every method answers question 2, ...) makes slow
phases of a shared machine hit all methods alike. For mt_bench's second turn each method is asked after
its own answer to the first turn, as in Spec-Bench.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from ..engine import SpeculativeDecoder
from .method import Method, Run
from .prompts import Question


def prompt_encoder(decoder: SpeculativeDecoder) -> Callable[[list[dict]], list[int]]:
    """Chat messages -> prompt ids through the target's chat template; a tokenizer without one gets the
    turns as plain text, one per line."""
    if getattr(decoder.target.tokenizer, "chat_template", None):
        return decoder.encode
    return lambda messages: decoder.encode("\n".join(m["content"] for m in messages), raw=True)


def record(method: Method, question: Question, turn: int, prompt_ids: list[int], run: Run) -> dict:
    """One raw JSONL record. Derived numbers (tokens/s, #MAT, rates) are left to the summary."""
    latencies = [s / n for s, n in zip(run.step_seconds, run.step_tokens) for _ in range(n) if n]
    return {
        "method": method.name, "family": method.family, "drafter": method.drafter, "k": method.k,
        "question_id": question.question_id, "category": question.category, "group": question.group, "turn": turn,
        "prompt_tokens": len(prompt_ids), "new_tokens": len(run.token_ids), "wall_seconds": run.wall_seconds,
        "verify_steps": len(run.step_tokens), "step_tokens": run.step_tokens, "step_seconds": run.step_seconds,
        "step_drafted": run.step_drafted, "step_accepted": run.step_accepted,
        "drafted_per_position": run.drafted_per_position, "accepted_per_position": run.accepted_per_position,
        "draft_seconds": run.draft_seconds,
        "token_latencies": latencies, "finish_reason": run.finish_reason, "lossy": run.lossy,
        "changed_model": method.changed_model,
        "token_ids": run.token_ids,
    }


def run_benchmark(
    methods: Sequence[Method],
    questions: Sequence[Question],
    encode: Callable[[list[dict]], list[int]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    warmup: int = 1,
) -> Iterator[dict]:
    """Yield raw records. ``encode`` turns chat messages into prompt ids (the target's chat template);
    ``decode`` turns a method's answer into text for the next turn. ``warmup`` questions are answered by
    every method first, untimed and unrecorded (first calls pay for allocation and kernel selection)."""
    for q in list(questions)[:warmup]:
        ids = encode([{"role": "user", "content": q.turns[0]}])
        for m in methods:
            m.run(ids, min(16, max_new_tokens), temperature, top_p, seed)
    for q in questions:
        history: dict[str, list[dict]] = {m.name: [] for m in methods}
        for turn, text in enumerate(q.turns, 1):
            for m in methods:
                messages = history[m.name] + [{"role": "user", "content": text}]
                ids = encode(messages)
                run = m.run(ids, max_new_tokens, temperature, top_p, seed)
                history[m.name] = messages + [{"role": "assistant", "content": decode(run.token_ids)}]
                yield record(m, q, turn, ids, run)
