"""What the model-shape benchmarks share (paper §1, Fig. 1, §4 setting (a)): their shapes, models built from the
shipped configs, the trainer's settings, the generation and update they time, the stopwatch, and the output.

Everything timed is the code the trainer runs: generation through sampling.sample_completions (the decode engine;
the Hugging Face generate() backend for comparison), the update through update.fill_logprobs and
update.update_policy with the update settings config.update_settings builds for preset (a), the optimizer of
update.make_optimizer. Models are built from the shipped configs (model_configs/) with random weights: speed and
memory do not depend on the weights. Completions run to their full length (no EOS ids: no row ends). On CPU (or
with --tiny) a 2-layer model of the same architecture and toy shapes runs every code path; its figures are smoke
figures. Peak memory is CUDA's max_memory_allocated per phase (update.peak_memory_gib); n/a on CPU.
"""

import argparse
import atexit
import importlib.util
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from run import config
import engine
import models
import policy
import sampling
import stopwatch
import update

CONFIG_DIR = Path(__file__).resolve().parent.parent / "model_configs"
MODEL_CONFIGS = {"qwen2.5-3b": "qwen2.5-3b-instruct.json", "llama-3.2-3b": "llama-3.2-3b-instruct.json"}
TINY_VOCAB = 1024
GIB = 2 ** 30
EOS = 2          # any id: the pad id of completions, and the EOS of engine.generate's forced lengths
NO_EOS = ()      # as the EOS ids of sampling / engine.generate: no row ends, every completion runs to full length


@dataclass(frozen=True)
class Shapes:
    prompt_tokens: int          # asymmetry / memory: setting (a) maximum prompt + completion
    completion_tokens: int
    lora_rank: int
    rollouts: tuple             # asymmetry points
    pods_n: int
    pods_m: int
    micro_batch_size: int
    rollout_batch_size: int
    decode_batch: int           # decode: batch 64, 992 + 32 tokens: a 1024-token cache, mean context 1008
    decode_prompt_tokens: int
    decode_new_tokens: int


SETTING_A = Shapes(512, 512, 64, (16, 64, 256), 64, 16, 4, 64, 64, 992, 32)
TINY = Shapes(8, 8, 4, (2, 8), 8, 2, 2, 8, 4, 8, 8)


# ---------------------------------------------------------------- arithmetic (unit-tested by hand)

def kv_cache_bytes(model_config, batch, tokens, bytes_per_element=2):
    """Bytes of keys + values for `batch` rows of `tokens` positions: layers * 2 * kv_heads * head_dim."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return model_config.num_hidden_layers * 2 * kv_heads * head_dim * tokens * batch * bytes_per_element


# ---------------------------------------------------------------- models and the trainer's settings

def real_config(name):
    """The shipped config of `name` (model_configs/), as a transformers config."""
    from transformers import AutoConfig

    values = json.loads((CONFIG_DIR / MODEL_CONFIGS[name]).read_text())
    return AutoConfig.for_model(**{k: v for k, v in values.items() if not k.startswith("_")})


def base_model(name, *, tiny, device, dtype, vocab_size=None, token_ids=None):
    """Random weights built on the device: the shipped config (vocab_size / bos, eos, pad ids replaced when
    given, e.g. by another tokenizer's) or, with tiny, a 2-layer model of its architecture."""
    if tiny:
        return models.tiny_random_model(real_config(name).model_type, vocab_size=vocab_size or TINY_VOCAB,
                                        **(token_ids or {})).to(device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    model_config = real_config(name)
    for key, value in dict(vocab_size=vocab_size, **(token_ids or {})).items():
        if value is not None:
            setattr(model_config, key, value)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config, dtype=dtype)


_CHECKPOINTS = {}


def random_checkpoint(name, tiny, device):
    """Random bf16 weights saved once per process, so 4-bit goes through the real models.load_policy path."""
    if (name, tiny) not in _CHECKPOINTS:
        folder = tempfile.mkdtemp(prefix=f"pods_random_{name}_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        model = base_model(name, tiny=tiny, device=device, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        free(device)
        _CHECKPOINTS[name, tiny] = folder
    return _CHECKPOINTS[name, tiny]


def trainer_args(device, *, tiny, lora_rank, flags=()):
    """The flags of preset (a) as train.py resolves them (config.parse_args), for this device; the dataset is the
    synthetic one so that no data folder is needed (benchmarks pass their own prompts)."""
    argv = ["--preset", "a", "--dataset", "arithmetic", "--eval-samples", "0", "--device", str(device),
            "--lora-rank", str(lora_rank), *([] if device.type == "cuda" and not tiny else ["--no-bf16"]), *flags]
    return config.parse_args(argv)


def build_policy(name, *, tiny, device, precision, args, seed=0, **base):
    """The policy as the loop's load (run/loop.py) builds it from `args` (trainer_args): LoRA, gradient checkpointing, train mode;
    bf16, fp32 or 4-bit base weights."""
    lora = {key: value for key, value in config.model_options(args).items() if key != "load_in_4bit"}
    torch.manual_seed(seed)
    if precision == "4bit":
        model = models.load_policy(random_checkpoint(name, tiny, device), dtype=torch.bfloat16, device=str(device),
                                   load_in_4bit=True, **lora)
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = models.prepare_for_training(base_model(name, tiny=tiny, device=device, dtype=dtype, **base), **lora)
    model.train()
    return model


def random_prompts(vocab_size, rows, tokens, seed):
    return torch.randint(3, vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def synthetic_batch(rows, prompt_tokens, completion_tokens, vocab_size, seed=0):
    """Random prompts, full-length random completions and random advantages: an update.UpdateBatch of a given
    shape (the update's cost depends on shapes, not on token values)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab_size, (rows, prompt_tokens), generator=generator)
    completion_ids = torch.randint(3, vocab_size, (rows, completion_tokens), generator=generator)
    return update.UpdateBatch(prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids),
                              torch.randn(rows, generator=generator), torch.ones(rows, dtype=torch.bool))


def generate(model, prompt_ids, n, new_tokens, args, seed, **overrides):
    """n full-length completions per prompt through the trainer's sampling path and generation settings
    (config.generation_settings; overrides e.g. generation_copy or backend)."""
    settings = config.generation_settings(args, max_new_tokens=new_tokens, **overrides)
    return sampling.sample_completions(model, prompt_ids, torch.ones_like(prompt_ids), n, NO_EOS, EOS, settings,
                                       seed)[0]


def run_update(model, optimizer, rows, shapes, settings, seed):
    """The update of one step on `rows` synthetic kept rollouts: fill_logprobs + update_policy, as train_step."""
    vocab_size = policy.hf_model(model).config.vocab_size
    batches = [synthetic_batch(rows, shapes.prompt_tokens, shapes.completion_tokens, vocab_size, seed=seed)]
    update.fill_logprobs(model, batches, settings)
    return update.update_policy(model, optimizer, batches, settings)


def engine_stats():
    """A copy of the engine's process totals (subtract two copies for one call's share)."""
    return replace(engine.STATS)


def new_graphs(before):
    """CUDA graphs recorded + steps compiled by the engine since the copy `before` (engine_stats)."""
    now = engine.STATS
    return now.captured_graphs + now.compiled_graphs - before.captured_graphs - before.compiled_graphs


# ---------------------------------------------------------------- timing and memory

def timed(fn, device):
    """(fn(), its wall-clock seconds) with stopwatch.timed, the project's stopwatch; on CUDA the work queued before is
    finished first, so only fn's own is counted."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = {}
    with stopwatch.timed(seconds, "fn", device):
        result = fn()
    return result, seconds["fn"]


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def phase_peak_gib(device, reserved=False):
    """Peak CUDA memory since reset_peak; None on CPU (a process-wide peak RSS says nothing about one phase)."""
    return update.peak_memory_gib(device, reserved) if device.type == "cuda" else None


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- command line and output

def pick_device(name):
    """torch.device(name), default cuda when available."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_label(device, tiny):
    return "CPU smoke figures (tiny model, toy shapes), not the paper's" if device.type == "cpu" else \
        f"{torch.cuda.get_device_name(device)}{', tiny model' if tiny else ''}"


def parse_args(name, argv, defaults, description):
    """The options of the model-shape benchmarks (asymmetry, memory, decode), checked; args.shapes: SETTING_A or
    TINY with the given overrides; args.trainer: the trainer's flags for them (trainer_args)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=f"python -m bench {name}", description=description)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_CONFIGS), default="qwen2.5-3b")
    add("--device", default=None, help="cuda / cpu (default: cuda when available)")
    add("--tiny", action="store_true", help="2-layer model, toy shapes (always on for CPU)")
    add("--precisions", default=defaults["precisions"], help="comma list of bf16, fp32, 4bit")
    add("--rollouts", default=None, help="comma list of rollouts per step (asymmetry)")
    add("--prompt-tokens", type=int, default=None)
    add("--completion-tokens", type=int, default=None)
    add("--lora-rank", type=int, default=None)
    add("--micro-batch-size", type=int, default=None)
    add("--rollout-batch-size", type=int, default=None, help="generation chunk (memory bound)")
    add("--batch", type=int, default=None, help="decode batch (decode)")
    add("--new-tokens", type=int, default=None, help="decode steps per timed call (decode)")
    add("--repeats", type=int, default=2, help="timed repeats, best kept (decode)")
    add("--bandwidth-gbs", type=float, default=None, help="device DRAM bandwidth, GB/s (decode)")
    add("--budget-gib", type=float, default=40.0, help="memory target (memory)")
    add("--seed", type=int, default=0)
    add("--out-dir", default="bench_out", help="JSON results (and the plot) go here")
    add("--plot", default=None, help="PNG path (asymmetry; default <out-dir>/bench_asymmetry.png)")
    args = parser.parse_args(argv)
    args.device = pick_device(args.device)
    args.tiny = args.tiny or args.device.type == "cpu"
    overrides = {"prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
                 "lora_rank": args.lora_rank, "micro_batch_size": args.micro_batch_size,
                 "rollout_batch_size": args.rollout_batch_size, "decode_batch": args.batch,
                 "decode_prompt_tokens": args.prompt_tokens, "decode_new_tokens": args.new_tokens,
                 "rollouts": tuple(int(r) for r in args.rollouts.split(",")) if args.rollouts else None}
    args.shapes = replace(TINY if args.tiny else SETTING_A, **{k: v for k, v in overrides.items() if v is not None})
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for precision in args.precisions:
        if precision not in ("bf16", "fp32", "4bit"):
            raise ValueError(f"unknown precision {precision!r} (bf16, fp32, 4bit)")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    args.out_dir = Path(args.out_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# bench {name}: {args.model}, {device_label(args.device, args.tiny)}; shapes {asdict(args.shapes)}")
    shapes = args.shapes
    args.trainer = trainer_args(args.device, tiny=args.tiny, lora_rank=shapes.lora_rank, flags=[
        "--micro-batch-size", str(shapes.micro_batch_size), "--rollout-batch-size", str(shapes.rollout_batch_size)])
    return args


def runnable_precisions(args):
    """4-bit needs CUDA and bitsandbytes; on CPU those rows are skipped with a note, and bf16 runs in fp32
    (CPU bf16 matmuls are emulated and only measure the emulation)."""
    kept = []
    for precision in args.precisions:
        if precision == "4bit" and (args.device.type != "cuda" or importlib.util.find_spec("bitsandbytes") is None):
            print("note: 4bit rows skipped (bitsandbytes NF4 needs CUDA and the bitsandbytes package)")
            continue
        kept.append("fp32" if precision == "bf16" and args.device.type == "cpu" else precision)
    return list(dict.fromkeys(kept))


def print_header(columns):
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def print_row(row, columns):
    """One table row, printed (and flushed) as soon as it is measured."""
    def cell(value):
        if value is None:
            return "n/a"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    print("| " + " | ".join(cell(row.get(column)) for column in columns) + " |", flush=True)


def verdict(ok):
    return "PASS" if ok else "FAIL"


def save_json(out_dir, name, result):
    """<out_dir>/bench_<name>.json (created if needed); returns its path."""
    path = Path(out_dir) / f"bench_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"results: {path}")
    return path
