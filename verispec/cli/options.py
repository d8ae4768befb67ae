"""Command-line options shared by generate, audit, bench, analyze and serve: the target, its backend, the drafter and
its options (read from the drafter registry), sampling; and building a decoder from them."""

from __future__ import annotations

import argparse

from ..backends.references import default_draft
from ..backends import BUILTINS, COMPILE_ENV, COMPILE_MODES, DEFAULT_MODEL, DTYPES, default_compile_mode
from ..backends.base import BACKENDS
from ..backends.choice import ENV as BACKEND_ENV, default_backend
from ..backends import WEIGHT_CHOICES
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
            if o.type is bool and o.default:  # on by default: --flag / --no-flag
                g.add_argument(f"--{o.flag}", action=argparse.BooleanOptionalAction, default=True, help=o.help)
            elif o.type is bool:
                g.add_argument(f"--{o.flag}", action="store_true", help=o.help)
            else:
                g.add_argument(f"--{o.flag}", type=o.type, default=o.default, help=o.help,
                               choices=o.choices or None, metavar=o.metavar or ("DIR" if o.type is str and not o.choices else None))
    g.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and activations; float32 (default) guarantees greedy output identical to plain "
                        "decoding, bfloat16 only approximately (rounding differs between wide and narrow passes)")
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


def add_backend_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--backend", default=default_backend(), choices=("auto", *BACKENDS),
                   help="what runs the target: auto (default: the fastest installed engine on this CPU that runs the "
                        "model's own weights, timed once per model and CPU and stored; the choice is printed; "
                        f"${BACKEND_ENV} sets the default), "
                        "transformers (PyTorch, every drafter, token trees), "
                        "llamacpp (llama.cpp on the GGUF file, as CPU users run it; every drafter, chains only; "
                        "needs pip install \"verispec[llamacpp]\") or openvino (OpenVINO on the model exported once; "
                        "every drafter, trees included; needs pip install \"verispec[openvino]\")")
    g.add_argument("--weights", default="as-is", choices=WEIGHT_CHOICES,
                   help="llamacpp backend: the GGUF's weight format; as-is (default) runs the file as shipped, f32/f16/"
                        "q8_0/... convert it once (cached), auto times the candidates on this CPU once and picks the "
                        "fastest for speculation; openvino backend: as-is (default; a GGUF's own quantized blocks, "
                        "a transformers folder's float32 weights), fp32, bf16 (fp32 weights computed in bfloat16, "
                        "where the CPU has it), fp16, int8 or int4 (NNCF: these two re-quantize, a changed model), auto (the fastest of fp32, fp16 and "
                        "bf16 here)")
    g.add_argument("--threads", type=int, default=None,
                   help="llamacpp backend: CPU threads (default: the cores this process may use)")
    g.add_argument("--static-widths", default=None, metavar="W,W,...|none|auto",
                   help="openvino backend: a one-sequence pass of up to the largest of these widths is padded to the "
                        "next of them and runs on a graph of static shapes (default auto: 1,2,4,6, and 8,10 too where "
                        "passes of 7-10 tokens measure cheaper on them, timed once per CPU; none: every pass on the "
                        "dynamic graph). Static graphs cost load time and memory; measurements: docs/openvino.md)")
    add_compile_option(g)
    add_cost_cache_option(g)


def add_cost_cache_option(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--no-cost-cache", action="store_true",
                   help="measure the target's step costs afresh instead of starting from those an earlier run stored "
                        "for the same model, settings and CPU (also: VERISPEC_COST_CACHE=0; `verispec models` lists "
                        "what is stored)")


def add_compile_option(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--compile", nargs="?", const="on", default=default_compile_mode(), choices=COMPILE_MODES,
                   metavar="auto|on|off",
                   help="transformers backend, float32 on CPU: one-token decoding steps and verify passes of 2-12 "
                        "tokens compiled ahead of time (AOTInductor; the verify program where 4x the weights fit in "
                        "half the free memory; prefills, trees and wider passes stay eager). auto (default): use the "
                        "compiled programs stored by an earlier process, else decode eagerly (a server with "
                        "--max-batch 1 compiles them in the background and switches when ready); on: compile now if "
                        "none is stored (a few minutes once per model and machine, then seconds to load; needs a "
                        "C++ compiler); off: always eager. "
                        f"${COMPILE_ENV} sets the default. What it buys per CPU: docs/kernels.md")


def load_args_model(args, ref: str, **overrides):
    """Load ``ref`` with the backend options in ``args`` (overrides win)."""
    from ..backends import load_model

    backend = getattr(args, "backend", "transformers")
    # llama.cpp returns hidden states before the final one only when asked at load time (four-layer EAGLE heads)
    options = dict(dtype=args.dtype, backend=backend, weights=getattr(args, "weights", "as-is"),
                   threads=getattr(args, "threads", None),
                   features=backend == "llamacpp" and needs_layer_callback(args), compiled=getattr(args, "compile", "off"))
    from ..backends.openvino.widths import static_widths_option

    options.update(static_widths_option(getattr(args, "static_widths", None), backend))
    options.update(overrides)
    return load_model(ref, **options)


def build_decoder(args):
    """The decoder the options name: target, drafter (with its options) and the engine's settings."""
    from ..engine import SpeculativeDecoder

    target = load_args_model(args, args.target)
    draft_model = None
    draft_ref = args.draft_model or default_draft(args.target)  # a built-in target's own draft (Qwen 1.5B: 0.5B)
    if args.drafter != NONE and get_spec(args.drafter).needs_draft_model and draft_ref:
        draft_model = load_args_model(args, draft_ref)
    drafter = make_drafter(args.drafter, target=target, draft_model=draft_model, **options_from(args, args.drafter))
    return SpeculativeDecoder(target, drafter, k=args.k, acceptance=args.acceptance, k_policy=args.k_policy)
