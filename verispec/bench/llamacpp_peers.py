"""llama-cpp-python's own generation as benchmark peers: what a CPU user runs without verispec.

    llamacpp                 plain generation (``Llama.generate``) on the GGUF file (``:weights=f16`` etc. converts it)
    llamacpp:lookup          llama-cpp-python's prompt-lookup decoding (``LlamaPromptLookupDecoding``; :k=10:ngram=2)

Each peer gets the prompt's token ids from verispec's tokenizer (the same ids every method sees) and starts from an
empty cache, like every other method. Greedy is llama.cpp's greedy sampler; sampling uses its temperature and top-p
samplers seeded per answer (no min-p, no repeat penalty), so only greedy runs are comparable token for token.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import InvalidRequest
from .method import Method, Run


def build_llamacpp_peer(spec: str, kind: str, opts: dict, gguf_path, threads: int | None, eos_ids) -> Method:
    """A peer over the GGUF file at ``gguf_path``; it stops at ``eos_ids`` (the target's end tokens)."""
    from ..backends.peers import default_threads, ensure_runs, import_llama_cpp, no_extra_buffers

    llama_cpp = import_llama_cpp()
    draft = None
    k = None
    if kind == "lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        k = int(opts.pop("k", 10))
        draft = LlamaPromptLookupDecoding(max_ngram_size=int(opts.pop("ngram", 2)), num_pred_tokens=k)
    elif kind:
        raise InvalidRequest(f"unknown llama.cpp peer {spec!r}; choose llamacpp or llamacpp:lookup")
    if opts:
        raise InvalidRequest(f"{spec!r}: unknown option(s) {', '.join(opts)}")
    threads = threads or default_threads()
    with no_extra_buffers(llama_cpp, off=not ensure_runs(Path(gguf_path), threads)):  # as the backend loads it
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                              draft_model=draft, logits_all=draft is not None, verbose=False)
    eos = frozenset(eos_ids)

    def run(prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=0) -> Run:
        llm.reset()
        if temperature > 0:
            llm.set_seed(seed)
        new: list[int] = []
        arrivals: list[float] = []
        finish = "length"
        start = time.perf_counter()
        for token in llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=top_p if temperature > 0 else 1.0,
                                  min_p=0.0, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            arrivals.append(time.perf_counter())
            if token in eos:
                finish = "stop"
                break
            if len(new) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        times = [start, *arrivals]
        return Run(new, wall, [1] * len(new), [b - a for a, b in zip(times, times[1:])], finish)

    kernel = f"llama-cpp-python: {gguf_path.name}, {threads or default_threads()} threads"
    return Method(spec, run, "llama.cpp", kind or "none", k, kernel)
