"""Model-shape benchmarks of the PODS premise (paper §1 and Fig. 1): generation scales with the number of
rollouts while the policy update is memory-bound, so generating n rollouts and training on m < n is cheap.

  asymmetry  generation vs update time over rollouts per step (Fig. 1)                     (here)
  memory     peak GPU memory per phase of one setting-(a) PODS step (4-bit + LoRA r=64)      (here)
  decode     decode step time at batch 64 vs the memory-bandwidth bound and generate()      bench_decode.py
  step       the real train.train_step, PODS 64/16 vs GRPO 16/16, seconds per phase         bench_step.py

GPU commands (one H100 or H200, from the repository root; each prints its rows as they complete):

    python bench.py save-tokenizer bench_out/tokenizer   # where the offline demo package is installed (3.5 MB)
    # copy bench_out/tokenizer/ to the same place in the checkout on the GPU machine, then:
    python bench.py decode                               # bf16 (+ 4-bit when bitsandbytes imports), < 5 min
    python bench.py asymmetry                            # Fig. 1 table + bench_out/bench_asymmetry.png, < 5 min
    python bench.py memory                               # 4-bit + LoRA r=64 + checkpointing, < 5 min
    python bench.py step --tokenizer bench_out/tokenizer                 # PODS vs GRPO, steady state
    python bench.py step --tokenizer bench_out/tokenizer --vary-widths   # 20 steps: recompiles after warm-up

Everything timed is the code the trainer runs: generation through sampling.sample_completions (the decode
engine; the Hugging Face generate() reference for comparison), the update through update.fill_logprobs and
update.update_policy with the update settings config.update_settings builds for preset (a), the optimizer of
update.make_optimizer. Models are built from the shipped configs (model_configs/) with random weights: speed and
memory do not depend on the weights. Completions have a forced length (EOS ignored). On CPU (or with --tiny) a
2-layer model of the same architecture and toy shapes runs every code path; its figures are smoke figures.
Peak memory is CUDA's max_memory_allocated per phase (update.peak_memory_gib); n/a on CPU.
"""

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import config
import engine
import models
import sampling
import update

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
MODEL_CONFIGS = {"qwen2.5-3b": "qwen2.5-3b-instruct.json", "llama-3.2-3b": "llama-3.2-3b-instruct.json"}
TINY_VOCAB = 1024
GIB = 2 ** 30
EOS = 2  # any id: completions have a forced length


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

def kv_cache_bytes(config, batch, tokens, bytes_per_element=2):
    """Bytes of keys + values for `batch` rows of `tokens` positions: layers * 2 * kv_heads * head_dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * tokens * batch * bytes_per_element


def held_bytes(value):
    """Bytes of every tensor in a (nested) list / tuple / dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(held_bytes(item) for item in items)


def engine_held_gib(model, generation_copy=None):
    """What the decode engine keeps for `model` between calls: merged weight copies and KV buffers (GiB)."""
    cached = engine.engine_for(model, generation_copy, refresh_weights=False)
    return (held_bytes([weight for _, weight in cached.copies]) + held_bytes(cached.buffers)) / GIB


# ---------------------------------------------------------------- models, timing, the trainer's settings

def real_config(name):
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
    """The policy as train.load builds it from `args` (trainer_args): LoRA, gradient checkpointing, train mode;
    bf16, fp32 or 4-bit base weights."""
    lora = dict(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                gradient_checkpointing=args.gradient_checkpointing, lora_target_modules=tuple(args.lora_target_modules.split(",")))
    torch.manual_seed(seed)
    if precision == "4bit":
        model = models.load_policy(random_checkpoint(name, tiny, device), dtype=torch.bfloat16, device=str(device),
                                   load_in_4bit=True, **lora)
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = models.prepare_for_training(base_model(name, tiny=tiny, device=device, dtype=dtype, **base), **lora)
    model.train()
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


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


def random_prompts(vocab_size, rows, tokens, seed):
    return torch.randint(3, vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def generate(model, prompt_ids, n, new_tokens, args, seed, **backend):
    """n forced-length completions per prompt through the trainer's sampling path (default backend: the engine)."""
    return sampling.sample_completions(
        model, prompt_ids, torch.ones_like(prompt_ids), n, new_tokens, [EOS], EOS, temperature=args.temperature,
        top_p=args.top_p, rollout_batch_size=args.rollout_batch_size, seed=seed, ignore_eos=True, **backend)[0]


def run_update(model, optimizer, rows, shapes, settings, seed):
    """The update of one step on `rows` synthetic kept rollouts: fill_logprobs + update_policy, as train_step."""
    vocab_size = engine.hf_model(model).config.vocab_size
    batches = [update.synthetic_batch(rows, shapes.prompt_tokens, shapes.completion_tokens, vocab_size, seed=seed)]
    update.fill_logprobs(model, batches, settings)
    return update.update_policy(model, optimizer, batches, settings)


def engine_stats():
    """A copy of the engine's process totals (subtract two copies for one call's share)."""
    return replace(engine.STATS)


# ---------------------------------------------------------------- command line and output

def parse_args(name, argv, defaults):
    parser = argparse.ArgumentParser(prog=f"bench.py {name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_CONFIGS), default="qwen2.5-3b")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, toy shapes (always on for CPU)")
    parser.add_argument("--precisions", default=defaults["precisions"], help="comma list of bf16, fp32, 4bit")
    parser.add_argument("--rollouts", default=None, help="comma list of rollouts per step (asymmetry)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--completion-tokens", type=int, default=None)
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="generation chunk (memory bound)")
    parser.add_argument("--batch", type=int, default=None, help="decode batch (decode)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps per timed call (decode)")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats, best kept (decode)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="device DRAM bandwidth, GB/s (decode)")
    parser.add_argument("--budget-gib", type=float, default=40.0, help="memory target (memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench_out", help="JSON results (and the plot) go here")
    parser.add_argument("--plot", default=None, help="PNG path (asymmetry; default <out-dir>/bench_asymmetry.png)")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
    label = "CPU smoke figures (tiny model, toy shapes), not the paper's" if args.device.type == "cpu" else \
        f"{torch.cuda.get_device_name(args.device)}{', tiny model' if args.tiny else ''}"
    print(f"# bench {name}: {args.model}, {label}; shapes {asdict(args.shapes)}")
    shapes = args.shapes
    args.trainer = trainer_args(args.device, tiny=args.tiny, lora_rank=shapes.lora_rank, flags=[
        "--micro-batch-size", str(shapes.micro_batch_size), "--rollout-batch-size", str(shapes.rollout_batch_size)])
    return args


def runnable_precisions(args):
    """4-bit needs CUDA and bitsandbytes; on CPU those rows are skipped with a note, and bf16 runs in fp32
    (CPU bf16 matmuls are emulated and only measure the emulation)."""
    import importlib.util

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


def save_json(args, name, result):
    path = Path(args.out_dir) / f"bench_{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"results: {path}")


def main(name, argv=None):
    """Entry point used by bench.py: `python bench.py asymmetry|decode|memory|step|save-tokenizer [options]`."""
    import bench_decode
    import bench_phases
    import bench_step

    commands = {"asymmetry": bench_phases.bench_asymmetry, "memory": bench_phases.bench_memory,
                "decode": bench_decode.bench_decode, "step": bench_step.bench_step,
                "save-tokenizer": bench_step.save_tokenizer}
    if name not in commands:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(commands)}")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # rows appear as they complete, even through a pipe
    return commands[name](list(argv or []))
