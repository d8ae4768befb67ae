"""The backend registry: each backend module registers its name, loader and options once.

``load_model``, the command line, the server, Ray Serve and bench method specs read this registry, so a new backend
is one module (its target class, a ``load`` function and one ``register(BackendSpec(...))`` call), one import line in
``verispec.backends`` and its tests; no entry point names a backend. What a target can do (trees, hidden states,
layer skipping, batch rows) it declares itself (``verispec.backends.base.TargetModelBase``); drafters read that,
never the backend's name.

An option is declared once per backend that takes it (``verispec.options.Option``):

    Option("threads", int, None, "...", flag="threads")
      load keyword         threads            load_model(ref, backend="llamacpp", threads=2)
      command line         --threads          verispec generate / audit / bench / serve
      serve option         threads            verispec.ray.build_app(threads=2), a Serve config file
      bench method spec    threads=           baseline:backend=llamacpp:threads=2

Several backends may declare the same option (``weights``: llama.cpp's formats and OpenVINO's); the command line
offers it once, with every backend's choices. An option a backend does not declare is refused by that backend when
it is set to anything but its default (``--compile on --backend llamacpp`` is an error, not silently ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from ..errors import InvalidRequest
from ..options import Option

AUTO = "auto"  # not a backend: the fastest installed one that runs the model's own weights (``backends.choice``)


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    ``load(ref, **options)`` loads a model reference (built-in name, directory, .gguf file, hub id) and returns a
    ``TargetModelBase``; it is called with every option declared here, defaults filled in. ``summary`` is its line in
    ``--backend``'s help; ``install`` what to install when its engine is missing (empty: the base install has it);
    ``installed()`` whether it can run here; ``runs_own_weights(ref)`` whether it runs that model's weights as the
    model ships them (``--backend auto`` times only backends that are installed and do, and whose ``auto`` is True;
    ``preference`` breaks a tie, higher first); ``cost`` is what auto estimates a pass by before preparing anything
    (``backends.choice``); ``arithmetic_floor`` what ``verispec costs --arithmetic-floor`` times."""

    name: str
    summary: str
    load: Callable[..., Any]
    options: tuple[Option, ...] = ()
    install: str = ""
    installed: Callable[[], bool] = lambda: True
    runs_own_weights: Callable[[str], bool] = lambda ref: True
    preference: float = 0
    auto: bool = True
    # The declared cost model ``--backend auto`` chooses by before anything is prepared: the relative cost of one
    # pass from the bytes a GGUF file holds per tensor type ({"Q4_K": bytes, ...}); None: not estimated.
    cost: Callable[[Mapping[str, int]], float] | None = None
    # ``verispec costs --arithmetic-floor``: ``arithmetic_floor(model, widths, context)`` times the products a pass of
    # each width runs with their weights in cache, {w: {"all": ms, block type: ms}}; None: the backend cannot.
    arithmetic_floor: Callable[..., Mapping[int, Mapping[str, float]]] | None = None

    def __post_init__(self) -> None:
        options = tuple(o if o.flag else replace(o, flag=o.name.replace("_", "-")) for o in self.options)
        object.__setattr__(self, "options", options)

    def takes(self, name: str) -> bool:
        """Whether it declares the load option ``name``."""
        return any(o.name == name for o in self.options)

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        known = ", ".join(o.name for o in self.options) or "none"
        raise InvalidRequest(f"the {self.name} backend has no option {name!r}; its options: {known}")

    def keywords(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` (load keywords, meant for any backend) as this backend's: its own, values checked against
        their choices, defaults for those left out. One it does not declare must be unset (None, or the default of
        the backends that declare it), else it is refused with the names of the backends that take it."""
        mine = {o.name: o for o in self.options}
        kept = {}
        for name, value in options.items():
            option = mine.get(name)
            if option is None:
                others = [spec for spec in _REGISTRY.values() if spec.takes(name)]
                if not others:
                    raise InvalidRequest(f"unknown load option {name!r}; the {self.name} backend takes "
                                         f"{', '.join(mine) or 'none'}")
                unset = value is None or value is False or any(_same(value, spec.option(name)) for spec in others)
                if not unset:
                    flag = others[0].option(name).flag
                    raise InvalidRequest(f"{name} (--{flag}) applies to the {' and '.join(s.name for s in others)} "
                                         f"backend{'s' if len(others) > 1 else ''}, not {self.name} "
                                         f"(got {name}={value!r}); drop it or choose --backend "
                                         f"{others[0].name}")
                continue
            if isinstance(value, str) and option.choices and value not in option.choices:
                raise InvalidRequest(f"the {self.name} backend's {name} (--{option.flag}) takes "
                                     f"{', '.join(map(str, option.choices))}, not {value!r}")
            kept[name] = value
        return {**{o.name: o.default for o in self.options}, **kept}

    def build(self, ref: str, **options: Any) -> Any:
        """A loaded target (see ``keywords`` for how options for other backends are treated)."""
        return self.load(ref, **self.keywords(options))


def _same(value: Any, option: Option) -> bool:
    """Whether ``value`` asks nothing of a backend without ``option``: its default (the library's or the command
    line's) or a neutral value; torch dtypes by name."""
    defaults = [option.default, *option.neutral] + ([option.cli_default()] if option.cli_default is not None else [])
    return str(value).removeprefix("torch.") in {str(d) for d in defaults if d is not None}


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Add a backend (once, from its own module)."""
    if spec.name in _REGISTRY or spec.name == AUTO:
        raise ValueError(f"a backend named {spec.name!r} is registered already")
    for o in spec.options:  # one flag, one meaning: a shared option keeps its type and default everywhere
        for other in _REGISTRY.values():
            if other.takes(o.name):
                theirs = other.option(o.name)
                if (theirs.type, theirs.default, theirs.flag) != (o.type, o.default, o.flag):
                    raise ValueError(f"backend {spec.name!r} declares option {o.name!r} unlike {other.name!r} does "
                                     "(type, default and flag must agree)")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered backend (tests that register a fake one)."""
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """Every registered backend, in registration order (``auto`` is not one)."""
    return tuple(_REGISTRY)


def backend_specs() -> tuple[BackendSpec, ...]:
    return tuple(_REGISTRY.values())


def get_backend(name: str) -> BackendSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise InvalidRequest(f"unknown backend {name!r}; choose one of {AUTO}, {', '.join(_REGISTRY)}")
    return spec


def entry_options() -> dict[str, Option]:
    """The options the command line, serve options and bench specs carry, by ``dest``, each once: an option several
    backends declare takes every one's choices and says in its help which backend means what."""
    merged: dict[str, Option] = {}
    for spec in _REGISTRY.values():
        for o in spec.options:
            if not o.exposed:
                continue
            seen = merged.get(o.dest)
            if seen is None:
                merged[o.dest] = replace(o, help=f"{spec.name}: {o.help}")
            else:
                choices = seen.choices + tuple(c for c in o.choices if c not in seen.choices) if seen.choices else ()
                merged[o.dest] = replace(seen, choices=choices, help=f"{seen.help}; {spec.name}: {o.help}")
    return merged


def options_from(source: Any) -> dict[str, Any]:
    """Load options read from an object with one attribute per entry option's ``dest`` (parsed command-line
    arguments, serve options); missing attributes are left out."""
    return {o.name: getattr(source, dest) for dest, o in entry_options().items() if hasattr(source, dest)}
