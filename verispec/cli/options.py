"""Command-line options that pick the target backend, shared by generate, audit, bench, analyze and serve."""

from __future__ import annotations

import argparse

from .backend import BACKENDS

WEIGHT_CHOICES = ("as-is", "auto", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")


def add_backend_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--backend", default="transformers", choices=BACKENDS,
                   help="what runs the target: transformers (default; PyTorch, every drafter, token trees) or "
                        "llamacpp (llama.cpp on the GGUF file, as CPU users run it; every drafter, chains only; "
                        "needs pip install \"verispec[llamacpp]\")")
    g.add_argument("--weights", default="as-is", choices=WEIGHT_CHOICES,
                   help="llamacpp backend: the GGUF's weight format; as-is (default) runs the file as shipped, f32/f16/"
                        "q8_0/... convert it once (cached), auto times the candidates on this CPU once and picks the "
                        "fastest for speculation")
    g.add_argument("--threads", type=int, default=None,
                   help="llamacpp backend: CPU threads (default: the cores this process may use)")
    add_compile_option(g)


def add_compile_option(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--compile", action="store_true",
                   help="transformers backend, float32 on CPU: compile the one-token decoding step with inductor at "
                        "load (about a minute, once per process; needs a C++ compiler, else decoding stays eager). "
                        "Plain decoding then ran ~2x faster on a 2-core EPYC; verify passes stay eager")


def load_args_model(args, ref: str, **overrides):
    """Load ``ref`` with the backend options in ``args`` (overrides win)."""
    from .models import load_model

    backend = getattr(args, "backend", "transformers")
    # llama.cpp returns hidden states only when asked at load time (EAGLE heads need them)
    eagle = getattr(args, "drafter", None) == "eagle" or bool(getattr(args, "eagle_head", None))
    options = dict(dtype=args.dtype, backend=backend, weights=getattr(args, "weights", "as-is"),
                   threads=getattr(args, "threads", None), features=backend == "llamacpp" and eagle,
                   compiled=getattr(args, "compile", False))
    options.update(overrides)
    return load_model(ref, **options)
