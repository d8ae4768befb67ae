"""A first start's steps say what they do and, from their second run on a machine, what they should take; the rate is
stored with the other measurements."""

import logging

import pytest

from verispec.backends import steps


def test_a_step_says_what_it_took_and_estimates_the_next_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    clock = iter([100.0, 130.0, 200.0, 260.0])
    monkeypatch.setattr(steps, "_clock", lambda: next(clock))
    caplog.set_level(logging.WARNING, logger="verispec.steps")
    with steps.step("converting tiny.gguf", "convert-gguf", 2_000_000_000):
        pass
    assert "converting tiny.gguf (2.00 GB): first time on this machine" in caplog.text
    assert "converting tiny.gguf: done in 30 s" in caplog.text
    assert steps.expected_seconds("convert-gguf", 1_000_000_000) == pytest.approx(15.0)  # 15 s a GB
    caplog.clear()
    with steps.step("converting other.gguf", "convert-gguf", 4_000_000_000):
        pass
    assert "converting other.gguf (4.00 GB): about 60 s here, as it took last time" in caplog.text
    assert steps.expected_seconds("export", 1_000_000_000) is None  # another step: never timed here


def test_a_failed_step_stores_no_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    with pytest.raises(RuntimeError):
        with steps.step("exporting", "export", 1_000_000):
            raise RuntimeError("the export failed")
    assert steps.expected_seconds("export", 1_000_000) is None


def test_size_of_a_file_and_a_folder(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 5)
    assert steps.size_of(tmp_path / "a.bin") == 10 and steps.size_of(tmp_path) == 15
    assert steps.size_of(tmp_path / "missing") == 0
