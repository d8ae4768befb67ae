"""Raw counters of one generation and the rates derived from them.

The cost-aware controller's counters: ``step_budget`` (draft tokens it asked the drafter for each step, 0 = a
plain step), ``probes`` (drafts verified against its advice, to keep learning), ``predicted_tokens`` and
``predicted_seconds`` (its expectation summed over steps), ``plain_step_seconds`` (its estimate of a plain step at
the end). ``predicted_speedup`` and ``measured_speedup`` compare the steps with plain decoding at that estimate.

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
    k_policy: str = ""  # "cost" (the controller) or "fixed"; "" for plain decoding
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
    step_budget: list[int] = field(default_factory=list)  # draft tokens the controller asked for, per step
    filled: int = 0  # guesses verified in slots the target padded the pass with anyway (not the drafter's; free)
    filled_accepted: int = 0  # of those, accepted
    probes: int = 0
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    plain_step_seconds: float = 0.0
    calibration_seconds: float = 0.0
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
    def plain_steps(self) -> int:
        """Steps that verified no draft token."""
        return self.verify_steps - self.drafts

    @property
    def predicted_speedup(self) -> float | None:
        if self.predicted_seconds <= 0 or self.plain_step_seconds <= 0:
            return None
        return self.predicted_tokens / self.predicted_seconds * self.plain_step_seconds

    @property
    def measured_speedup(self) -> float | None:
        """Tokens per second of the steps over the controller's plain-step estimate (1 token per plain step)."""
        seconds = sum(self.step_seconds)
        if seconds <= 0 or self.plain_step_seconds <= 0:
            return None
        return sum(self.step_tokens) / seconds * self.plain_step_seconds

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
            plain_steps=self.plain_steps,
            predicted_speedup=self.predicted_speedup,
            measured_speedup=self.measured_speedup,
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
            if self.k_policy:
                control = f"k policy {self.k_policy}: {self.plain_steps} plain steps"
                if self.predicted_speedup is not None and self.measured_speedup is not None:
                    control += f", speedup predicted {self.predicted_speedup:.2f}x / measured {self.measured_speedup:.2f}x"
                parts.append(control)
        parts.append(f"acceptance {self.acceptance}" + (" (LOSSY)" if self.lossy else ""))
        parts.append(f"finish: {self.finish_reason}")
        return " | ".join(parts)
