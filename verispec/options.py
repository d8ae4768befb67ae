"""An option of a registered drafter or backend, declared once and read by every entry point.

``Option("min_n", int, 2, "...", flag="ngram-min")`` is the factory keyword ``min_n``, the command-line flag
``--ngram-min``, the serve option ``ngram_min`` and the bench method spec key ``min_n=``. The drafter registry
(``verispec.drafters.registry``) and the backend registry (``verispec.backends.registry``) both declare their options
with it, so the command line, the server, Ray Serve and bench build their flags and check values in one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import InvalidRequest


@dataclass(frozen=True)
class Option:
    """One option of a drafter: its factory keyword ``name``, its type (int, float, bool or str), default and help;
    ``flag`` is its command-line name without dashes (default: DRAFTER-NAME); ``choices`` the values a str option
    takes (empty: any)."""

    name: str
    type: type
    default: Any
    help: str
    flag: str = ""
    choices: tuple = ()
    metavar: str = ""  # its value's name in help text (default for a str option: DIR)
    # a backend option: whether the command line, serve options and bench specs carry it (False: a Python keyword)
    exposed: bool = True
    # the command line's and a server's default where it differs from the library's (read when the parser is built)
    cli_default: Callable[[], Any] | None = None
    # a backend option's values that ask nothing of a backend without it (--compile auto: a stored program if any)
    neutral: tuple = ()
    const: Any = None  # the value of the flag given bare (--compile is --compile on); None: it needs a value

    def entry_default(self) -> Any:
        """The default on the command line and in serve options."""
        return self.cli_default() if self.cli_default is not None else self.default

    @property
    def dest(self) -> str:
        """Its attribute name in parsed arguments and serve options (the flag with '_' for '-')."""
        return self.flag.replace("-", "_")

    def parse(self, value: Any, where: str) -> Any:
        """``value`` (a string from a method spec or a config file, or already typed) as this option's type."""
        try:
            parsed = parse_value(self.name, value, self.type)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{where}: {exc}") from None
        if self.choices and parsed is not None and parsed not in self.choices:
            raise InvalidRequest(f"{where}: option {self.name!r} takes {', '.join(map(str, self.choices))}, "
                                 f"not {parsed!r}")
        return parsed


SWITCH_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_value(name: Any, value: Any, type_: type) -> Any:
    """An option's value as ``type_`` (bool, int, float or str): given typed, or as the string a command line,
    a config file (``serve run ... key=value``) or a bench method spec holds. None stays None."""
    if value is None:
        return None
    if type_ is bool:
        if isinstance(value, str):
            if value.lower() not in SWITCH_WORDS:
                raise InvalidRequest(f"option {name!r} is a switch: give true or false (1 or 0), not {value!r}")
            return SWITCH_WORDS[value.lower()]
        return bool(value)
    if type_ in (int, float):
        whole = type_ is int
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (whole and isinstance(value, float)):
            raise InvalidRequest(f"option {name!r}: {value!r} is not a valid {type_.__name__} "
                                 f"({'a whole number' if whole else 'a number'})")
        try:
            return type_(value)
        except ValueError:
            raise InvalidRequest(f"option {name!r}: {value!r} is not a valid {type_.__name__} "
                                 f"({'a whole number' if whole else 'a number'})") from None
    return str(value)
