"""Text corpora as training signal: documents the target reads with teacher forcing, no answers generated.

A head learns the target's next-token distribution from the target's hidden states, and the target has both on any
text it reads: one prefill pass gives a label (its full distribution, a soft label) at every position. Writing
answers costs one target step per token; reading text costs a fraction of that per token (one pass per sequence),
so human or model-written text is a cheap way to more signal (docs/eagle.md measures both).

``--text FILE`` in ``train-eagle`` and ``train-medusa``: a ``.jsonl`` file of ``{"text": ...}`` lines (a ``"prompt"``
field serves too), or any other file read whole as one document (``.txt``, ``.md``, source code). Each document is
tokenized as it stands (no chat template, no answer) and cut into sequences of at most ``seq_tokens`` tokens; the
pieces are stored as token-only shards (``data.py``'s format, ``answer_start`` 0: every position is labelled), in a
folder of their own keyed by the files and settings, and they join the training set only, never validation (which
stays on the target's own answers to held-out prompts).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Iterator

import torch

from ..errors import InvalidRequest
from ..jsonl import records
from .data import META, Sequence, load_meta, load_sequences, write_shard

MIN_PIECE = 16  # shorter document tails are dropped: a few positions of signal for a padded row


def read_documents(path: str | Path) -> Iterator[str]:
    """The documents of one corpus file: each JSONL line's ``"text"`` (or ``"prompt"``), or the whole file."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"--text {path} is not a file; pass a .jsonl file of {{\"text\": ...}} lines or a "
                             "plain text file")
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text
        return
    for n, record in records(path):
        text = record.get("text", record.get("prompt")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise InvalidRequest(f"{path}:{n} has no \"text\" string; each line needs {{\"text\": ...}}")
        if text.strip():
            yield text


def pieces(ids: list[int], seq_tokens: int) -> Iterator[list[int]]:
    """A document's tokens cut into consecutive sequences of at most ``seq_tokens`` (tails under MIN_PIECE dropped)."""
    for start in range(0, len(ids), seq_tokens):
        piece = ids[start : start + seq_tokens]
        if len(piece) >= MIN_PIECE:
            yield piece


def corpus_key(files: list[str | Path], target: str, seq_tokens: int, max_tokens: int | None) -> str:
    """Names the token data of these files: their content, the target (its tokenizer) and the cutting settings."""
    digest = hashlib.sha256(json.dumps([target, seq_tokens, max_tokens]).encode())
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_text_dataset(tokenizer, target: str, files: list[str | Path], out_dir: str | Path, *, seq_tokens: int = 512,
                       max_tokens: int | None = None, shard_size: int = 2048, progress: bool = True) -> Path:
    """Tokenize ``files`` into token-only shards under ``out_dir`` (kept and reused while the files and settings are
    the same; rebuilt otherwise). ``max_tokens``: stop after that many tokens in all."""
    from tqdm import tqdm

    if seq_tokens < MIN_PIECE:
        raise InvalidRequest(f"--text-seq-tokens must be at least {MIN_PIECE}, got {seq_tokens}")
    out = Path(out_dir)
    key = corpus_key(files, target, seq_tokens, max_tokens)
    meta_path = out / META
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == key:
        return out
    if out.exists():
        shutil.rmtree(out)  # other files or settings: never mix two corpora's pieces
    out.mkdir(parents=True)
    counts = {"documents": 0, "sequences": 0, "tokens": 0}

    def every_piece() -> Iterator[list[int]]:
        for f in files:
            for text in read_documents(f):
                counts["documents"] += 1
                yield from pieces(tokenizer(text, add_special_tokens=False)["input_ids"], seq_tokens)

    shard: list[Sequence] = []
    shards = 0
    with tqdm(desc="reading text", unit="tok", unit_scale=True, disable=not progress) as bar:
        for piece in every_piece():
            if max_tokens is not None and counts["tokens"] + len(piece) > max_tokens:
                break
            shard.append(Sequence(torch.tensor(piece), 0, None))
            counts["sequences"] += 1
            counts["tokens"] += len(piece)
            bar.update(len(piece))
            if len(shard) == shard_size:
                write_shard(out / f"shard-{shards:05d}.safetensors", shard)
                shards, shard = shards + 1, []
        if shard:
            write_shard(out / f"shard-{shards:05d}.safetensors", shard)
    if not counts["tokens"]:
        raise InvalidRequest(f"--text {', '.join(map(str, files))}: no document of at least {MIN_PIECE} tokens")
    meta = {"kind": "text", "key": key, "target": target, "files": [str(f) for f in files], "features": False,
            "layers": [], "seq_tokens": seq_tokens, "max_tokens": max_tokens, **counts}
    meta_path.write_text(json.dumps(meta, indent=2))  # written last: a folder without it is rebuilt
    return out


def load_text(folders: list[str | Path], target: str) -> tuple[list[Sequence], dict]:
    """The pieces stored in ``folders`` (built by ``build_text_dataset`` for ``target``) and a record of them."""
    sequences, record = [], {"files": [], "documents": 0, "sequences": 0, "tokens": 0}
    for folder in folders:
        meta = load_meta(folder)
        if meta.get("kind") != "text":
            raise InvalidRequest(f"{folder} holds no text corpus (its {META} is not a text corpus's)")
        if meta.get("target") != target:
            raise InvalidRequest(f"{folder} was tokenized for {meta.get('target')!r}, not {target!r}; build it again "
                                 "for this target")
        sequences.extend(load_sequences(folder))
        record["files"] += [Path(f).name for f in meta["files"]]
        for k in ("documents", "sequences", "tokens"):
            record[k] += int(meta[k])
    return sequences, record
