"""Self-distillation data for an EAGLE head: the target answers training prompts, and its own hidden states
on prompt + answer are cached to disk.

The head learns to predict the target's *own* next-token distribution, so the answers are the target's
greedy outputs (not a dataset's reference answers) and the labels are computed from the cached final hidden
state with the target's frozen lm_head at training time.

On disk (``DIR``): ``meta.json`` and shards ``shard-NNNNN.safetensors``, each holding, for S sequences with N
tokens in all: ``tokens`` [N] int32, ``offsets`` [S+1] int64 (sequence i is tokens[offsets[i]:offsets[i+1]]),
``answer_start`` [S] int64 (index inside the sequence where the answer begins), ``features`` [N, L, H] bfloat16
(the hidden states named by ``meta.json``'s ``layers``, then the final normed state). Shards are written one at
a time, so an interrupted run resumes where it stopped, and a run with more prompts adds only the new ones. A prompt
may be answered more than once (``--answers-per-prompt``): its first answer is greedy, the others are sampled, and
``meta.json``'s ``answer_temperatures`` lists the temperatures of the answers on disk (0 for greedy).

Token-only data (``features=False``; ``meta.json`` says ``"features": false``) holds the answers without their
hidden states: the trainer then runs the target over each batch itself (teacher forcing, see
``batch_features``). That costs one target forward pass per sequence and epoch instead of 4.6 kB of disk per
token for the default model's four feature layers, and it is the form that pays on a GPU.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from ..errors import InvalidRequest
from ..jsonl import records
from ..backends import LoadedModel  # training reads a transformers target

META = "meta.json"


@dataclass
class Sequence:
    tokens: torch.Tensor  # [n] long: prompt + answer
    answer_start: int
    features: torch.Tensor | None  # [n, L+1, H]: the feature layers, then the final normed state (None: token-only)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file of ``{"prompt": ...}`` lines (other fields ignored)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"prompt file {path} does not exist; pass a JSONL file with one {{\"prompt\": ...}} per line")
    prompts = []
    for n, record in records(path):
        text = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest(f"{path}:{n} has no non-empty \"prompt\" string")
        prompts.append(text)
    if not prompts:
        raise InvalidRequest(f"{path} holds no prompts")
    return prompts


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the engine encodes it: one user message with the chat template, when there is one."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def select_prompts(target: LoadedModel, prompts: list[str], count: int, max_prompt_tokens: int,
                   seed: int = 0) -> list[list[int]]:
    """``count`` encoded prompts of at most ``max_prompt_tokens`` tokens, in a seeded random order."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    chosen = []
    for i in order:
        ids = chat_ids(target.tokenizer, prompts[i])
        if len(ids) <= max_prompt_tokens:
            chosen.append(ids)
            if len(chosen) == count:
                break
    return chosen


def batch_features(model, ids: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Hidden states [B, T, L+1, H] of a right-padded batch ``ids`` [B, T] (``mask`` 1 on real tokens), on the
    model's device and in its dtype: the feature layers, then the final normed state. Padding rows are garbage."""
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = out.hidden_states
    return torch.stack([hidden[i] for i in layers] + [hidden[-1]], dim=2)


def target_features(target: LoadedModel, batch: list[list[int]], layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Hidden states [n, L+1, H] of each sequence (feature layers, then the final normed state), from one
    right-padded forward pass."""
    width = max(len(s) for s in batch)
    device = target.device
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    stacked = batch_features(target.model, ids, mask, layers)
    return [stacked[row, : len(seq)].to(torch.bfloat16).cpu().clone() for row, seq in enumerate(batch)]


def generate_answers(target: LoadedModel, batch: list[list[int]], max_new_tokens: int,
                     temperature: float = 0.0) -> list[list[int]]:
    """The target's answers to a batch of encoded prompts (left-padded ``generate``): greedy, or sampled from its
    full distribution at ``temperature`` > 0 (no top-k or top-p; seed torch's generator first for a repeatable
    draw). An answer ends with its EOS token when the target produced one."""
    device = target.device
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for row, seq in enumerate(batch):
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    # a model without EOS tokens answers to the length cap: the generation config's EOS neither stops an answer nor
    # is suppressed (min_new_tokens would take it out of the distribution the answers are drawn from)
    config = copy.deepcopy(target.model.generation_config)
    config.update(max_new_tokens=max_new_tokens, min_new_tokens=None, pad_token_id=pad,
                  eos_token_id=sorted(target.eos_token_ids) or None)
    if temperature > 0:
        config.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None)
    else:
        config.update(do_sample=False, temperature=None, top_k=None, top_p=None, min_p=None)
    out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    answers = []
    for row in out[:, width:].tolist():
        answer = []
        for token in row:
            answer.append(token)
            if token in target.eos_token_ids:
                break
        answers.append(answer)
    return answers


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def build_dataset(target: LoadedModel, prompts: list[list[int]], out_dir: str | Path, *, layers: tuple[int, ...],
                  max_new_tokens: int = 192, batch_size: int = 16, shard_size: int = 128,
                  progress: bool = True, source: str = "", features: bool = True,
                  max_seconds: float | None = None, temperatures: list[float] | None = None,
                  seed: int = 0, answer: Callable[[list[list[int]], int, float, int], list[list[int]]] | None = None,
                  answered_by: str = "transformers") -> Path:
    """Let the target answer ``prompts`` (encoded) and cache its hidden states under ``out_dir`` (only the tokens
    with ``features=False``). Resumes: shards already on disk are kept. ``max_seconds``: stop starting new shards
    after that long (the data so far is complete and usable; a later call answers the rest). ``temperatures``: one
    per prompt, 0 for a greedy answer (the default for all), > 0 for an answer sampled at that temperature; sampling
    is seeded per shard from ``seed``. ``answer(prompts, max_new_tokens, temperature, seed)``: another way to write
    the answers (default: ``generate_answers`` on ``target``; the CLI's ``--gen-backend llamacpp`` passes llama.cpp's
    batch engine), ``answered_by`` its name for ``meta.json``; the hidden states are always ``target``'s."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": target.name, "layers": list(layers) if features else [],
            "hidden_size": int(target.model.config.hidden_size), "vocab_size": target.vocab_size,
            "max_new_tokens": max_new_tokens, "sequences": len(prompts), "shard_size": shard_size, "source": source,
            "dtype": str(target.dtype).removeprefix("torch."), "features": features,
            "answer_temperatures": sorted({float(t) for t in temperatures or [0.0]}), "answered_by": answered_by}
    meta_path = out / META
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        meta["answer_temperatures"] = sorted(set(meta["answer_temperatures"]) | set(old.get("answer_temperatures", [0.0])))
        if old.get("features", True) != features:
            raise InvalidRequest(f"{out} holds {'features' if old.get('features', True) else 'tokens only'}, but "
                                 f"this run asks for {'features' if features else 'tokens only'}; use another "
                                 "--data folder or the matching --features")
        if set(layers) <= set(old.get("layers") or ()):  # more layers serve too (Medusa reads the final state only)
            layers = tuple(old["layers"])
            meta["layers"] = list(layers)
        for key in ("target", "layers", "max_new_tokens", "shard_size"):
            if old.get(key) != meta[key]:
                raise InvalidRequest(f"{out} holds data built with {key}={old.get(key)!r}, not {meta[key]!r}; "
                                     "use another --data folder or delete this one")
    meta_path.write_text(json.dumps(meta, indent=2))
    shards = list(_batches(prompts, shard_size))
    bar = tqdm(total=len(prompts), desc="self-distilling", unit="answer", disable=not progress)
    started = time.perf_counter()
    with torch.inference_mode():
        for index, shard in enumerate(shards):
            path = out / f"shard-{index:05d}.safetensors"
            # a shard written by a run with fewer prompts gets the rest; its features are read only then
            first = index * shard_size
            todo = _unanswered(shard, _shard_prompts(path) if path.exists() else [])
            bar.update(len(shard) - len(todo))
            if not todo:
                continue
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                bar.write(f"verispec: answering stopped after {max_seconds:.0f} s ({bar.n} of {len(prompts)} "
                          "answers); a later run answers the rest")
                break
            sequences: list[Sequence] = list(_read_shard(path)) if path.exists() else []
            temps = [0.0 if temperatures is None else float(temperatures[first + i]) for i in todo]
            if any(t > 0 for t in temps):  # only sampled answers draw from torch's generator
                torch.manual_seed(seed * 1_000_003 + index)
            # batches of one temperature, length-sorted (less compute wasted on padding)
            order = sorted(range(len(todo)), key=lambda i: (temps[i], len(shard[todo[i]])))
            chunks = [c for t in sorted(set(temps)) for c in _batches([i for i in order if temps[i] == t], batch_size)]
            for number, chunk in enumerate(chunks):
                batch = [shard[todo[i]] for i in chunk]
                if answer is None:
                    answers = generate_answers(target, batch, max_new_tokens, temps[chunk[0]])
                else:  # seeded per shard and chunk, so a resumed run draws what an uninterrupted one would
                    answers = answer(batch, max_new_tokens, temps[chunk[0]], (seed * 1_000_003 + index) * 4096 + number)
                full = [p + a for p, a in zip(batch, answers)]
                feats = target_features(target, full, layers) if features else [None] * len(full)
                for prompt, seq, f in zip(batch, full, feats):
                    sequences.append(Sequence(torch.tensor(seq), len(prompt), f))
                bar.update(len(chunk))
            write_shard(path, sequences)
    bar.close()
    meta["sequences"] = bar.n  # the answers on disk (fewer than the prompts when --gen-minutes stopped early)
    meta_path.write_text(json.dumps(meta, indent=2))
    return out


def _unanswered(prompts: list[list[int]], answered: list[tuple[int, ...]]) -> list[int]:
    """Indices of the prompts not in ``answered`` yet (a multiset difference: a prompt may occur twice)."""
    have = Counter(answered)
    todo = []
    for i, prompt in enumerate(prompts):
        key = tuple(prompt)
        if have[key]:
            have[key] -= 1
        else:
            todo.append(i)
    return todo


def write_shard(path: Path, sequences: list[Sequence]) -> None:
    """Write ``sequences`` as one shard (the format above), atomically: a shard on disk is always whole."""
    lengths = torch.tensor([0] + [len(s.tokens) for s in sequences])
    tensors = {
        "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
        "offsets": lengths.cumsum(0),
        "answer_start": torch.tensor([s.answer_start for s in sequences]),
    }
    if sequences[0].features is not None:
        tensors["features"] = torch.cat([s.features for s in sequences])
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.rename(path)  # an interrupted write never looks like a finished shard


def load_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / META
    if not path.exists():
        raise InvalidRequest(f"{data_dir} holds no training data ({META} missing); build it with verispec train-eagle")
    return json.loads(path.read_text())


def _shard_prompts(path: Path) -> list[tuple[int, ...]]:
    """The prompts a shard answers, read without its features."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tokens, offsets, starts = f.get_tensor("tokens"), f.get_tensor("offsets").tolist(), f.get_tensor("answer_start")
    return [tuple(tokens[a : a + int(st)].tolist()) for a, st in zip(offsets[:-1], starts)]


def _read_shard(path: Path) -> Iterator[Sequence]:
    shard = load_file(str(path))
    offsets = shard["offsets"].tolist()
    features = shard.get("features")
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        yield Sequence(shard["tokens"][a:b].long(), int(shard["answer_start"][i]),
                       None if features is None else features[a:b])


def load_sequences(data_dir: str | Path) -> Iterable[Sequence]:
    """Every cached sequence, shard by shard."""
    for path in sorted(Path(data_dir).glob("shard-*.safetensors")):
        yield from _read_shard(path)
