"""Raw counters of one generation and the rates derived from them.

Conventions: ``mean_accepted_tokens`` is tokens committed per verify step *including* the correction or
bonus token (Spec-Bench's #MAT, vLLM's mean acceptance length), so plain decoding scores 1.0.
``acceptance_rate`` is accepted draft tokens / drafted tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    drafter: str = "none"
    acceptance: str = "strict"
    lossy: bool = False
    k: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    new_tokens: int = 0
    verify_steps: int = 0  # target forwards after the prefill
    drafts: int = 0  # verify steps that carried at least one draft token
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: drafts that reached position i+1
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: of those, accepted at position i+1
    step_drafted: list[int] = field(default_factory=list)  # draft tokens verified by each step
    step_accepted: list[int] = field(default_factory=list)  # of those, accepted by each step
    step_tokens: list[int] = field(default_factory=list)  # tokens committed by each verify step
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step (draft + verify)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    finish_reason: str = ""

    def record_step(self, drafted: int, accepted: int, committed: int, seconds: float) -> None:
        self.verify_steps += 1
        if drafted:
            self.drafts += 1
            self.drafted += drafted
            self.accepted += accepted
            grow = drafted - len(self.drafted_per_position)
            if grow > 0:
                self.drafted_per_position.extend([0] * grow)
                self.accepted_per_position.extend([0] * grow)
            for i in range(drafted):
                self.drafted_per_position[i] += 1
            for i in range(accepted):
                self.accepted_per_position[i] += 1
        self.step_drafted.append(drafted)
        self.step_accepted.append(accepted)
        self.step_tokens.append(committed)
        self.step_seconds.append(seconds)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        return sum(self.step_tokens) / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def position_acceptance(self) -> list[float]:
        """P(accept at position i | position i was drafted and reached)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_second=self.tokens_per_second,
        )
        return out

    def summary(self) -> str:
        parts = [f"{self.new_tokens} tokens in {self.wall_seconds:.2f} s"]
        if self.tokens_per_second:
            parts[0] += f" ({self.tokens_per_second:.1f} tok/s)"
        parts.append(f"{self.verify_steps} target steps")
        if self.mean_accepted_tokens is not None:
            parts.append(f"{self.mean_accepted_tokens:.2f} tokens/step")
        if self.drafter != "none":
            rate = f"{100 * self.acceptance_rate:.1f}%" if self.acceptance_rate is not None else "n/a"
            parts.append(f"drafter {self.drafter} k={self.k}: {self.accepted}/{self.drafted} accepted ({rate})")
        parts.append(f"acceptance {self.acceptance}" + (" (LOSSY)" if self.lossy else ""))
        parts.append(f"finish: {self.finish_reason}")
        return " | ".join(parts)
