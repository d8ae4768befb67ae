"""Benchmarks: prompt sets, methods (verispec and transformers' peers), the interleaved runner, summaries."""

from .method import Method, Run
from .method_specs import build_method, parse_spec
from .prompts import GROUPS, Question, load_questions, select
from .runner import run_benchmark
from .summary import markdown, summarize

__all__ = ["GROUPS", "Method", "Question", "Run", "build_method", "load_questions", "markdown", "parse_spec",
           "run_benchmark", "select", "summarize"]
