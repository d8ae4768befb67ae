"""Tiny random-weight models of the architecture families users bring (no download): their configs carry what
differs between families (sliding-window layers, QK norms, tied embeddings, soft-capped logits, fused projections,
attention biases), so a feature that works on Llama alone fails here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
import transformers

from tiny import EOS, VOCAB, loaded
from verispec.backends.references import cache_dir

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
              eos_token_id=EOS, pad_token_id=0)

# family -> (config class, model class, what sets it apart)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # q/k/v biases, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=True)),  # QK norms
    # sliding-window layers (window 6, every other layer), soft-capped logits, scaled embeddings, tied embeddings
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=6, final_logit_softcapping=5.0, query_pre_attn_scalar=8,
                    layer_types=["sliding_attention", "full_attention"] * 2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False)),  # every layer slides
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),  # fused qkv and gate_up projections
}


def make_zoo_model(family: str, seed: int = 0) -> torch.nn.Module:
    config_class, model_class, extra = ARCHITECTURES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()


def zoo_target(family: str, seed: int = 0):
    return loaded(make_zoo_model(family, seed), name=f"tiny-{family}")


def batch_engine_outputs(target, prompts, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's output from one batch engine (3 rows, 4-token prefill chunks; every other sequence drafts
    n-grams), for comparison with lone decoding."""
    from verispec import NgramDrafter, SpeculativeDecoder
    from verispec.batching import BatchEngine

    engine = BatchEngine(target, max_batch=3, prefill_chunk=4)
    seqs = []
    for i, p in enumerate(prompts):
        d = SpeculativeDecoder(target, NgramDrafter() if i % 2 else None, k=3, k_policy="fixed")
        seqs.append(engine.submit(d, d.request(p, max_new_tokens=max_new_tokens)))
    while engine.busy:
        engine.step()
    return [s.result.token_ids for s in seqs]


def assert_rollback_matches(target, kv, tokens, expected) -> None:
    """Feed ``tokens`` in chunks of 3 into the empty cache ``kv``, a rejected draft of 1 to 4 tokens cut off before
    each chunk; every chunk's logits must be ``expected``'s rows (a forward with no cache)."""
    target.forward(kv, tokens[:8])
    for i, start in enumerate(range(8, len(tokens), 3)):
        target.forward(kv, [30, 29, 28, 27][: 1 + i % 4])
        kv.truncate(start)
        out = target.forward(kv, tokens[start : start + 3]).logits
        torch.testing.assert_close(out, expected[start : start + 3], atol=1e-4, rtol=1e-4)
    assert len(kv) == len(tokens)


# ------------------------------------------------------------------------- the same families as GGUF files

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release the extras pin: its converter matches its llama.cpp

# Runs llama.cpp's converter with tokenizers read as saved (tokenizer.json): transformers 5 rebuilds some families'
# tokenizers (Qwen2's pre-tokenizer) from the model type, which the converter's pre-tokenizer check does not know.
_AS_SAVED = """
import runpy, sys
import transformers
from transformers import PreTrainedTokenizerFast
transformers.AutoTokenizer.from_pretrained = staticmethod(lambda path, *a, **k: PreTrainedTokenizerFast.from_pretrained(path))
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_converter() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (with the ``conversion`` and ``gguf-py`` packages beside it) from
    llama-cpp-python's source distribution, which pip downloads once into the verispec cache (its wheel does not
    carry the converter)."""
    root = cache_dir() / f"llama.cpp-converter-{LLAMA_CPP_PYTHON}"
    script = root / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tempfile.TemporaryDirectory() as tmp:
        # --no-binary for this package only: with ':all:' pip built the sdist's build requirements from source too,
        # 5 min of a cold run's zoo setup on 2 cores, against 6 s taking them as wheels
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                        "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        staging = Path(tmp) / "converter"
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                rest = member.name[len(prefix):] if member.name.startswith(prefix) else ""
                if member.isfile() and rest.startswith(keep):
                    member.name = rest
                    archive.extract(member, staging, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        mine = root.with_name(f".{root.name}.{os.getpid()}")  # beside the cache (same file system), then renamed
        shutil.rmtree(mine, ignore_errors=True)
        shutil.move(str(staging), mine)
        if root.exists() and not script.is_file():  # left half-written by an interrupted run
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(mine, root)
        except OSError:  # another pytest-xdist worker put it there first, and may be running it: keep theirs
            shutil.rmtree(mine, ignore_errors=True)
    return script


# llama.cpp takes Gemma 3's layer pattern from the architecture, not the file: five sliding layers, then a full one
GGUF_CONFIG = {"gemma3": dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])}


def zoo_gguf(family: str, tokenizer, folder: Path, seed: int = 0, outtype: str = "f32", **config) -> Path:
    """The family's tiny model with ``tokenizer``'s vocabulary (llama.cpp's converter accepts only tokenizers it
    knows), written as a GGUF of ``outtype`` (f32, q8_0, ...) by llama.cpp's own converter; returns the file. The
    transformers model is ``folder`` (load it with ``from_pretrained`` to compare). ``config`` overrides the zoo's sizes."""
    config_class, model_class, extra = ARCHITECTURES[family]
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **GGUF_CONFIG.get(family, {}), **ids,
                                                   **config})
    torch.manual_seed(seed)
    getattr(transformers, model_class)(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = folder / "tokenizer_config.json"
    # Phi-3's converter reads a GPT-2-style vocabulary only when the tokenizer says it is one
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    out = folder.with_suffix(".gguf")
    # named "zoo": llama.cpp sets token attributes by model name ("phi3" asks for </s>, <unk>, <s>, which SmolLM2's
    # vocabulary lacks) and those touch only its own tokenizer, which verispec does not use
    done = subprocess.run([sys.executable, "-c", _AS_SAVED, str(gguf_converter()), str(folder), "--outtype", outtype,
                           "--outfile", str(out), "--model-name", "zoo"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed on the tiny {family}:\n{done.stderr[-3000:]}")
    return out
