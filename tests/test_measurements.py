"""Measured step costs outlive the process: stored under a key of everything that changes them, read back by the
next process (no calibration), dropped when they disagree with what the new process measures, never read under
another key (CPU flags, model, settings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verispec import load_model
from verispec.backends import measurements
from verispec.controller import COST_RECORD, CostCurve, save_cost_curve, shared_cost_curve


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(measurements.ENV, str(tmp_path / "store"))
    return tmp_path / "store"


def test_a_record_is_read_back_under_exactly_its_key(store):
    key = {"cpu": "X", "cpu_flags": ["avx2"], "model": "m", "threads": 2}
    measurements.save("thing", key, {"1": 0.5})
    assert measurements.load("thing", dict(key)) == {"1": 0.5}
    assert measurements.load("thing", {**key, "cpu_flags": ["avx2", "avx512f"]}) is None  # another CPU
    assert measurements.load("thing", {**key, "model": "other"}) is None
    assert measurements.load("other-kind", key) is None
    assert [r["kind"] for r in measurements.records()] == ["thing"]


def test_verispec_models_says_what_weights_auto_chose(store, capsys):
    from verispec.cli import print_measurements

    measurements.save("openvino-weights", {"model": "m", "threads": 2, "candidates": ["fp32", "fp16"]},
                      {"timings_ms": {"fp32": {"1": 23.0}, "fp16": {"1": 17.4}}, "choice": "fp16"})
    measurements.save("cost-curve", {"backend": "openvino", "weights": "fp16", "threads": 2}, {"1": 0.017})
    print_measurements()
    lines = capsys.readouterr().out.splitlines()
    assert any("openvino-weights" in ln and "m, threads 2, auto chose fp16 of fp32/fp16" in ln for ln in lines)
    assert not any("cost-curve" in ln and "auto chose" in ln for ln in lines)  # a curve records no choice


def test_verispec_models_says_what_static_widths_auto_chose(store, capsys):
    from verispec.cli import print_measurements

    measurements.save("openvino-static-widths", {"weights": "int4", "threads": 2,
                                                 "candidates": ["2/4/6", "2/4/6/8/10"]},
                      {"timings_ms": {}, "static_over_dynamic": 0.7, "choice": "2/4/6/8/10"})
    print_measurements()
    line, = [ln for ln in capsys.readouterr().out.splitlines() if "openvino-static-widths" in ln]
    assert "weights int4, threads 2, auto chose 2/4/6/8/10 of 2/4/6 or 2/4/6/8/10" in line


def test_the_store_can_be_turned_off(store, monkeypatch):
    monkeypatch.setenv(measurements.ENV, "0")
    assert measurements.save("thing", {"a": 1}, 1) is None and measurements.load("thing", {"a": 1}) is None
    assert not store.exists()


def test_a_seeded_curve_follows_the_live_measurements_and_drops_a_stale_seed():
    curve = CostCurve()
    curve.seed({1: 0.010, 2: 0.012, 5: 0.020})
    assert curve.seeded and curve(1) == pytest.approx(0.010)
    for _ in range(3):
        curve.observe(1, 0.011)  # agrees (within the stale factor): kept, and moved towards the live value
    assert 0.010 < curve(1) < 0.011 and curve.measured().keys() == {1, 2, 5}
    for _ in range(3):
        curve.observe(2, 0.060)  # five times the stored value, steadily: the machine is not what it was
    assert curve.measured()[2] == pytest.approx(0.060)  # this width is measured again ...
    assert curve.measured()[5] == pytest.approx(0.020) and curve.seeded  # ... the others wait for their own steps


def test_a_stored_width_is_judged_against_the_noise_its_own_steps_show(caplog):
    """Steps that spread (another process sharing the cores) widen the band a stored cost must leave to be dropped:
    a busy moment does not throw away what an idle machine measured; steady disagreement still does."""
    import logging

    curve = CostCurve()
    curve.seed({1: 0.010, 2: 0.012})
    with caplog.at_level(logging.INFO, logger="verispec.controller"):
        for seconds in (0.010, 0.031, 0.017):  # median 1.4x the stored value; the steps vary 3.1x among themselves
            curve.observe(2, seconds)
        assert 2 not in curve._seeded and "measuring it again" not in caplog.text  # judged and kept
        for seconds in (0.020, 0.021, 0.020):  # steadily 2x: beyond the 1.5x band of steps this steady
            curve.observe(1, seconds)
    assert "width 1 disagrees" in caplog.text and curve.measured()[1] == pytest.approx(0.0203, rel=0.01)


def test_a_seed_that_makes_wide_passes_dear_gives_way_to_this_process_measurements():
    """A stored curve measured under load (wide passes 3.6x a step) must not keep the controller at its narrowest
    draft for good: the widths it never times again cannot read dearer than this process's own line."""
    from verispec.controller import Controller

    poisoned = {1: 0.028, 2: 0.029, 3: 0.101, 4: 0.133, 5: 0.127, 6: 0.129, 9: 0.141}
    curve = CostCurve()
    curve.seed(poisoned)
    assert curve(9) > 0.12  # before any live pass the stored curve is all there is
    controller = Controller(curve)
    for i in range(50):
        controller.history.observe(1, int(i % 10 < 7))  # a drafter whose first draft token is accepted 70% of the time
    controller.start_request()
    assert controller.verify_length(8, None, True).n <= 1  # the seed says a wide pass does not pay
    for _ in range(3):  # the steps it takes (plain and one-token drafts) agree with the seed at widths 1 and 2
        curve.observe(1, 0.025)
        curve.observe(2, 0.027)
    assert curve(9) == pytest.approx(0.025 + 8 * 0.002, rel=0.2)  # now the live line: wide passes are cheap
    assert controller.verify_length(8, None, True).n >= 3
    # what this process measured or confirmed is stored for the next one; the widths it never timed go along,
    # marked as passed on untimed once
    assert curve.stored().keys() == poisoned.keys() and curve.unconfirmed() == {w: 1 for w in poisoned if w > 2}
    for _ in range(3):
        curve.observe(9, 0.031)  # a live wide pass finds the seed stale: that stored width is measured again
    assert curve.measured()[9] == pytest.approx(0.031) and 3 in curve._seeded  # the rest wait for their steps
    # a seed that agrees with the live passes keeps its widths and its shape
    curve = CostCurve()
    curve.seed({1: 0.010, 2: 0.012, 5: 0.020})
    for _ in range(3):
        curve.observe(1, 0.010)
        curve.observe(2, 0.012)
    assert curve(5) == pytest.approx(0.018, rel=0.15) and curve.unconfirmed() == {5: 1}  # optimistic until timed
    for _ in range(3):
        curve.observe(5, 0.020)  # timed: confirmed, stored, and on the line again
    assert curve(5) == pytest.approx(0.020, rel=0.05) and curve.stored().keys() == {1, 2, 5}
    assert curve.unconfirmed() == {}


def test_a_calibration_timed_under_load_gives_way_too_and_is_stored_for_the_next_process():
    """The engine's calibration enters as provisional: timed during a load spike (wide passes 3x dearer), it must
    not lock the process into one-token drafts once its own steps say otherwise."""
    curve = CostCurve()
    curve.seed({1: 0.010}, stored=True)  # from an earlier process, never confirmed here
    curve.seed({2: 0.030, 5: 0.045, 9: 0.060}, stored=False)  # this process's calibration, under load
    assert curve.stored().keys() == {1, 2, 5, 9} and curve.unconfirmed() == {1: 1}  # the store's width: untimed
    for _ in range(3):
        curve.observe(1, 0.010)
        curve.observe(2, 0.011)  # the load is gone: 3x below the calibrated value, so every provisional width goes
    assert not curve.seeded and curve.measured().keys() == {1, 2} and curve(9) < 0.025
    # a process that never runs a plain step still gets out: two widths of its own are enough
    curve = CostCurve()
    curve.seed({1: 0.010, 2: 0.030, 3: 0.033, 9: 0.060}, stored=False)
    for _ in range(3):
        curve.observe(2, 0.030)  # agrees with the calibration: confirmed
    assert curve(9) > 0.05  # one width of its own draws no line yet
    for _ in range(3):
        curve.observe(3, 0.031)
    assert curve(9) < 0.045 and curve.seeded  # widths 2 and 3 draw the line; widths 1 and 9 are still unconfirmed


def test_stored_widths_nobody_times_are_passed_on_for_a_few_processes_then_dropped(store):
    """A process whose controller runs narrow passes passes on the wide widths it inherited (so the next one-shot
    process does not calibrate them again), for at most MAX_AGE processes in a row; timing one resets its age."""
    from verispec.controller import UNCONFIRMED

    key = {"model": "aging"}
    measurements.save(COST_RECORD, key, {"1": 0.010, "2": 0.012, "9": 0.030})
    for generation in range(1, CostCurve.MAX_AGE + 1):
        curve = CostCurve()
        curve.key = key
        stored = dict(measurements.load(COST_RECORD, key))
        ages = {int(w): a for w, a in (stored.pop(UNCONFIRMED, None) or {}).items()}
        curve.seed({int(w): v for w, v in stored.items()}, ages=ages)
        for _ in range(3):  # this process times widths 1 and 2 only
            curve.observe(1, 0.010)
            curve.observe(2, 0.012)
        save_cost_curve(curve, force=True)
        record = measurements.load(COST_RECORD, key)
        if generation < CostCurve.MAX_AGE:
            assert record["9"] == pytest.approx(0.030) and record[UNCONFIRMED] == {"9": generation}
        else:
            assert "9" not in record and UNCONFIRMED not in record  # nobody timed it for MAX_AGE processes
    curve = CostCurve()
    curve.seed({1: 0.010, 9: 0.030}, ages={9: 2})
    for _ in range(3):
        curve.observe(9, 0.031)  # timed here: confirmed, its age starts again
    assert 9 in curve.stored() and curve.unconfirmed() == {1: 1}


def test_calibration_keeps_the_faster_time_of_each_width_as_provisional(monkeypatch):
    from tiny import loaded, make_model
    from verispec import NgramDrafter, SpeculativeDecoder

    target = loaded(make_model(seed=11))  # a model of its own: no curve timed by another test in this process
    decoder = SpeculativeDecoder(target, NgramDrafter(), k=4)
    curve = decoder.controller.costs
    seeded = {}
    monkeypatch.setattr(curve, "seed", lambda measured, stored=True: seeded.update(measured=measured, stored=stored))
    decoder.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=4)
    assert seeded["stored"] is False and set(seeded["measured"]) == {1, 2, 3, 5}


def test_a_new_process_starts_from_the_stored_curve_and_another_cpu_does_not(store, tiny_dir, monkeypatch):
    first = load_model(str(tiny_dir))
    curve = shared_cost_curve(first)
    curve.observe(1, 0.004)
    curve.observe(3, 0.006)
    save_cost_curve(curve, force=True)
    (record,) = store.glob(f"{COST_RECORD}-*.json")
    assert json.loads(record.read_text())["key"]["model"] == first.measurement_key["model"]

    again = load_model(str(tiny_dir))  # as the next process would: another model object, the same weights
    assert shared_cost_curve(again).measured() == pytest.approx({1: 0.004, 3: 0.006})
    elsewhere = load_model(str(tiny_dir))
    real = measurements.machine()
    monkeypatch.setattr(measurements, "machine", lambda: {**real, "cpu_flags": [*real["cpu_flags"], "amx_tile"]})
    assert not shared_cost_curve(elsewhere)  # another CPU: nothing stored for it


def test_models_not_loaded_from_a_folder_are_never_stored(tiny_target, store):
    assert tiny_target.measurement_key is None
    curve = shared_cost_curve(tiny_target)
    curve.observe(1, 0.01)
    save_cost_curve(curve, force=True)
    assert not store.exists()


def test_a_second_generate_process_skips_calibration_with_the_same_output(store, tiny_dir):
    def generate():
        out = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "w5 w6 w7 w5 w6 w7 w5", "--raw",
                              "--target", str(tiny_dir), "--json", "--max-new-tokens", "24"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    first, second = generate(), generate()
    assert first["stats"]["calibration_seconds"] > 0
    assert second["stats"]["calibration_seconds"] == 0
    assert second["token_ids"] == first["token_ids"]
    off = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "w5 w6 w7 w5 w6 w7 w5", "--raw",
                          "--target", str(tiny_dir), "--json", "--max-new-tokens", "24", "--no-cost-cache"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(off)["stats"]["calibration_seconds"] > 0
    listing = subprocess.run([sys.executable, "-m", "verispec.cli", "models"], capture_output=True, text=True,
                             check=True).stdout
    assert "stored measurements: 1 in" in listing and COST_RECORD in listing


def test_costs_timed_with_other_attention_are_another_measurement(store, tiny_dir):
    """Eager passes with transformers' repeated heads cost more than grouped ones: a curve stored for one is not the
    other's."""
    first = load_model(str(tiny_dir))
    curve = shared_cost_curve(first)
    curve.observe(1, 0.004)
    save_cost_curve(curve, force=True)
    other = load_model(str(tiny_dir))
    other.model.set_attn_implementation("sdpa")
    assert first.measurement_key["attention"] != other.measurement_key["attention"]
    assert not shared_cost_curve(other)


def test_a_compiled_program_arriving_mid_process_starts_another_curve_at_the_next_request(store, tiny_dir):
    """A verify program that loads in the background makes wide passes cheaper: the passes timed before it are not
    its costs. Each way of running passes (``cost_state``) has its own curve and stored record, and a decoder takes
    the curve of the passes as they run now at the start of each request."""
    from verispec import NgramDrafter, SpeculativeDecoder

    target = load_model(str(tiny_dir))
    assert target.cost_state == (False, False) and target.measurement_key["compiled_verify"] is False
    decoder = SpeculativeDecoder(target, NgramDrafter(), k=3)
    eager = decoder.controller.costs
    assert eager is shared_cost_curve(target)
    decoder.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=6)
    assert eager.measured()

    class Arrived(type(target)):  # the same weights, as they would run once a verify program is in
        @property
        def cost_state(self):
            return (False, True)

        @property
        def measurement_key(self):
            return {**super().measurement_key, "compiled_verify": True}

    target.__class__ = Arrived
    try:
        later = shared_cost_curve(target)
        assert later is not eager and not later  # nothing timed or stored for it yet
        decoder.controller.start_request()
        assert decoder.controller.costs is later
        later.observe(1, 0.002)
        save_cost_curve(later, force=True)
        save_cost_curve(eager, force=True)
        assert len(list(store.glob(f"{COST_RECORD}-*.json"))) == 2  # one record per way of running passes
    finally:
        target.__class__ = Arrived.__mro__[1]
    assert shared_cost_curve(target) is eager


def test_a_program_arriving_mid_request_is_followed_at_the_next_step_and_loading_times_nothing(store, tiny_dir):
    """While a program loads in the background (``programs_loading``), passes share the cores with the loader: the
    engine neither calibrates nor observes them (on a 2-core CPU they had been stored ~4x dear, and the next process
    drafted nothing). Once the program is in, the decoder takes its curve at the next step, mid-request, and
    calibrates that curve there; the output is plain decoding's."""
    from verispec import NgramDrafter, SpeculativeDecoder

    target = load_model(str(tiny_dir))
    now = {"loading": True, "arrived": False}

    class Loading(type(target)):
        @property
        def cost_state(self):
            return (False, now["arrived"])

        @property
        def measurement_key(self):
            return {**super().measurement_key, "compiled_verify": now["arrived"]}

        @property
        def programs_loading(self):
            return now["loading"]

    target.__class__ = Loading
    widths, forward = [], target.forward

    def passes(kv, tokens, **kw):
        widths.append(len(tokens))
        if len(widths) == 4:  # the prefill and three steps ran while it loaded; it is in before this pass ends
            now.update(loading=False, arrived=True)
        return forward(kv, tokens, **kw)

    target.forward = passes
    try:
        decoder = SpeculativeDecoder(target, NgramDrafter(), k=3)
        loading_curve = decoder.controller.costs
        out = decoder.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=12)
    finally:
        del target.forward
        target.__class__ = Loading.__mro__[1]
    plain = SpeculativeDecoder(load_model(str(tiny_dir)), None).generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=12)
    assert out.token_ids == plain.token_ids
    assert not loading_curve.measured()  # nothing calibrated at the start, no pass observed while loading
    now["arrived"] = True
    target.__class__ = Loading
    try:
        arrived = shared_cost_curve(target)
    finally:
        target.__class__ = Loading.__mro__[1]
    assert decoder.controller.costs is arrived and arrived is not loading_curve
    assert out.stats.calibration_seconds > 0
    assert widths[4:11] == [1, 1, 2, 4, 1, 2, 4]  # the warm-up pass, then widths 1, 2 and 1 + k twice
    # (what the curve holds after the answer depends on the live steps too: on a busy machine they can find the
    # calibration stale and replace it, so only that it was timed, above, is asserted)
    assert arrived.measured()


def test_calibration_times_only_the_widths_a_stored_curve_lacks(store, tiny_dir):
    """A stored curve passes on only the widths its process confirmed, so the next process may find some missing:
    it times those alone (it had timed every width again, ~1.5 s of a one-shot `verispec generate` here)."""
    from verispec import NgramDrafter, SpeculativeDecoder

    target = load_model(str(tiny_dir))
    decoder = SpeculativeDecoder(target, NgramDrafter(), k=4)
    decoder.controller.costs.seed({1: 0.004, 5: 0.009})  # as read from an earlier process's record
    widths, forward = [], target.forward
    target.forward = lambda kv, tokens, **kw: widths.append(len(tokens)) or forward(kv, tokens, **kw)
    try:
        decoder.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=4)
    finally:
        del target.forward
    assert widths[1:6] == [1, 2, 3, 2, 3]  # after the prefill: the warm-up pass, then widths 2 and 3 twice


def test_a_tree_drafter_times_tree_passes_into_a_curve_of_its_own(tiny_dir, store):
    """Tree passes may run eagerly where chain passes of the same width run compiled: a decoder that drafts trees
    keeps its own curve (and stored record), and its calibration times tree-shaped passes."""
    from verispec import NgramDrafter, SpeculativeDecoder

    target = load_model(str(tiny_dir))
    chain = SpeculativeDecoder(target, NgramDrafter(), k=4)
    tree = SpeculativeDecoder(target, NgramDrafter(branches=3), k=4)
    assert tree.controller.costs is not chain.controller.costs
    assert tree.controller.costs is shared_cost_curve(target, trees=True)
    assert tree.controller.costs.key == {**chain.controller.costs.key, "passes": "trees"}
    timed = []
    forward = target.forward

    def recording(kv, tokens, **kw):
        timed.append((len(tokens), kw.get("parents")))
        return forward(kv, tokens, **kw)

    target.forward = recording
    try:
        tree.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=4)
    finally:
        del target.forward
    assert tree.controller.costs.measured() and not chain.controller.costs.measured()
    calibration = timed[1:10]  # after the prefill: the warm-up pass, then widths 1, 2, 3, 5 twice
    assert [n for n, _ in calibration] == [1, 1, 2, 3, 5, 1, 2, 3, 5]
    assert all(parents == list(range(-1, n - 2)) for n, parents in calibration if n > 1)
    assert all(parents is None for n, parents in calibration if n == 1)
    save_cost_curve(tree.controller.costs, force=True)
    assert any('"trees"' in p.read_text() for p in store.glob(f"{COST_RECORD}-*.json"))


def test_a_transformers_model_says_a_program_is_loading_while_its_loader_runs(tiny_dir):
    import threading

    target = load_model(str(tiny_dir))
    assert not target.programs_loading
    release = threading.Event()
    target._verify_thread = threading.Thread(target=release.wait)
    target._verify_thread.start()
    try:
        assert target.programs_loading
    finally:
        release.set()
        target._verify_thread.join()
    assert not target.programs_loading
