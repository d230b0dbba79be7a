"""multigpu/distributed.py (and sharded_checkpoint.py across processes): two ranks under torch's elastic launcher
(gloo, CPU, tiny random models) take the same step as one process on the same global batch (full-parameter and
LoRA), a run whose rank is SIGKILLed resumes exactly from its sharded checkpoint after the launcher restarts it,
mixed precision keeps float32 master weights, and a failing rank is named. One launch runs every scenario
(dist_worker.py) while this process computes the single-process reference. The seams' shares of prompts and
held-out chunks. train.py's own loop on 2 ranks: test_multigpu_train.py."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models
from multigpu import distributed, run, sharded_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
SINGLE = distributed.DistContext()


def single_process_reference():
    """The same steps in one process, no process group."""
    model, optimizer = dist_worker.build(SINGLE)
    result = {"initial": {k: v.clone() for k, v in model.state_dict().items()}}
    result["step1"] = dist_worker.train_step(model, optimizer, dist_worker.global_batch(1), SINGLE)
    result["state1"] = dist_worker.full_state(model, optimizer)
    result["step2"] = dist_worker.train_step(model, optimizer, dist_worker.global_batch(2), SINGLE)
    result["state2"] = dist_worker.full_state(model, optimizer)
    model, optimizer = dist_worker.build(SINGLE, lora=True)
    result["lora_step1"] = dist_worker.train_step(model, optimizer, dist_worker.global_batch(1), SINGLE, kl_coef=0.1)
    result["lora_state1"] = dist_worker.full_state(model, optimizer)
    result["lora_model"] = model
    result["update_step"] = dist_worker.update_step(SINGLE)
    result["update_step_off"] = dist_worker.update_step(SINGLE, prefix_sharing=False)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run: attempt 0 ("train") killed after its checkpoint, attempt 1 ("resume") ending with an
    exception on rank 1. {"out": its folder, "train", "resume": what rank 0 saved, "output": the launcher's
    stdout + stderr, "returncode", "stop_s": seconds from rank 1's exception to the launcher's exit,
    "reference": the single-process steps}."""
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    with open(out / "launcher.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, str(WORKER), str(out)], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        try:
            reference = single_process_reference()  # meanwhile, in this process
            launcher.wait(timeout=180)
        finally:
            if launcher.poll() is None:  # timed out or interrupted: the launcher and its ranks
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    ended_at = time.time()
    output = (out / "launcher.log").read_text()
    for name in ("train.pt", "resume.pt", "raised_at.txt"):
        assert (out / name).is_file(), f"no {name}:\n" + output[-6000:]
    load = lambda name: torch.load(out / name, weights_only=False)  # noqa: E731 (our own files)
    return dict(out=out, train=load("train.pt"), resume=load("resume.pt"), output=output,
                returncode=launcher.returncode, stop_s=ended_at - float((out / "raised_at.txt").read_text()),
                reference=reference)


@pytest.fixture(scope="module")
def reference(runs):
    return runs["reference"]


def assert_metrics_close(actual, expected):
    assert actual["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)


def test_two_processes_take_the_single_process_step(runs, reference):
    train = runs["train"]
    assert_metrics_close(train["step1"], reference["step1"])
    assert_metrics_close(train["step2"], reference["step2"])
    dist_worker.assert_states_close(train["state1"], reference["state1"])
    moved = (reference["state1"]["model"]["model.layers.0.mlp.up_proj.weight"]
             - reference["initial"]["model.layers.0.mlp.up_proj.weight"]).abs()
    assert float(moved.max()) > 1e-4  # the step did change the weights the comparison covers


def test_lora_two_processes_take_the_single_process_step(runs, reference):
    train = runs["train"]
    assert_metrics_close(train["lora_step1"], reference["lora_step1"])
    dist_worker.assert_states_close(train["lora_state1"], reference["lora_state1"])
    assert any("lora_A" in k for k in train["lora_state1"]["optimizer"]["state"])


def test_update_policy_with_prefix_sharing_on_two_processes_takes_the_single_process_step(runs, reference):
    """update.update_policy as train.py runs it under FSDP (gradient checkpointing, rows of repeated prompts, prefix
    sharing on: each rank runs each distinct prompt once) equals one process's step, which equals the step with
    prefix sharing off."""
    two, one, off = runs["train"]["update_step"], reference["update_step"], reference["update_step_off"]
    for result in (two, one):
        assert result["loss"] == pytest.approx(off["loss"], rel=1e-4, abs=1e-6)
        assert result["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-4)
        dist_worker.assert_states_close(result["state"], off["state"])
    assert off["grad_norm"] > 0


def test_generation_gathers_the_weights_once_and_matches_one_process(runs, reference):
    out, train = runs["out"], runs["train"]
    model = models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB)
    model.load_state_dict(reference["initial"])
    for rank in (0, 1):  # rank 1 decoded more steps than rank 0: no collective may run while decoding
        tokens, all_gathers = torch.load(out / f"generated_rank{rank}.pt")
        assert all_gathers == 0
        assert torch.equal(tokens, dist_worker.greedy(model, list(range(4 * rank, 4 * rank + 4)), 3 + 2 * rank))
    assert torch.equal(train["lora_generated"], dist_worker.greedy(reference["lora_model"], [0, 1, 2, 3], 3))


def test_mixed_precision_keeps_float32_master_weights(runs):
    train = runs["train"]
    result = train["mixed_precision"]
    assert result["param_dtypes"] == ["torch.float32"] and result["optimizer_dtypes"] == ["torch.float32"]
    assert result["compute_dtype"] == "torch.bfloat16"
    assert result["moved_fraction"] > 0.9  # a 1e-5 step moves (almost) every fp32 master weight
    # ... whereas on bf16 weights most of the same update rounds to nothing.
    model, optimizer = dist_worker.build(SINGLE, learning_rate=1e-5)
    model.to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    dist_worker.train_step(model, optimizer, dist_worker.global_batch(1), SINGLE)
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
    assert moved / sum(b.numel() for b in before) < 0.5


def test_killed_run_resumes_exactly_from_its_sharded_checkpoint(runs, reference):
    out, train, resumed, output = runs["out"], runs["train"], runs["resume"], runs["output"]
    assert re.search(r"exitcode: -9\) local_rank: 1", output)  # rank 1 really died of SIGKILL, mid-run ...
    assert not (out / "train_survived_the_kill").exists()  # ... ending rank 0 too
    assert resumed["attempt"] == 1  # both ranks were started again by the launcher (--max-restarts)
    assert resumed["checkpoint"] == "step_000001" and tuple(resumed["position"]) == (0, 8)
    assert resumed["draws_match_all_ranks"]  # each rank's RNG continues where it was saved
    assert resumed["rank_extremes"] == {"rank_min": 0.0, "rank_max": 1.0, "ranks": 2.0}
    dist_worker.assert_states_close(resumed["state1"], train["state1"])
    assert resumed["step2"] == train["step2"]  # the same step as the uninterrupted run, bit for bit
    dist_worker.assert_states_close(resumed["state2"], reference["state2"])
    root = out / "run" / "checkpoints"
    assert (root / "latest.txt").read_text().strip() == "step_000002"
    assert not list(root.glob(".tmp_*"))  # the save cut short by the kill was cleaned up
    assert sorted(p.name for p in (root / "step_000002" / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]


def test_export_reshards_a_two_process_checkpoint_into_a_plain_model_folder(runs, tmp_path):
    out, resumed = runs["out"], runs["resume"]
    base = tmp_path / "base"
    models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB, seed=0).save_pretrained(base)
    step2 = out / "run" / "checkpoints" / "step_000002"
    exported = sharded_checkpoint.export_hf(step2, tmp_path / "hf", base_model_name=str(base))  # 2 shards -> 1 file
    model = models.load_policy(str(exported), dtype=torch.float32)
    for name, value in resumed["state2"]["model"].items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint"):
        sharded_checkpoint.export_hf(tmp_path, tmp_path / "hf2", base_model_name=str(base))
    with pytest.raises(FileExistsError, match="not empty"):
        sharded_checkpoint.export_hf(step2, exported, base_model_name=str(base))


def test_an_exception_on_one_rank_ends_the_run_naming_that_rank(runs):
    output = runs["output"]
    assert runs["returncode"] != 0
    assert "[rank 1] failed: RuntimeError: boom on purpose" in output
    root_cause = output[output.index("Root Cause"):]  # the launcher's summary blames rank 1, not its peer
    assert re.search(r"rank\s*:\s*1\b", root_cause) and "boom on purpose" in root_cause
    assert runs["stop_s"] < 30  # rank 0, blocked in a collective (timeout 60 s), was stopped rather than left hanging


def test_single_process_context_and_collectives_are_identities(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ctx = distributed.init_from_env(device="cpu")
    assert (ctx.enabled, ctx.rank, ctx.world_size, ctx.is_main) == (False, 0, 1, True)
    assert distributed.global_count(7) == 7 and distributed.all_ranks(True) and not distributed.all_ranks(False)
    assert distributed.all_reduce_metrics({"loss": 1, "reward": 0.5}) == {"loss": 1.0, "reward": 0.5}
    with pytest.raises(ValueError, match="'label'"):
        distributed.all_reduce_metrics({"label": "x"})
    model = models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB)
    assert distributed.shard_model(model, ctx, mixed_precision=True) is model
    with distributed.full_weights_for_generation(model) as inside:
        assert inside is model


def test_a_count_on_the_device_is_summed_there(tmp_path):
    """update.loss_denominator's count of the tokens token_reject accepts is a tensor on the device: global_count
    sums it with an all-reduce there (no host read), a number as before (a one-process group here)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        count = torch.tensor(7)
        summed = distributed.global_count(count)
        assert torch.is_tensor(summed) and summed is not count and int(summed) == 7
        assert distributed.global_count(3) == 3
    finally:
        dist.destroy_process_group()


def test_rank_slices_are_disjoint_cover_the_step_and_must_be_even():
    indices = [9, 4, 7, 1, 3, 8]
    slices = [distributed.rank_slice(indices, rank, 3) for rank in range(3)]
    assert slices == [[9, 4], [7, 1], [3, 8]]  # concatenated in rank order: the single-process order
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        distributed.rank_slice(indices, 0, 4)
    uneven = [distributed.rank_slice(indices, rank, 4, even=False) for rank in range(4)]
    assert sum(uneven, []) == indices and sorted(map(len, uneven)) == [1, 1, 2, 2]


def test_the_seams_share_prompts_and_evaluation_chunks_as_one_process_would():
    """Each rank's prompts and first generation chunk (1 and W processes give every rollout the same chunk seed and
    row when the chunk size divides a rank's rows), and held-out prompts in whole chunks, one or more per rank."""
    ranks = [run.Processes(distributed.DistContext(rank=r, world_size=2, enabled=True)) for r in range(2)]
    prompts = list("abcd")
    assert [p.share(prompts, 4, 8) for p in ranks] == [(["a", "b"], 0), (["c", "d"], 1)]  # 8 rows = 1 chunk each
    assert [p.share(prompts, 4, 3) for p in ranks] == [(["a", "b"], 0), (["c", "d"], 3)]  # 3 chunks each, disjoint
    shares = [p.eval_share(list(range(5)), 4) for p in ranks]  # chunks of min(4, ceil(5 / 2)) = 3 prompts
    assert shares == [([0, 1, 2], 0, 3), ([3, 4], 1, 3)]
