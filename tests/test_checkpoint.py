"""checkpoint.py: atomic save (a crash mid-save keeps the last good checkpoint), exact restore of adapter,
optimizer and RNG states, PeftModel.from_pretrained compatibility, and a hostile trainer_state.pt refused unopened."""

import json
import random

import numpy as np
import pytest
import torch

from run import checkpoint
import models


@pytest.fixture
def lora_setup():
    torch.manual_seed(0)
    model = models.prepare_for_training(models.tiny_random_model("llama", vocab_size=256), lora_rank=4, lora_alpha=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return model, optimizer


def take_step(model, optimizer):
    ids = torch.randint(0, 256, (2, 6))
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_save_then_load_restores_weights_optimizer_and_rng(tmp_path, lora_setup):
    model, optimizer = lora_setup
    take_step(model, optimizer)
    path = checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {"elapsed_s": 12.5, "position": (0, 4)},
                                      {"model": "tiny"})
    expected_weights = trainable(model)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    take_step(model, optimizer)  # move everything on, then restore
    take_step(model, optimizer)
    state = checkpoint.load_checkpoint(path, model, optimizer)
    assert state["step"] == 1 and state["elapsed_s"] == 12.5 and state["position"] == (0, 4)
    assert all(torch.equal(expected_weights[n], p) for n, p in trainable(model).items())
    assert (random.random(), np.random.rand()) == expected_draws[:2] and torch.equal(torch.rand(3), expected_draws[2])
    assert int(optimizer.state_dict()["state"][0]["step"]) == 1  # Adam moments from step 1, not step 3
    assert json.loads((path / "config.json").read_text()) == {"model": "tiny"}


def test_adapter_loads_with_plain_peft(tmp_path, lora_setup):
    from peft import PeftModel

    model, optimizer = lora_setup
    take_step(model, optimizer)
    path = checkpoint.save_checkpoint(tmp_path, 3, model, optimizer, {}, {})
    loaded = PeftModel.from_pretrained(models.tiny_random_model("llama", vocab_size=256), path / "adapter")
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path, lora_setup, monkeypatch):
    model, optimizer = lora_setup
    good = checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {"elapsed_s": 1.0}, {})

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, {"elapsed_s": 2.0}, {})
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(tmp_path) == good
    assert not (tmp_path / "checkpoints" / "step_000002").exists()
    leftovers = list((tmp_path / "checkpoints").glob(checkpoint.TMP_PREFIX + "*"))
    assert leftovers  # the half-written folder ...
    newer = checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, {"elapsed_s": 2.0}, {})
    assert not any(p.exists() for p in leftovers)  # ... is cleaned up by the next save
    assert checkpoint.latest_checkpoint(tmp_path) == newer


def test_keep_last_prunes_old_checkpoints(tmp_path, lora_setup):
    model, optimizer = lora_setup
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, {}, {}, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_000002", "step_000003"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_000003"


def test_full_fine_tuning_round_trip(tmp_path):
    model = models.tiny_random_model("llama", vocab_size=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    take_step(model, optimizer)
    path = checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {}, {})
    expected = trainable(model)
    take_step(model, optimizer)
    checkpoint.load_checkpoint(path, model, optimizer)
    assert all(torch.equal(expected[n], p) for n, p in trainable(model).items())


def test_prompt_order_is_a_per_epoch_permutation_and_resumable():
    picked, position = checkpoint.next_prompt_indices(10, 25, seed=3, position=(0, 0))
    assert position == (2, 5)
    assert sorted(picked[:10]) == sorted(picked[10:20]) == list(range(10)) and picked[:10] != picked[10:20]
    first, middle = checkpoint.next_prompt_indices(10, 7, seed=3, position=(0, 0))
    second, end = checkpoint.next_prompt_indices(10, 18, seed=3, position=middle)
    assert first + second == picked and end == position  # drawing in pieces = drawing at once


def test_trainer_state_round_trip_ignores_keys_of_older_runs(tmp_path, lora_setup):
    model, optimizer = lora_setup
    state = checkpoint.TrainerState(step=4, elapsed_s=9.5, position=(1, 3), num_tokens=120, metrics_bytes=77,
                                    skipped_steps=2, nonfinite_streak=1, evaluated_step=4)
    path = checkpoint.save_checkpoint(tmp_path, 4, model, optimizer, state, {})
    assert checkpoint.TrainerState.from_saved(checkpoint.load_checkpoint(path, model, optimizer)) == state
    older = {"step": 2, "last_checkpoint_s": 1.0}  # a key earlier versions saved
    assert checkpoint.TrainerState.from_saved(older) == checkpoint.TrainerState(step=2)


def test_non_finite_weights_are_never_saved(tmp_path, lora_setup):
    model, optimizer = lora_setup
    good = checkpoint.save_checkpoint(tmp_path, 1, model, optimizer, {}, {})
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad)[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        checkpoint.save_checkpoint(tmp_path, 2, model, optimizer, {}, {})
    assert checkpoint.latest_checkpoint(tmp_path) == good and not (tmp_path / "checkpoints" / "step_000002").exists()


def test_metrics_log_appends_and_resume_cuts_later_lines(tmp_path):
    with checkpoint.open_metrics_log(tmp_path) as log:
        checkpoint.append_metrics(log, {"step": 1})
        saved_bytes = log.tell()
        checkpoint.append_metrics(log, {"step": 2})  # written after the checkpoint: a resume drops it
    with checkpoint.open_metrics_log(tmp_path, keep_bytes=saved_bytes) as log:
        checkpoint.append_metrics(log, {"step": 2, "resumed": True})
    lines = [json.loads(line) for line in (tmp_path / checkpoint.METRICS_FILE).read_text().splitlines()]
    assert lines == [{"step": 1}, {"step": 2, "resumed": True}]
    with checkpoint.open_metrics_log(tmp_path) as log:  # a new run starts an empty log
        assert log.tell() == 0


def test_a_log_cut_mid_line_is_cut_back_to_its_last_complete_line_never_extended(tmp_path):
    """metrics.jsonl shorter than the checkpoint recorded (cut mid-line by a full disk or a copy): the resume drops
    the broken line instead of padding the file with NUL bytes; the next record starts on a line of its own."""
    with checkpoint.open_metrics_log(tmp_path) as log:
        for step in (1, 2):
            checkpoint.append_metrics(log, {"step": step})
        saved_bytes = log.tell()  # the checkpoint's size of the log
    path = tmp_path / checkpoint.METRICS_FILE
    path.write_bytes(path.read_bytes()[:-4])  # {"step": 2} cut mid-line
    with checkpoint.open_metrics_log(tmp_path, keep_bytes=saved_bytes) as log:
        assert log.tell() < saved_bytes
        checkpoint.append_metrics(log, {"step": 2, "again": True})
    text = path.read_text()
    assert "\0" not in text and [json.loads(line) for line in text.splitlines()] == [{"step": 1},
                                                                                    {"step": 2, "again": True}]


class RunsCode:
    """What a crafted trainer_state.pt may hold: unpickling it calls os.system (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_trainer_state_that_would_run_code_is_refused_by_eval_and_resume(tmp_path, lora_setup, smollm2_tokenizer):
    """A run folder someone shared: eval.py and --resume refuse its crafted trainer_state.pt with one line (a
    ValueError, which both command lines print as one line), and its code never runs; our own files still load."""
    import eval as eval_module
    import train

    model, optimizer = lora_setup
    run = tmp_path / "run"
    base = tmp_path / "base"
    models.tiny_random_model("llama", vocab_size=256).save_pretrained(base)
    smollm2_tokenizer.save_pretrained(base)
    config = {"model": str(base), "dataset": "arithmetic", "lora_rank": 4, "lora_alpha": 8, "preset": "demo"}
    path = checkpoint.save_checkpoint(run, 1, model, optimizer, {"elapsed_s": 1.0}, config)
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text("")
    assert checkpoint.checkpoint_progress(path) == {"step": 1, "elapsed_s": 1.0}  # ours: plain data, loads
    marker = tmp_path / "code_ran"
    torch.save({"step": 1, "elapsed_s": 1.0, "payload": RunsCode(marker)}, path / "trainer_state.pt")
    with pytest.raises(ValueError, match="refusing to open .*trainer_state.pt") as refused:
        eval_module.main(["--checkpoint", str(run), "--num-prompts", "4", "--no-progress"])
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="refusing to open"):
        train.main(["--output-dir", str(run), "--resume", "--no-progress"])
    assert not marker.exists()
    with pytest.raises(ValueError, match="refusing to open"):  # the same file through torch.load's own path
        checkpoint.load_state_file(path / "trainer_state.pt")
    assert not marker.exists()
