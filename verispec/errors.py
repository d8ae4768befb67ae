"""Exceptions raised by verispec. Every message names the problem and the fix."""


class VerispecError(Exception):
    """Base class for errors verispec raises on purpose."""


class InvalidRequest(VerispecError, ValueError):
    """A generation argument is out of range or malformed."""


class ModelNotFound(VerispecError, LookupError):
    """A model reference could not be resolved to weights."""


class IncompatibleDrafter(VerispecError, ValueError):
    """A drafter cannot be paired with the target (tokenizer or vocabulary mismatch)."""
