"""The reading path of README's "Read the code": the project files one training step enters, measured.

One tiny step of `train.train_step` with the default flags (the demo preset, the real rewards; only its sizes
smaller) on a tiny random Llama with the demo's LoRA, traced with sys.settrace: every project file in which
a function runs (tests/ excluded), in the order the step first enters it. Traced on the default backend (the decode
engine, which runs on a CPU too) and on the reference Hugging Face backend (`--backend hf`), in float32 (`--no-bf16`),
and once more on the default backend in bf16 (`--bf16`, a bf16 base), for what that precision adds. The precision is
named, not the CPU's: the demo's `--bf16 auto` and `policy.native_bf16` are pinned while tracing, so the path is the
same on a CPU with or without bf16 instructions.

    python -m tests.reading_path            # print the paths, with each file's lines and the totals
    python -m tests.docs_tables --write     # rewrite README's generated block (and the docs' tables)

tests/test_docs.py checks that README's block equals this trace. The block names the files and what each holds, no
line counts: an edit that keeps the path the same never changes it; a file added to the path or taken off it does.
"""

import ast
import re
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "reading-path"  # its name in README's markers (tests/docs_tables.py)


# Only sizes differ from the defaults (the demo preset's 16/4, 4 prompts, 32 tokens): the same code runs, faster.
TINY_SIZES = ["-n", "4", "-m", "2", "--prompts-per-step", "2", "--max-completion-tokens", "8"]
PRECISIONS = {"float32": "--no-bf16", "bf16": "--bf16"}


def traced_step_files(backend, tokenizer=None, precision="float32"):
    """The project files (paths relative to the repository, in order of first entry) that one training step with
    the default flags (smaller sizes: TINY_SIZES) enters with --backend `backend` ("hf" or "engine") in `precision`
    ("float32" or "bf16": the flag, the base weights' dtype and policy.native_bf16 alike, whatever this CPU has).
    tokenizer: the demo model's (loaded here when None)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    from run import config
    import data
    import models
    import policy
    import train
    import update

    bf16 = precision == "bf16"
    native_bf16 = policy.native_bf16
    policy.native_bf16 = lambda device: bf16  # the precision named, not the CPU's (put back below)
    try:
        args = config.parse_args(["--backend", backend, "--device", "cpu", PRECISIONS[precision], *TINY_SIZES])
        tokenizer = tokenizer or models.load_tokenizer(args.model)
        examples = data.build_prompt_set(args.dataset, "train", tokenizer, num_rows=args.prompts_per_step,
                                         max_prompt_tokens=args.max_prompt_tokens, one_shot=args.one_shot,
                                         system_prompt=args.system_prompt)
        torch.manual_seed(0)
        base = models.tiny_random_model("llama").to(models.compute_dtypes(args.bf16, args.lora_rank)[0])
        model = models.prepare_for_training(base, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
        optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
        settings = train.step_settings(args)  # built once per run, before the step (the loop does so too)
        return _traced(lambda: train.train_step(model, tokenizer, optimizer, [examples], settings, step=1))
    finally:
        policy.native_bf16 = native_bf16


def _traced(step):
    """The project files (tests/ excluded) in which a function runs during step(), in order of first entry."""
    import torch

    # lazy.py: the first read of a lazily imported module, which depends on what ran before in this process, not on
    # the step: left out, so the trace reads the same in a fresh process and in the test suite
    entered, seen, tests, lazy = {}, set(), ROOT / "tests", ROOT / "lazy.py"

    def trace(frame, event, arg):  # called on each function entry only; returns None: no line events
        filename = frame.f_code.co_filename
        if filename not in seen:
            seen.add(filename)
            path = Path(filename)
            if path.is_relative_to(ROOT) and not path.is_relative_to(tests) and path != lazy:
                entered[path] = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = sys.gettrace(), threading.gettrace()   # a coverage run's tracer: put back afterwards
    threading.settrace(trace)
    sys.settrace(trace)
    try:
        step()
    finally:
        sys.settrace(before[0])
        threading.settrace(before[1])
        torch.set_num_threads(threads)
    return [path.relative_to(ROOT).as_posix() for path in entered]


# What each file holds for the step (README's table); a file not named here is listed with its docstring's first
# sentence.
ROLES = {
    "train.py": "the step (`train_step`, its `Round` record, `StepSettings`) and its metrics line (`step_metrics`)",
    "grpo_loss.py": "the paper's clipped per-token GRPO loss in named parts and its normaliser (the options and the "
                    "parts of later work they switch on: `loss_options.py`, not entered)",
    "policy.py": "the policy model's calls: dropout off, the completion tokens' log-probs (the LM head fused where it "
                 "can); the sampler check against them (when to fall back to `generate()`)",
    "stopwatch.py": "the phases' stopwatch (`timed`)",
    "sampling.py": "n rollouts per prompt: chunks, seeds, first-EOS masks, the backend and its fallback",
    "engine/hf_generate.py": "Hugging Face generate with our settings only, the sampler's log-probs read between its warpers",
    "rewards.py": "the registry of reward terms (accuracy, format, tag count) weighted into one total; the answers read",
    "pods.py": "the registry of down-sampling rules (max-variance: one sort + prefix sums), `select`, the advantages",
    "update.py": "the kept rows as a batch, old/reference log-probs, micro-batches, clipping, the optimizer step",
    "engine/lora_bf16.py": "a bf16 base's LoRA adapter computed in bf16, three matrix products: `lora_forward`",
    "engine/prefix.py": "each distinct token computed once: the prefix every prompt shares, each prompt once for its rows",
    "engine/decode.py": "the decode loop: the model families it runs, bucketed KV cache, finished rows dropped",
    "engine/step.py": "one decode step of a Llama-family model, by hand, over LoRA merged into a copy of the weights",
}


def line_count(name):
    return len((ROOT / name).read_text().splitlines())


def summary(name):
    """The first sentence of a file's module docstring."""
    doc = ast.get_docstring(ast.parse((ROOT / name).read_text())) or ""
    return re.split(r"(?<=[a-z)])\. ", " ".join(doc.split("\n\n")[0].split()))[0].rstrip(".")


def role(name):
    return ROLES.get(name) or summary(name)


def joined(parts):
    """a, b and c."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def listed(names):
    """`a`, `b` and `c`."""
    return joined([f"`{name}`" for name in names])


def described(names):
    """`a` (what it holds), `b` (...) and ...; no other file, for none."""
    return joined([f"`{name}` ({role(name)})" for name in names]) if names else "no other file"


def block_body(engine_files, hf_files, bf16_files):
    """README's generated block (between its markers): the files of a default step in float32, in order, with what
    each holds; what `--backend hf` enters instead and what bf16 adds. No line counts (`python -m tests.reading_path`
    prints them)."""
    rows = [f"| {i} | `{name}` | {role(name)} |" for i, name in enumerate(engine_files, 1)]
    instead = [name for name in hf_files if name not in engine_files]
    left = [name for name in engine_files if name not in hf_files]
    added = [name for name in bf16_files if name not in engine_files]
    return "\n".join([
        f"With the default flags in float32 (`--no-bf16`) one step enters **{len(engine_files)} files**, in this "
        "order:", "", "| # | file | what it holds for the step |", "|---|---|---|", *rows, "",
        f"With `--backend hf` it enters **{len(hf_files)} files**: {described(instead)}"
        + (f" in place of {listed(left)}" if left else "") + ".", "",
        f"In bf16 (`--bf16`, a bf16 base) it also enters {described(added)}." if added else
        "In bf16 (`--bf16`, a bf16 base) it enters the same files."])


def current_body(tokenizer=None):
    import models

    tokenizer = tokenizer or models.load_tokenizer(models.SMOLLM2_ALIAS)
    return block_body(*paths(tokenizer))


def paths(tokenizer):
    """(engine float32, hf float32, engine bf16) files of one step."""
    return (traced_step_files("engine", tokenizer), traced_step_files("hf", tokenizer),
            traced_step_files("engine", tokenizer, "bf16"))


def main(argv):
    import models

    if "--write" in argv:
        sys.exit("README's block is written with the docs' tables: python -m tests.docs_tables --write")
    names = ("default backend, float32", "--backend hf, float32", "default backend, bf16")
    for name, files in zip(names, paths(models.load_tokenizer(models.SMOLLM2_ALIAS))):
        print(f"{name}: {len(files)} files, {sum(map(line_count, files)):,} lines")
        for file in files:
            print(f"  {line_count(file):6,}  {file}")


if __name__ == "__main__":
    main(sys.argv[1:])
