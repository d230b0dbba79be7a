"""The parts of train.py's loop around the step (paper §4's protocol: a fixed held-out set evaluated during training):
loading the run's prompts and policy (`load`), continuing from its newest checkpoint (`resume`), and the held-out
evaluation between steps (`evaluate_heldout`, `evaluation_due`). Not the method: train.train_step is."""

import sys
import warnings

import torch
from tqdm import tqdm

import data
import models
import policy
import sampling
import update
from run import checkpoint, completions, config, report, runfolder, signals


def load(args, processes):
    """(tokenizer, training prompts, held-out prompts (long ones kept, as eval.py does), policy, optimizer)."""
    tokenizer = models.load_tokenizer(args.model)
    common = dict(data_dir=args.data_dir, one_shot=args.one_shot, prefill_think=args.prefill_think,
                  system_prompt=data.system_prompt_of(args.system_prompt), source=config.data_source(args))
    train_set = data.build_prompt_set(args.dataset, "train", tokenizer, num_rows=args.num_train_rows,
                                      max_prompt_tokens=args.max_prompt_tokens, **common)
    if args.prompts_per_step > len(train_set):  # a step would repeat prompts (a typo's count: fill the memory)
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} exceeds the {len(train_set)} training prompts")
    eval_set = data.build_prompt_set(args.dataset, "test", tokenizer, num_rows=args.eval_samples,
                                     **common) if args.eval_samples else []
    torch.manual_seed(args.seed)  # LoRA initialisation; right here, as imports above may draw random numbers
    model = processes.load_policy(args)
    model.train()  # checkpointing acts in training mode; dropout is off where it would run (sampling, update)
    # held-out prompts are not cut to --max-prompt-tokens: the longest of them may be longer
    held_out_tokens = data.prompt_token_counts([e.text for e in eval_set], tokenizer)
    check_held_out_fits(eval_set, held_out_tokens, args, policy.hf_model(model).config)
    longest = max([args.max_prompt_tokens] + held_out_tokens)
    models.check_generation_fits(model, args.rollout_batch_size, longest + args.max_completion_tokens,
                                 f"--rollout-batch-size (now {args.rollout_batch_size}) or --max-completion-tokens "
                                 f"(now {args.max_completion_tokens})")
    optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    return tokenizer, train_set, eval_set, model, optimizer


def check_held_out_fits(eval_set, tokens, args, model_config):
    """Held-out prompts are kept whatever their length (eval.py's too), so one whose tokens and a completion exceed
    the model's positions is refused, naming its file and question (no flag could make it fit)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    over = [i for i, count in enumerate(tokens) if limit and count + args.max_completion_tokens > limit]
    if over:
        where = f"--eval-dataset {args.eval_dataset}" if args.eval_dataset else f"--dataset {args.dataset}"
        question = " ".join(eval_set[over[0]].columns.get("question", "").split())
        question = question[:60] + ("..." if len(question) > 60 else "")
        raise ValueError(f"{where}: a held-out row's prompt is {tokens[over[0]]} tokens, which with "
                         f"--max-completion-tokens {args.max_completion_tokens} exceed the model's {limit} positions "
                         f"(question {question!r}; {len(over)} such rows): shorten or remove them")


def evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, measure, check_sampler=True):
    """Held-out accuracy of the current policy by `measure` (eval.evaluate, the measurement, which train.py passes in:
    run/ imports no command), logged (fixed sample and seed: runs are compared paired). check_sampler: eval.py's
    check of the first chunk (a forward pass, ~14 s for 64 demo prompts on 2 cores); run() makes it only before this
    process's first training step, as every step's update checks the sampler after."""
    examples, first_chunk, chunk = processes.eval_share(eval_set, args.rollout_batch_size)
    settings = config.generation_settings(args, temperature=args.eval_temperature, rollout_batch_size=chunk)
    samples = []  # graded completions, for the completions log
    with processes.full_weights(model), signals.cuda_oom_hint(args, "evaluation"):
        result = measure(model, tokenizer, [e.text for e in examples], [e.answer for e in examples],
                         settings, seed=first_chunk, samples_out=samples, check_sampler=check_sampler,
                         answer_kind=args.answer_kind)
    result = processes.merged(result)
    if processes.is_main:
        tqdm.write(report.eval_line(state.step, result))  # above the progress bar
    if args.log_completions_interval:
        write(completions.eval_completions_record(state.step, samples[:completions.EVAL_COMPLETIONS_LOGGED]))
    state.evaluated_step = state.step
    write({"type": "eval", "step": state.step, "elapsed_s": state.elapsed_s, "eval/accuracy": result.accuracy,
           "eval/format_accuracy": result.format_accuracy, "eval/both_accuracy": result.both_accuracy,
           "eval/mean_completion_length": result.mean_completion_length, "eval/num_samples": result.num_samples,
           "eval/grader_timeouts": result.grader_timeouts, "eval/eval_s": result.elapsed_s})
    return result.accuracy


def evaluation_due(args, step, before_s, after_s):
    """Whether the step that took the training seconds from before_s to after_s ends with an evaluation: every
    --eval-interval steps, or (--eval-interval-s S) when it crossed a multiple of S. Both come from the run's state,
    so a resumed run keeps the cadence of the run it continues."""
    by_step = args.eval_interval and step % args.eval_interval == 0
    by_time = args.eval_interval_s and after_s // args.eval_interval_s > before_s // args.eval_interval_s
    return bool(by_step or by_time)


def resume(run_dir, model, optimizer, args, processes):
    """The TrainerState of the run's newest readable checkpoint, with model, optimizer and RNG restored."""
    path, skipped = runfolder.newest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: no readable checkpoint in {run_dir}: " + "; ".join(why for _, why in skipped))
    state = checkpoint.TrainerState.from_saved(processes.load_checkpoint(path, model, optimizer))
    update.set_hyperparameters(optimizer, args.learning_rate, args.weight_decay)  # this run's flags win
    if state.sampler_fallback and args.backend is None:  # the engine the run left stays left (--backend: as asked)
        backend, why = state.sampler_fallback
        with warnings.catch_warnings():  # one line, below, instead of fall_back's warning
            warnings.simplefilter("ignore")
            sampling.fall_back(model, backend, why)
    if processes.is_main:
        for passed, why in skipped:
            print(f"passed over {passed}: {why}", file=sys.stderr)
        restored = checkpoint.check_metrics_log(run_dir, path, state.metrics_bytes)  # cut or deleted: restored
        if restored:
            print(restored, file=sys.stderr)
        print(f"resumed {path} (step {state.step}, {state.elapsed_s:.0f} s of training)")
        if state.sampler_fallback and args.backend is None:
            print(f"generating with {sampling.BACKEND_NAMES[state.sampler_fallback[0]]}, as before the checkpoint: "
                  f"{state.sampler_fallback[1]}")
    return state
