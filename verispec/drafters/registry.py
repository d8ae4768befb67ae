"""The drafter registry: each drafter module registers its name, factory, options and capabilities once.

The command line, the server, bench method specs and the engine's checks read this registry, so a new drafter is one
module (its class plus one ``register(DrafterSpec(...))`` call), one import line in ``verispec.drafters`` and its
tests; no entry point names a drafter. The smallest real example is ``verispec.drafters.ngram``.

An option is declared once and reaches every entry point under names derived from it:

    Option("min_n", int, 2, "...", flag="ngram-min")
      factory keyword      min_n              NgramDrafter(min_n=...)
      command line         --ngram-min        verispec generate / audit / serve
      serve option         ngram_min          verispec.ray.build_app(ngram_min=...), a Serve config file
      bench method spec    min_n=             ngram:min_n=3
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import InvalidRequest
from ..options import SWITCH_WORDS, Option, parse_value  # noqa: F401 (re-exported)
from .base import Drafter

NONE = "none"  # plain decoding: no drafter (the off switch), listed with the registered names


@dataclass(frozen=True)
class DrafterSpec:
    """A registered drafter.

    ``factory(target, draft_model, **options)`` builds one (a fresh one per sequence: drafters keep per-sequence
    state). Capabilities, declared here and never probed: ``needs_draft_model`` (a second model, given as
    ``draft_model``), ``hidden_states`` (reads the target's hidden states), ``inner_layers`` (given the target's
    reference and the options, whether it reads layers before the final normed state: a llama.cpp target is then
    loaded with ``features=True``, which installs a per-pass callback where its llama.cpp has no layer-input
    outputs; the final state comes without),
    ``trees`` (given its options, whether it drafts trees; None if it never does: trees verify one sequence per pass
    and need a backend with tree attention), ``backends`` (where it runs). A built drafter states the same per
    instance: ``feature_layers`` and ``tree_depth`` (see ``verispec.drafters.base``)."""

    name: str
    summary: str
    factory: Callable[..., Drafter]
    options: tuple[Option, ...] = ()
    needs_draft_model: bool = False
    hidden_states: bool = False
    inner_layers: Callable[[str, dict[str, Any]], bool] = lambda target, options: True
    trees: Callable[[dict[str, Any]], bool] | None = None
    tree_option: str = ""  # the option that turns trees on (named in messages)
    runs_on: Callable[[Any], bool] = lambda target: True
    requirement: str = ""  # what runs_on asks of a target, in words
    reference_option: str = ""  # the option a bench spec's bare reference sets (eagle:DIR -> head=DIR)
    # options that let more drafters of a server reuse what the first one loaded (weights), given that first one
    share: Callable[[Drafter], dict[str, Any]] | None = None
    # a server offers it without being asked (False: only when started with it, e.g. its setup measures for a minute)
    offered_by_default: bool = True

    def __post_init__(self) -> None:
        # every option gets a command-line name: NAME-OPTION unless it says otherwise
        options = tuple(o if o.flag else replace(o, flag=f"{self.name}-{o.name}".replace("_", "-"))
                        for o in self.options)
        object.__setattr__(self, "options", options)

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        known = ", ".join(o.name for o in self.options) or "none"
        raise InvalidRequest(f"the {self.name} drafter has no option {name!r}; its options: {known}")

    def drafts_trees(self, options: dict[str, Any]) -> bool:
        """Whether these options make it draft trees."""
        return self.trees is not None and bool(self.trees(options))

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}

    def build(self, target=None, draft_model=None, **options) -> Drafter:
        """A new drafter; options left out take the defaults declared here (the one place they are set)."""
        for name in options:
            self.option(name)  # unknown options get a message naming the known ones
        options = {**self.defaults(), **options}
        if self.needs_draft_model and draft_model is None:
            raise InvalidRequest(f"the {self.name} drafter needs a draft model: pass --draft-model REF (a smaller, faster "
                                 "model; one with the target's tokenizer drafts best)")
        if target is not None and not self.runs_on(target):
            raise InvalidRequest(f"the {self.name} drafter needs {self.requirement}, which the {target.backend} "
                                 "backend's target is not; choose another --backend or drafter")
        return self.factory(target, draft_model, **options)


_REGISTRY: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    """Add a drafter (once, from its own module)."""
    if spec.name in _REGISTRY or spec.name == NONE:
        raise ValueError(f"a drafter named {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def drafter_names() -> tuple[str, ...]:
    """``none`` and every registered drafter, in registration order."""
    return (NONE, *_REGISTRY)


def drafter_specs() -> tuple[DrafterSpec, ...]:
    return tuple(_REGISTRY.values())


def get_spec(name: str) -> DrafterSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise InvalidRequest(f"unknown drafter {name!r}; choose one of {', '.join(drafter_names())}")
    return spec


def make_drafter(name: str, target=None, draft_model=None, **options) -> Drafter | None:
    """Build a drafter by name with its options (see each drafter's spec); ``none`` is None (plain decoding)."""
    if name == NONE:
        if options:
            raise InvalidRequest(f"plain decoding (drafter none) takes no options, got {', '.join(options)}")
        return None
    return get_spec(name).build(target, draft_model, **options)


def options_from(args: Any, name: str) -> dict[str, Any]:
    """The options of drafter ``name`` read from an object with one attribute per option's ``dest`` (parsed
    command-line arguments, serve options); options left at their defaults are left out."""
    if name == NONE:
        return {}
    found = {}
    for o in get_spec(name).options:
        value = getattr(args, o.dest, o.default)
        if value != o.default:
            found[o.name] = value
    return found


def needs_layer_callback(args: Any) -> bool:
    """Whether the drafter named by ``args.drafter``, or one whose options ``args`` set, reads hidden states before
    the target's final normed state (a llama.cpp target is then loaded with ``features=True``: the eval callback,
    on a llama.cpp without layer-input outputs)."""
    target = getattr(args, "target", "")
    name = getattr(args, "drafter", NONE)
    if name != NONE:
        spec = get_spec(name)
        if spec.hidden_states and spec.inner_layers(target, options_from(args, name)):
            return True
    return any(spec.hidden_states and (opts := options_from(args, spec.name)) and spec.inner_layers(target, opts)
               for spec in _REGISTRY.values())


def all_options() -> dict[str, Option]:
    """Every registered drafter's options by ``dest`` (the command line and serve options hold them all)."""
    return {o.dest: o for spec in _REGISTRY.values() for o in spec.options}
