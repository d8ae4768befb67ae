"""Text corpora as training signal (``verispec.training.corpus``): reading, cutting, storing, and training on them."""

import json
import random

import pytest

from verispec.training.corpus import build_text_dataset, load_text, pieces, read_documents
from verispec.training.data import build_dataset, load_meta, load_sequences
from verispec.errors import InvalidRequest

LAYERS = (1, 2)


def words(rng, n):
    return " ".join(f"w{rng.randrange(3, 32)}" for _ in range(n))


def test_documents_come_from_jsonl_lines_or_whole_files_and_bad_lines_are_named(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "w3 w4"}) + "\n\n" + json.dumps({"prompt": "w5"}) + "\n"
                     + json.dumps({"text": "  "}) + "\n")
    assert list(read_documents(jsonl)) == ["w3 w4", "w5"]
    plain = tmp_path / "notes.md"
    plain.write_text("w3\nw4 w5\n")
    assert list(read_documents(plain)) == ["w3\nw4 w5\n"]
    jsonl.write_text(json.dumps({"text": "w3"}) + "\n{oops\n")
    with pytest.raises(InvalidRequest, match=r"c.jsonl:2 is not valid JSON"):
        list(read_documents(jsonl))
    jsonl.write_text(json.dumps({"body": "w3"}) + "\n")
    with pytest.raises(InvalidRequest, match=r"c.jsonl:1 has no \"text\" string"):
        list(read_documents(jsonl))
    with pytest.raises(InvalidRequest, match="is not a file"):
        list(read_documents(tmp_path / "missing.jsonl"))


def test_a_document_is_cut_into_consecutive_sequences_and_short_tails_are_dropped():
    ids = list(range(100))
    cut = list(pieces(ids, 40))
    assert [len(p) for p in cut] == [40, 40, 20] and sum(cut, []) == ids
    assert [len(p) for p in pieces(list(range(90)), 40)] == [40, 40]  # a 10-token tail is too short to pay
    assert list(pieces(list(range(15)), 40)) == []


def test_text_is_stored_as_token_only_sequences_reused_until_the_files_change(tiny_target, tmp_path):
    rng = random.Random(0)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": words(rng, 70)}) + "\n" for _ in range(5)))
    folder = build_text_dataset(tiny_target.tokenizer, "tiny", [corpus], tmp_path / "text", seq_tokens=32,
                                progress=False)
    meta = load_meta(folder)
    seqs = list(load_sequences(folder))
    assert meta["kind"] == "text" and meta["documents"] == 5 and meta["features"] is False
    assert [len(s.tokens) for s in seqs] == [32, 32] * 5  # 70 words: two pieces of 32, a tail of 6 dropped
    assert meta["sequences"] == 10 and meta["tokens"] == 320
    assert all(s.answer_start == 0 and s.features is None for s in seqs)
    first = tiny_target.tokenizer(json.loads(corpus.read_text().splitlines()[0])["text"],
                                  add_special_tokens=False)["input_ids"]
    assert seqs[0].tokens.tolist() == first[:32] and seqs[1].tokens.tolist() == first[32:64]

    stamp = (folder / "meta.json").stat().st_mtime_ns
    build_text_dataset(tiny_target.tokenizer, "tiny", [corpus], folder, seq_tokens=32, progress=False)
    assert (folder / "meta.json").stat().st_mtime_ns == stamp  # the same files and settings: kept
    build_text_dataset(tiny_target.tokenizer, "tiny", [corpus], folder, seq_tokens=32, max_tokens=100, progress=False)
    assert load_meta(folder)["tokens"] == 96 and len(list(load_sequences(folder))) == 3  # rebuilt, capped
    corpus.write_text(json.dumps({"text": words(rng, 40)}) + "\n")
    build_text_dataset(tiny_target.tokenizer, "tiny", [corpus], folder, seq_tokens=32, progress=False)
    assert load_meta(folder)["documents"] == 1  # new content: rebuilt
    with pytest.raises(InvalidRequest, match="tokenized for 'tiny', not 'other'"):
        load_text([folder], "other")
    with pytest.raises(InvalidRequest, match="at least 16"):
        build_text_dataset(tiny_target.tokenizer, "tiny", [corpus], folder, seq_tokens=8, progress=False)


@pytest.fixture()
def answers_and_text(small_target, tmp_path):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 9))] for _ in range(40)]
    build_dataset(small_target, prompts, tmp_path / "data", layers=LAYERS, max_new_tokens=10, batch_size=16,
                  shard_size=16, progress=False, features=False)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": words(rng, 50)}) + "\n" for _ in range(6)))
    text = build_text_dataset(small_target.tokenizer, small_target.name, [corpus], tmp_path / "text", seq_tokens=24,
                              progress=False)
    return tmp_path / "data", text


def test_an_eagle_head_trains_on_text_as_well_and_is_validated_on_answers_only(small_target, answers_and_text,
                                                                              tmp_path):
    from dataclasses import replace

    from verispec.eagle.train import TrainConfig, train_head

    data, text = answers_and_text
    config = TrainConfig(epochs=2, lr=3e-3, warmup_steps=2, batch_tokens=96, draft_vocab_size=24, val_sequences=6,
                         val_every=1000, bf16_autocast=False, feature_layers=list(LAYERS))
    quiet = dict(progress=False, log=lambda m: None)
    alone = train_head(small_target, data, tmp_path / "alone", config, **quiet)
    both = train_head(small_target, data, tmp_path / "both", config, text_dirs=[text], **quiet)
    # every text position with a label is trained on, every epoch (positions 0 .. n-3 of each 24-token piece)
    assert both.train_tokens - alone.train_tokens == 2 * 12 * 22
    assert both.steps > alone.steps
    record = json.loads((tmp_path / "both" / "config.json").read_text())["training"]["data"]
    assert record["text"] == {"files": ["corpus.jsonl"], "documents": 6, "sequences": 12, "tokens": 288}
    assert record["sequences"] == 40  # the answers: validation is drawn from them alone
    assert both.val_history[-1]["top1"] != alone.val_history[-1]["top1"]  # the text moved the head

    first = train_head(small_target, data, tmp_path / "split", config, text_dirs=[text],
                       should_stop=lambda step: step >= 3, **quiet)
    assert not first.finished
    with pytest.raises(Exception, match="other settings"):  # resuming without the text would replay other batches
        train_head(small_target, data, tmp_path / "split", replace(config, resume=True), **quiet)
    rest = train_head(small_target, data, tmp_path / "split", replace(config, resume=True), text_dirs=[text], **quiet)
    assert rest.finished and rest.train_tokens == both.train_tokens


def test_medusa_heads_train_on_text_as_well(small_target, answers_and_text, tmp_path):
    from verispec.medusa.train import MedusaTrainConfig, train_medusa

    data, text = answers_and_text
    config = MedusaTrainConfig(num_heads=2, epochs=1, lr=3e-3, warmup_steps=2, batch_tokens=96, draft_vocab_size=24,
                               val_sequences=6, val_every=1000, bf16_autocast=False)
    quiet = dict(progress=False, log=lambda m: None)
    alone = train_medusa(small_target, data, tmp_path / "alone", config, **quiet)
    both = train_medusa(small_target, data, tmp_path / "both", config, text_dirs=[text], **quiet)
    assert both.train_tokens > alone.train_tokens and both.steps > alone.steps
    record = json.loads((tmp_path / "both" / "config.json").read_text())["training"]["data"]
    assert record["text"]["sequences"] == 12


def test_train_eagle_reads_text_files_and_refuses_missing_ones(tiny_dir, tmp_path, capsys):
    from verispec.cli import main
    from verispec.eagle.head import EagleHead

    rng = random.Random(2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": words(rng, 5)}) + "\n" for _ in range(30)))
    notes = tmp_path / "notes.txt"
    notes.write_text(words(rng, 200))
    args = ["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(tmp_path / "head"),
            "--data", str(tmp_path / "data"), "--samples", "24", "--max-new-tokens", "6", "--epochs", "1",
            "--draft-vocab", "16", "--check-prompts", "0", "--features", "online", "--batch-tokens", "128",
            "--val-sequences", "4", "--text", str(notes), "--text-seq-tokens", "64"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["finished"]
    text = EagleHead.load(tmp_path / "head").config.training["data"]["text"]
    assert text["files"] == ["notes.txt"] and text["tokens"] == 192  # 200 words: three pieces of 64, tail dropped
    assert main(args[:-4] + ["--text", str(tmp_path / "nothing.txt")]) == 2
    assert "--text" in capsys.readouterr().err
    assert main(args[:-2] + ["--text-seq-tokens", "4"]) == 2
    assert "--text-seq-tokens must be >= 16" in capsys.readouterr().err
