"""Gather text found on this machine, with no network, into a JSONL corpus for `train-eagle --text`.

Sources (each line: {"source", "path", "text"}):
  wikipedia  the Wikipedia passages of the training prompts file (Dolly's `dolly_with_context` prompts) that are too
             long to be a training prompt (more than --max-prompt-tokens in the chat template, the same rule as
             train-eagle's), so no passage of a prompt the head is validated on is read as text;
  stdlib     the Python standard library's source (tests left out);
  docs       documentation shipped with the installed packages: README/docs files (.md, .rst, .txt) and each
             package's long description (its METADATA body).

    python experiments/offline_corpus.py --prompts data/train-prompts/train_prompts.jsonl --out corpus.jsonl
    verispec train-eagle ... --text corpus.jsonl

Prints documents, characters and target tokens per source. Spec-Bench text is never read.
"""

from __future__ import annotations

import argparse
import json
import site
import sys
import sysconfig
from collections import Counter
from email.parser import Parser
from pathlib import Path

SKIP_NAMES = {"license", "license.txt", "license.md", "license.rst", "copying", "copying.txt", "authors", "authors.txt",
              "record", "top_level.txt", "entry_points.txt", "requires.txt", "sources.txt", "dependency_links.txt",
              "notice", "notice.txt", "installer", "requested", "wheel", "license.rst.txt"}
MAX_DOC_BYTES = 2_000_000  # generated or data files beyond this are not prose or code worth reading


def wikipedia(prompts: Path, tokenizer, max_prompt_tokens: int):
    from verispec.training.data import chat_ids

    with open(prompts, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if record.get("category") != "dolly_with_context":
                continue
            prompt = record["prompt"]
            if len(chat_ids(tokenizer, prompt)) <= max_prompt_tokens:
                continue  # a possible training or validation prompt: its passage stays out of the text
            yield record.get("id", ""), prompt


def stdlib():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3") or "tests" in rel.parts:
            continue
        yield str(rel), path


def docs():
    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    for root in roots:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.name.lower() in SKIP_NAMES:
                continue
            if path.name == "METADATA" and path.parent.name.endswith(".dist-info"):
                yield str(path.relative_to(root)), Parser().parsestr(path.read_text(errors="replace")).get_payload()
            elif path.suffix.lower() in (".md", ".rst") or (path.suffix.lower() == ".txt" and "doc" in str(path).lower()):
                yield str(path.relative_to(root)), path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="the training prompts file (its Wikipedia passages are read)")
    ap.add_argument("--out", required=True, help="the JSONL corpus written")
    ap.add_argument("--sources", default="wikipedia,stdlib,docs", help="comma-separated (default: all three)")
    ap.add_argument("--target", default="smollm2-135m", help="whose tokenizer counts the tokens (default: smollm2-135m)")
    ap.add_argument("--max-prompt-tokens", type=int, default=320, help="train-eagle's setting (default: 320)")
    args = ap.parse_args()

    from verispec.backends import load_model

    tokenizer = load_model(args.target, dtype="float32").tokenizer
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    unknown = set(sources) - {"wikipedia", "stdlib", "docs"}
    if unknown:
        ap.error(f"unknown source(s) {sorted(unknown)}; choose among wikipedia, stdlib, docs")
    stats: dict[str, Counter] = {}
    with open(args.out, "w", encoding="utf-8") as out:
        for source in sources:
            items = {"wikipedia": lambda: wikipedia(Path(args.prompts), tokenizer, args.max_prompt_tokens),
                     "stdlib": stdlib, "docs": docs}[source]()
            count = stats.setdefault(source, Counter())
            for name, item in items:
                if isinstance(item, Path):
                    if item.stat().st_size > MAX_DOC_BYTES:
                        continue
                    item = item.read_text(encoding="utf-8", errors="replace")
                if not item or len(item.strip()) < 200:
                    continue
                out.write(json.dumps({"source": source, "path": name, "text": item}) + "\n")
                count["documents"] += 1
                count["characters"] += len(item)
                count["tokens"] += len(tokenizer(item, add_special_tokens=False)["input_ids"])
    for source, count in stats.items():
        print(f"{source}: {count['documents']} documents, {count['characters']:,} characters, "
              f"{count['tokens']:,} tokens", file=sys.stderr)
    total = sum((c for c in stats.values()), Counter())
    print(f"all: {total['documents']} documents, {total['tokens']:,} tokens -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
