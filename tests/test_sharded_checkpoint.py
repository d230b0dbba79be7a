"""sharded_checkpoint.py in one process: a sharded checkpoint round-trips (LoRA: the adapter only), is found and
read like a single-process one, refuses non-finite weights and the wrong loader, and exports a merged model.
Across processes (2 ranks, kill and resume, export of 2 shards): test_multigpu.py."""

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from run import checkpoint
import models
import eval as eval_module
import multigpu.__main__ as multigpu_cli
from multigpu import distributed, sharded_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_worker  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process: intended
SINGLE = distributed.DistContext()


@pytest.fixture
def trained_lora(tmp_path):
    """A LoRA policy after one step, saved as sharded step 1 of a run whose base model is a local folder."""
    base = tmp_path / "base"
    models.tiny_random_model("llama", vocab_size=dist_worker.VOCAB, seed=0).save_pretrained(base)
    model, optimizer = dist_worker.build(SINGLE, lora=True)
    dist_worker.train_step(model, optimizer, dist_worker.global_batch(1), SINGLE)
    config = {"model": str(base), "lora_rank": 4, "lora_alpha": 8, "max_completion_tokens": 5}
    state = checkpoint.TrainerState(step=1, elapsed_s=3.5, position=(0, 8))
    path = sharded_checkpoint.save_sharded_checkpoint(tmp_path / "run", 1, model, optimizer, state, config, SINGLE)
    return model, optimizer, path


def test_single_process_lora_checkpoint_round_trip(trained_lora):
    model, optimizer, path = trained_lora
    saved = dist_worker.full_state(model, optimizer)
    assert checkpoint.latest_checkpoint(path.parent.parent) == path
    saved_keys = FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    model_keys = [key for key in saved_keys if key.startswith("model.")]
    assert model_keys and all("lora_" in key for key in model_keys)  # the adapter, not the frozen base
    fresh, fresh_optimizer = dist_worker.build(SINGLE, lora=True)
    torch.nn.init.zeros_(next(p for n, p in fresh.named_parameters() if "lora_A" in n))
    state = sharded_checkpoint.load_sharded_checkpoint(path, fresh, fresh_optimizer, SINGLE)
    assert checkpoint.TrainerState.from_saved(state) == checkpoint.TrainerState(step=1, elapsed_s=3.5, position=(0, 8))
    dist_worker.assert_states_close(dist_worker.full_state(fresh, fresh_optimizer), saved)
    with pytest.raises(ValueError, match="written by 1 processes, this run has 2"):
        sharded_checkpoint.load_sharded_checkpoint(path, fresh, fresh_optimizer, distributed.DistContext(world_size=2))


def test_sharded_checkpoint_is_read_like_a_single_process_one(trained_lora, tmp_path):
    model, optimizer, path = trained_lora
    run = path.parent.parent
    assert checkpoint.is_sharded(path) and checkpoint.find_checkpoints(run) == [path]
    assert checkpoint.find_checkpoints(path) == [path] and checkpoint.run_dir_of(path) == run
    assert checkpoint.checkpoint_progress(path) == {"step": 1, "elapsed_s": 3.5}
    assert checkpoint.read_run_config(run)["lora_rank"] == 4
    with pytest.raises(ValueError, match="written by several processes"):  # the wrong loader: a clear error
        checkpoint.load_checkpoint(path, model, optimizer)
    single = checkpoint.save_checkpoint(tmp_path / "single", 1, model, optimizer, {}, {})
    with pytest.raises(ValueError, match="written by one process"):
        sharded_checkpoint.load_sharded_checkpoint(single, model, optimizer, SINGLE)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad)[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        sharded_checkpoint.save_sharded_checkpoint(run, 2, model, optimizer, {}, {}, SINGLE)
    assert checkpoint.latest_checkpoint(run) == path and not (run / "checkpoints" / "step_000002").exists()


def test_merged_model_and_export_compute_what_the_lora_policy_computes(trained_lora, tmp_path):
    model, _, path = trained_lora
    ids = dist_worker.global_batch(3)["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        merged = sharded_checkpoint.load_merged_model(path)  # base model and LoRA settings from config.json
        assert not hasattr(merged, "peft_config")
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
        multigpu_cli.main(["export", str(path), str(tmp_path / "hf")])  # python -m multigpu export CKPT OUT
        exported = models.load_policy(str(tmp_path / "hf"), dtype=torch.float32)
        torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
        loaded = multigpu_cli.load_sharded(path, None, torch.float32, "cpu")  # what `python -m multigpu eval` reads
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(FileExistsError, match="not empty"):
        multigpu_cli.main(["export", str(path), str(tmp_path / "hf")])


def test_eval_py_points_a_sharded_checkpoint_to_the_multigpu_entry(trained_lora):
    _, _, path = trained_lora
    with pytest.raises(ValueError, match="python -m multigpu eval"):
        eval_module.main(["--checkpoint", str(path.parent.parent), "--num-prompts", "1"])
