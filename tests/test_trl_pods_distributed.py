"""integrations/trl_pods.py on 2 CPU processes (gloo, torch's elastic launcher; tests/trl_pods_worker.py): every
process selects on the gathered rewards, keeps its own prompt's rows, and the loss normaliser counts the kept
tokens of both; a prompt group spread over the processes is refused. About 40 s on 2 shared cores: slow."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("integrations.trl_pods", exc_type=ImportError)

import pods  # noqa: E402

WORKER = Path(__file__).resolve().parent / "trl_pods_worker.py"
N, M = 4, 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_pods_2proc")
    log = out / "launcher.log"
    with log.open("w") as stream:
        status = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(WORKER), str(out)], stdout=stream, stderr=subprocess.STDOUT, timeout=300)
    assert status.returncode == 0, log.read_text()[-4000:]
    return [torch.load(out / f"rank_{rank}.pt") for rank in range(2)]


def test_both_processes_select_by_pods_on_the_gathered_rewards(ranks):
    first, second = ranks
    assert (first["rank"], second["rank"], first["processes"]) == (0, 1, 2)
    rewards = first["rewards"]
    assert rewards.shape == (2, N) and torch.equal(second["rewards"], rewards)
    expected = pods.max_variance_indices(rewards, M).sort(dim=-1).values
    advantages = pods.selected_advantages(rewards, expected)
    for rank in ranks:
        assert torch.equal(rank["kept"], expected)
        torch.testing.assert_close(rank["advantages"], advantages)


def test_each_process_trains_its_own_prompts_kept_rows(ranks):
    for rank in ranks:  # one prompt per process: process r holds global rows 4r..4r+3
        assert torch.equal(rank["local_rows"], rank["kept"][rank["rank"]])
        torch.testing.assert_close(rank["kept_advantages"], rank["advantages"][rank["rank"]])


def test_the_normaliser_counts_the_kept_tokens_of_both_processes(ranks):
    total = sum(rank["kept_tokens"] for rank in ranks)
    assert all(rank["num_items_in_batch"] == total for rank in ranks)


def test_the_step_changes_the_weights_identically_on_both(ranks):
    first, second = ranks
    assert any(not torch.equal(first["initial"][name], value) for name, value in first["final"].items())
    for name, value in first["final"].items():
        assert torch.equal(second["final"][name], value)


def test_a_group_spread_over_the_processes_is_refused(ranks):
    for rank in ranks:
        assert rank["refusal"].startswith("a prompt's 4 generations would span processes")
