"""Exceptions raised by verispec. Every message names the problem and the fix."""


class VerispecError(Exception):
    """Base class for errors verispec raises on purpose."""


class InvalidRequest(VerispecError, ValueError):
    """A generation argument is out of range or malformed. ``param`` names the argument when one is to blame, and
    ``code`` is a machine-readable reason (the server passes both on in OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_whole(name: str, value, low: int = 1, high: int | None = None, note: str = "") -> int:
    """``value`` if it is a whole number (not a bool) in low..high, else an InvalidRequest naming ``name`` (and
    ``note``, a hint in parentheses)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise InvalidRequest(f"{name} must be a whole number {span}{f' ({note})' if note else ''}, got {value!r}")
    return value


class ModelNotFound(VerispecError, LookupError):
    """A model reference could not be resolved to weights."""


class IncompatibleDrafter(VerispecError, ValueError):
    """A drafter cannot be paired with the target (tokenizer or vocabulary mismatch)."""
