"""The sampler check in whole runs (train.py, eval.py) on a tiny model with peaked logits: a healthy run logs a gap
of float rounding every step (and the completions log each kept rollout's ratio); a planted fault in the decode
engine (wrong temperature, a stale or a perturbed merged copy) crosses the limit, the run falls back to Hugging Face
generate(), finishes and says so; --backend engine stops instead; eval.py's guard does the same for evaluation.
A run whose sampler log-probs were dropped anywhere between the engine and the metrics fails the healthy test: its
gap would be |log p| of every token, not ~0."""

import json

import pytest
import torch

from run import completions
import data
import engine
import engine.step
import eval as heldout
import models
import policy
import sampling
import train
from run_helpers import read_lines, tiny_argv

pytestmark = pytest.mark.usefixtures("varied_rewards")
SAMPLER_KEYS = ("sampler/logprob_diff_mean", "sampler/logprob_diff_max", "sampler/kl", "sampler/ratio_max")


def peaked_model(seed=0):
    """A tiny Llama (the real vocabulary), logits x10: peaked like a trained model's, so faults show."""
    model = models.tiny_random_model("llama", seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("peaked_model")
    peaked_model().save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def plant(fault, monkeypatch):
    """A fault in the engine of whatever model the run loads: sampling at 1.5 T; a merged copy refreshed once and
    never again (the optimizer moves the adapter under it); noise of the weights' std in the copy."""
    generate, refresh = engine.generate, engine.step.refresh_copies
    if fault == "wrong temperature":
        monkeypatch.setattr(engine, "generate",
                            lambda *a, temperature, **k: generate(*a, temperature=1.5 * temperature, **k))
    elif fault == "stale copy":
        refreshed = []
        monkeypatch.setattr(engine.step, "refresh_copies",
                            lambda copies: None if refreshed else refreshed.append(refresh(copies)))
    else:
        def noisy(copies):
            refresh(copies)
            for _, weight in copies:
                weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(2)) * weight.std())

        monkeypatch.setattr(engine.step, "refresh_copies", noisy)


def test_a_healthy_run_logs_the_gap_every_step(peaked_model_dir, tmp_path):
    run_dir = train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-samples", "0",
                                   "--log-completions-interval", "1"))
    steps = read_lines(run_dir, "train")
    assert len(steps) == 2
    for line in steps:
        assert line["sampler/engine"] == 1 and "sampler/fallback" not in line
        assert line["sampler/logprob_diff_mean"] < 1e-5 and line["sampler/logprob_diff_max"] < 1e-4
        assert 0 <= line["sampler/kl"] < 1e-8 and line["sampler/ratio_max"] == pytest.approx(1, abs=1e-4)
    _, rows = completions.read_completions(run_dir, 2)
    rollouts = [row for row in rows if row["type"] == "rollout"]
    assert all((row["sampler_ratio"] is None) != row["kept"] for row in rollouts)
    assert [row["sampler_ratio"] for row in rollouts if row["kept"]] == pytest.approx([1.0] * 4, abs=1e-4)


@pytest.mark.parametrize("fault, step", [("wrong temperature", 1), ("perturbed copy", 1), ("stale copy", 2)])
def test_a_planted_fault_falls_back_to_hf_and_the_run_finishes(fault, step, peaked_model_dir, tmp_path,
                                                              monkeypatch, capsys):
    """lr 5e-2: Adam's first step moves every LoRA B entry by ~0.05, which a stale copy misses at step 2."""
    plant(fault, monkeypatch)
    run_dir = train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-samples", "0", "--max-steps", "3",
                                   "--learning-rate", "5e-2"))
    steps = read_lines(run_dir, "train")
    assert [line["step"] for line in steps] == [1, 2, 3]
    fired = [line["step"] for line in steps if "sampler/fallback" in line]
    assert fired == [step] and "samples from another policy" in steps[step - 1]["sampler/fallback"]
    assert steps[step - 1]["sampler/logprob_diff_mean"] > policy.LOGPROB_GAP_LIMIT
    assert "the step's update is not applied" in steps[step - 1]["sampler/fallback"]
    assert [line["optimizer_steps"] for line in steps] == [0 if line["step"] == step else 1 for line in steps]
    for line in steps[:step]:
        assert line["sampler/engine"] == 1
    for line in steps[step:]:   # Hugging Face generate() from then on: on-policy again
        assert line["sampler/engine"] == 0 and line["sampler/logprob_diff_mean"] < 1e-5
    assert f"note: the decode engine was left: the decode engine samples from another policy than the one trained " \
           f"(step {step}:" in capsys.readouterr().out.splitlines()[-1]


def test_the_step_that_detects_a_faulty_sampler_leaves_the_weights_as_they_were(peaked_model_dir, tmp_path,
                                                                               monkeypatch):
    """The gap is known after the update's first forward pass, before its optimizer step: the detecting step's
    off-policy rollouts are not trained on. LoRA's B matrices start at zero, so its checkpoint shows any step taken."""
    from safetensors.torch import load_file

    plant("wrong temperature", monkeypatch)
    with pytest.warns(UserWarning, match=r"\(step 1: mean .*; the step's update is not applied\)"):
        run_dir = train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-samples", "0", "--max-steps", "1",
                                       "--learning-rate", "5e-2"))
    line = read_lines(run_dir, "train")[0]
    assert line["sampler/logprob_diff_mean"] > policy.LOGPROB_GAP_LIMIT and "sampler/fallback" in line
    assert line["optimizer_steps"] == 0 and line["skipped_steps"] == 0 and line["update_rows"] == 4
    weights = load_file(run_dir / "checkpoints" / "step_000001" / "adapter" / "adapter_model.safetensors")
    lora_b = [value for key, value in weights.items() if "lora_B" in key]
    assert lora_b and all(int(value.count_nonzero()) == 0 for value in lora_b)


def test_a_resume_keeps_generating_with_what_the_run_fell_back_to(peaked_model_dir, tmp_path, monkeypatch, capsys):
    """The fallback is saved with the checkpoint: a resumed run (a new process, after a preemption) does not train
    another step on the faulty engine, and says in one line why it generates with generate()."""
    plant("wrong temperature", monkeypatch)
    argv = tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-samples", "0", "--learning-rate", "5e-2")
    train.main(argv + ["--max-steps", "2"])
    monkeypatch.setattr(sampling, "_FALLBACKS", type(sampling._FALLBACKS)())  # what a new process starts with
    capsys.readouterr()
    run_dir = train.main(argv + ["--max-steps", "4", "--resume"])
    lines = read_lines(run_dir, "train")
    assert [(line["step"], line["sampler/engine"]) for line in lines] == [(1, 1), (2, 0), (3, 0), (4, 0)]
    assert [line["step"] for line in lines if "sampler/fallback" in line] == [1]
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("generating with Hugging Face generate(), as before the ")]
    assert len(said) == 1 and "(step 1: mean |log-prob difference|" in said[0]
    assert "note: the decode engine was left: the decode engine samples from another policy" in out[-1]


def test_backend_engine_stops_the_run_with_a_one_line_error(peaked_model_dir, tmp_path, monkeypatch):
    plant("wrong temperature", monkeypatch)
    with pytest.raises(sampling.SamplerError, match=r"step 1: mean \|log-prob difference\| [0-9.]+ > ") as error:
        train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-samples", "0", "--backend", "engine"))
    assert "\n" not in str(error.value) and "--backend engine allows no fallback" in str(error.value)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["backend"] == "engine"


def test_evaluation_guard_falls_back_and_scores_hf_rollouts(smollm2_tokenizer, monkeypatch):
    """eval.py's check on its first chunk: a faulty engine is left for generate(), and the whole evaluation equals
    one made with generate() from the start."""
    examples = data.build_prompt_set("arithmetic", "test", smollm2_tokenizer, num_rows=4)
    prompts, answers = [e.text for e in examples], [e.answer for e in examples]
    settings = sampling.GenerationSettings(max_new_tokens=6, temperature=1.0, rollout_batch_size=4)
    reference = heldout.evaluate(peaked_model(), smollm2_tokenizer, prompts, answers,
                                 sampling.GenerationSettings(**{**vars(settings), "backend": "hf"}), repeats=2)
    plant("wrong temperature", monkeypatch)
    model = peaked_model()
    with pytest.warns(UserWarning, match=r"\(evaluation: mean \|log-prob difference\|"):
        result = heldout.evaluate(model, smollm2_tokenizer, prompts, answers, settings, repeats=2)
    assert (result.accuracy, result.mean_completion_length, result.num_samples) == \
        (reference.accuracy, reference.mean_completion_length, reference.num_samples)
    assert "evaluation" in sampling.fallback_reason(model)
    with pytest.raises(sampling.SamplerError, match="evaluation"):
        heldout.evaluate(peaked_model(), smollm2_tokenizer, prompts, answers,
                         sampling.GenerationSettings(**{**vars(settings), "backend": "engine"}))


def test_a_run_checks_its_evaluations_only_before_its_own_steps_do(peaked_model_dir, tmp_path, monkeypatch):
    """The step-0 evaluation checks the sampler (an extra forward pass); the later ones leave it to every step's
    update, and so do a resumed run's, which all follow a step of its own."""
    measured = []
    measure = heldout.measure_sampler_gap
    monkeypatch.setattr(heldout, "measure_sampler_gap", lambda *a, **k: measured.append(1) or measure(*a, **k))
    run_dir = train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-interval", "1", "--max-steps", "3"))
    assert [line["step"] for line in read_lines(run_dir, "eval")] == [0, 1, 2, 3] and len(measured) == 1
    train.main(tiny_argv(peaked_model_dir, tmp_path / "run", "--eval-interval", "1", "--max-steps", "5", "--resume"))
    assert [line["step"] for line in read_lines(run_dir, "eval")] == [0, 1, 2, 3, 4, 5] and len(measured) == 1
