import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; must be set before transformers loads
# measured step costs go to a folder of this run (inherited by the CLI subprocesses), never the user's cache, so
# no test starts from what an earlier run stored; tests of the store point it elsewhere themselves. The folder goes
# when the process exits (each xdist worker makes its own), so runs leave nothing behind in the temporary folder
os.environ["VERISPEC_COST_CACHE"] = tempfile.mkdtemp(prefix="verispec-test-costs-")
atexit.register(shutil.rmtree, os.environ["VERISPEC_COST_CACHE"], ignore_errors=True)
# the command line's --compile defaults to auto (a step compiled by an earlier process is used): tests run eager
# unless they ask, so that no test's output depends on which test compiled first, and no test server compiles
os.environ["VERISPEC_COMPILE"] = "off"
# --backend defaults to auto (timing every installed engine once per model): tests name the engine they test, and
# those that test the choice itself set auto
os.environ["VERISPEC_BACKEND"] = "transformers"
# compiled steps are built without autotuning their GEMMs (inductor's default kernels: a third of the compile time,
# and the same graph; the kernels chosen are torch's, not under test here); the setting is part of the compile
# store's key, so a user's autotuned programs are never mistaken for these (docs/testing.md)
os.environ.setdefault("VERISPEC_COMPILE_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import loaded, make_model, noisy_copy  # noqa: E402

_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _own_cores() -> int:
    """With pytest-xdist's workers, each worker is pinned to its own share of the cores, and so is everything it
    starts (servers, llama-server, OpenVINO's and llama.cpp's thread pools, which size themselves from the
    process's cores): engines that spin-wait at barriers slow down many times over when another worker's threads
    take their core (a 20 s test took 285 s so). Returns the cores this process may use."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if _WORKERS > 1 and worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        index = int(worker[2:]) % _WORKERS
        share = cores[index::_WORKERS] or [cores[index % len(cores)]]
        try:
            os.sched_setaffinity(0, share)
        except OSError:  # a sandbox that forbids it: the workers share the cores, as before
            return max(1, _CORES // _WORKERS)
        os.environ["OMP_NUM_THREADS"] = str(len(share))  # what the CLI subprocesses' torch starts with
        return len(share)
    return _CORES


# two threads per test at most, never more threads than this process's cores
torch.set_num_threads(int(os.environ.get("VERISPEC_TEST_THREADS", max(1, min(2, _own_cores())))))
_BEFORE = pytest.StashKey[set]()  # the tiny OpenVINO exports present when the run began


def _tiny_exports():
    from verispec.backends import cache_dir

    return set((cache_dir() / "openvino").glob("tiny-*"))


def pytest_sessionstart(session):
    """OpenVINO exports of the session's tiny models (a new key each session: the key covers the source folder) go
    to the cache like any export; they are removed when the run ends, so test runs leave none behind. With
    pytest-xdist only the controlling process does this, after every worker is done (a worker's session ending
    must not remove the exports another worker is still using)."""
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_BEFORE] = _tiny_exports()


def pytest_sessionfinish(session):
    import shutil

    if not hasattr(session.config, "workerinput") and _BEFORE in session.config.stash:
        for folder in _tiny_exports() - session.config.stash[_BEFORE]:
            shutil.rmtree(folder, ignore_errors=True)


# The modules that take longest with empty caches (a cold CI run: compiles, exports, downloads and conversions;
# docs/testing.md), longest first. They run first, so the two workers end together: pytest-xdist's own order puts
# the modules with the most tests first, which left these few-test, slow modules for the end, one worker idle.
SLOWEST_FIRST = ("test_e2e_compiled", "test_e2e_openvino", "test_e2e_gemma3", "test_e2e_qwen_pair", "test_zoo",
                 "test_compiled", "test_e2e_ray", "test_zoo_llamacpp", "test_e2e_llamacpp", "test_e2e_layerskip",
                 "test_e2e_default_model", "test_e2e_cost_cache", "test_e2e_serve_bench", "test_e2e_openvino_peers")


def pytest_collection_modifyitems(session, config, items):
    """Slowest modules first (``SLOWEST_FIRST``), the rest in their own order after them; a module's tests keep
    theirs. Every worker sorts alike, so their collections still agree (``--no-loadscope-reorder`` in pyproject.toml
    keeps this order)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


_MODULE_SECONDS: dict[str, float] = {}  # setup + call + teardown per module, summed where the reports arrive


def pytest_runtest_logreport(report):
    """Each test's phases summed per module (with pytest-xdist the controlling process gets every worker's reports),
    for the per-module table at the end: ``--durations`` names single tests, and the suite's time is per module."""
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 12 modules that took longest, and every module's time together (worker-seconds: with two workers about
    twice the run's): where a run that passes CI's budget should be cut (docs/testing.md)."""
    if hasattr(terminalreporter.config, "workerinput") or not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.section(f"slowest modules ({total:.0f} s of tests in all)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {module}")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most four (each worker loads its own models: the real ones take 1-3 GB)
    and one on a single core. On 2 cores two workers halve the suite's time: the tiny models' tests are mostly
    Python, which one process runs on one core."""
    return max(1, min(4, _CORES))


@pytest.fixture(scope="session")
def tiny_target():
    return loaded(make_model(seed=0))


@pytest.fixture(scope="session")
def tiny_noisy_draft(tiny_target):
    return loaded(noisy_copy(tiny_target.model, noise=0.08), tiny_target.tokenizer, name="tiny-noisy")


@pytest.fixture(scope="session")
def tiny_other_draft(tiny_target):
    return loaded(make_model(seed=7), tiny_target.tokenizer, name="tiny-other")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_target):
    """The tiny target saved as a transformers folder, for load_model and CLI tests."""
    return _saved(tiny_target, tmp_path_factory.mktemp("tiny-model"))


def _saved(target, path):
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_target():
    """A tiny random target with smaller weights than tiny_target: its answers are learnable from 400 examples, so
    trained heads (EAGLE, Medusa) get drafts accepted."""
    return loaded(make_model(seed=0, scale=0.1))


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory, small_target):
    """small_target saved as a transformers folder, for CLI tests of trained heads."""
    return _saved(small_target, tmp_path_factory.mktemp("small-model"))


@pytest.fixture(scope="session")
def default_model():
    """The real built-in default model (fetched and converted on first use, then cached)."""
    from verispec import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_blocks():
    """The real default model on the engine ``--backend auto`` runs it on (blocks: the file's own Q4_1 / Q8_0 blocks
    on verispec's kernel). Its passes cost a fifth of the float32 model's on a loaded core, so the real-model audits
    run here (110 against 600 ms a sample, docs/testing.md)."""
    from verispec import blockmm, load_model

    if not blockmm.available():
        pytest.skip(f"the blocks backend cannot run here: {blockmm.why_unavailable()}")
    return load_model("smollm2-135m", backend="blocks")


def require_llama_cpp():
    """llama_cpp, or a skip with the install command, except in CI (VERISPEC_REQUIRE_LLAMACPP=1), where its
    absence is a failure: CI installs the extra, so these tests must run there."""
    if os.environ.get("VERISPEC_REQUIRE_LLAMACPP") == "1":
        import llama_cpp

        return llama_cpp
    return pytest.importorskip("llama_cpp", reason='the llamacpp backend needs pip install "verispec[llamacpp]"')


def require_openvino(module: str = "openvino"):
    """openvino (or openvino_genai), or a skip with the install command, except in CI (VERISPEC_REQUIRE_OPENVINO=1),
    where the test extra installs it and its absence is a failure."""
    if os.environ.get("VERISPEC_REQUIRE_OPENVINO") == "1":
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module, reason='the OpenVINO export and peers need pip install "verispec[openvino]"')


@pytest.fixture(scope="session")
def llama_q41():
    """The built-in model's GGUF run as shipped (Q4_1) by the llamacpp backend."""
    require_llama_cpp()
    from verispec import load_model

    return load_model("smollm2-135m", backend="llamacpp")


@pytest.fixture(scope="session")
def llama_f32():
    """The same file converted once to F32 weights (exactly the Q4_1 values), on the llamacpp backend, with hidden
    states (EAGLE heads)."""
    require_llama_cpp()
    from verispec import load_model

    return load_model("smollm2-135m", backend="llamacpp", weights="f32", features=True)
