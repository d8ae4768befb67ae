"""Command-line options shared by generate, audit, bench, analyze and serve: the target, its backend, the drafter and
its options (read from the drafter registry), sampling; and building a decoder from them."""

from __future__ import annotations

import argparse

from ..backends.references import default_draft
from ..backends import AUTO, BUILTINS, DEFAULT_MODEL, backend_specs, entry_options, get_backend
from ..backends.choice import ENV as BACKEND_ENV, default_backend
from ..options import Option
from ..drafters import drafter_names, drafter_specs, get_spec, make_drafter, options_from
from ..drafters.registry import NONE, needs_layer_callback


def model_options(p: argparse.ArgumentParser, drafter_default: str = "ngram") -> None:
    """Target, drafter and backend options (generate, audit, serve); every registered drafter's options too."""
    g = p.add_argument_group("model and drafter")
    g.add_argument("--target", default=DEFAULT_MODEL, metavar="REF",
                   help=f"target model: built-in name ({', '.join(BUILTINS)}), local directory, .gguf file or "
                        f"hub id (default: {DEFAULT_MODEL})")
    summaries = "; ".join(f"{spec.name} = {spec.summary}" for spec in drafter_specs())
    g.add_argument("--drafter", default=drafter_default, choices=drafter_names(),
                   help=f"who proposes tokens: none = plain decoding (the off switch); {summaries} "
                        f"(default: {drafter_default})")
    g.add_argument("--draft-model", metavar="REF",
                   help="draft model for drafters that need one (--drafter model: same tokenizer as the target, or "
                        "another one drafted through text; default for a built-in target that names one: "
                        "qwen2.5-coder-1.5b drafts with qwen2.5-coder-0.5b)")
    g.add_argument("--k", type=int, default=8, help="most draft tokens verified per step (default: 8)")
    g.add_argument("--k-policy", default="cost", choices=["cost", "fixed"],
                   help="cost (default): choose each step how many draft tokens to verify, 0 included, from step "
                        "costs and acceptance measured on this machine; fixed: verify every draft token offered, "
                        "up to --k (for experiments)")
    for spec in drafter_specs():
        for o in spec.options:
            add_option(g, o)
    g.add_argument("--acceptance", default="strict", choices=["strict", "typical"],
                   help="strict = rejection sampling, lossless (default); typical = Medusa-style typical "
                        "acceptance, LOSSY: faster but no longer the target's distribution")
    add_backend_options(g)


def sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy; > 0 samples (default: {temperature})")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, default)")


def add_option(g: argparse._ArgumentGroup, o: Option) -> None:
    """A registered drafter's or backend's option as a command-line flag."""
    default = o.entry_default()
    if o.type is bool and default:  # on by default: --flag / --no-flag
        g.add_argument(f"--{o.flag}", action=argparse.BooleanOptionalAction, default=True, help=o.help)
    elif o.type is bool:
        g.add_argument(f"--{o.flag}", action="store_true", help=o.help)
    else:
        bare = {"nargs": "?", "const": o.const} if o.const is not None else {}
        g.add_argument(f"--{o.flag}", type=o.type, default=default, help=o.help, choices=o.choices or None,
                       metavar=o.metavar or ("DIR" if o.type is str and not o.choices else None), **bare)


def add_backend_options(g: argparse._ArgumentGroup, what: str = "what runs the target") -> None:
    """``--backend`` and every registered backend's options (``verispec.backends.registry``)."""
    engines = "; ".join(f"{spec.name} ({spec.summary}{'; needs ' + spec.install if spec.install else ''})"
                        for spec in backend_specs())
    g.add_argument("--backend", default=default_backend(), choices=(AUTO, *(s.name for s in backend_specs())),
                   help=f"{what}: auto (default: the fastest installed engine on this CPU that runs the model's own "
                        "weights, estimated from the file without preparing the others, or by the timing that "
                        "`verispec models --time MODEL` stored; the choice is printed; "
                        f"${BACKEND_ENV} sets the default); {engines}")
    for o in entry_options().values():
        add_option(g, o)
    add_cost_cache_option(g)


def add_cost_cache_option(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--no-cost-cache", action="store_true",
                   help="measure the target's step costs (and, on the blocks backend, time the kernel's paths) "
                        "afresh instead of starting from those an earlier run stored for the same model, settings and "
                        "CPU (also: VERISPEC_COST_CACHE=0; `verispec models` lists what is stored)")


def load_args_model(args, ref: str, layer_states: bool = False, **overrides):
    """Load ``ref`` with the backend options in ``args`` (overrides win). ``layer_states``: the drafter reads hidden
    states before the final one (settled from the drafter's options before any model loads, ``needs_layer_callback``),
    handed to a backend that takes ``features`` as a plain option."""
    from ..backends import load_model

    from ..backends.registry import options_from

    backend = getattr(args, "backend", "transformers")
    options = options_from(args)
    if backend != AUTO and get_backend(backend).takes("features"):
        options["features"] = layer_states  # llama.cpp: the eval callback of four-layer EAGLE heads
    options.update(overrides)
    return load_model(ref, backend=backend, **options)


def build_decoder(args):
    """The decoder the options name: target, drafter (with its options) and the engine's settings."""
    from ..engine import SpeculativeDecoder

    # what the drafter needs of the models, settled before anything loads
    needs_draft = args.drafter != NONE and get_spec(args.drafter).needs_draft_model
    layer_states = needs_layer_callback(args)
    target = load_args_model(args, args.target, layer_states)
    # a built-in target's own draft when none is named (Qwen 1.5B: 0.5B)
    draft_ref = (args.draft_model or default_draft(args.target)) if needs_draft else None
    draft_model = load_args_model(args, draft_ref, layer_states) if draft_ref else None
    drafter = make_drafter(args.drafter, target=target, draft_model=draft_model, **options_from(args, args.drafter))
    return SpeculativeDecoder(target, drafter, k=args.k, acceptance=args.acceptance, k_policy=args.k_policy)
