"""train.py's model flags (the "model" group; run/config.py assembles the parser): which model, LoRA, precision,
memory and speed, the device; --bf16 and --device as a run records them, and `model_options`, what
models.load_policy takes from them. The checks that need the machine are config.check_args'."""

import argparse

import models
import policy

NON_NEGATIVE = ("lora_rank",)
POSITIVE_INTS = ("lora_alpha",)  # >= 1 when given


def add_flags(group):
    """The model flags, in --help's order."""
    add = group.add_argument
    add("--model", help=f"Hub id, local folder/.gguf, or {models.SMOLLM2_ALIAS!r} (the offline demo model: "
        "SmolLM2-135M-Instruct quantised to 4 bits, Q4_1, de-quantised to float32)")
    add("--lora-rank", type=int, default=0, help="LoRA rank r; 0 = full fine-tuning")
    add("--lora-alpha", type=int, help="LoRA alpha (the adapter's scale is alpha / r)")
    add("--lora-target-modules", default=",".join(models.DEFAULT_LORA_TARGETS),
        help="comma-separated names of the projections LoRA adapts; auto: every linear projection inside the decoder "
             "blocks, named from the model (Phi-3's fused qkv_proj and gate_up_proj included)")
    add("--load-in-4bit", action="store_true", help="bitsandbytes NF4 base weights (QLoRA), CUDA only")
    add("--bf16", action=argparse.BooleanOptionalAction, default=False,
        help="bfloat16 compute (LoRA: bf16 frozen base weights; full fine-tuning: fp32 weights + bf16 autocast); "
             "the demo preset: on where the device computes bf16 natively (a CPU with AVX-512 BF16 or AMX, a CUDA "
             "GPU with bf16), else off")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
        help="recompute each layer's activations in the backward pass instead of keeping them: less memory, "
             "~1/3 more update time")
    add("--prefix-sharing", choices=("on", "off"), default="on",
        help="each distinct token computed once: generation and evaluation run the prefix every prompt shares once; "
             "the update runs each distinct prompt once for all its rollouts, and the shared prefix once (the same "
             "completions, loss and gradients, to float rounding; off: every row runs its prompt in full)")
    add("--device", help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")


def resolve_device(args):
    """--device (default: cuda where torch sees a GPU, else cpu) and --bf16 as the run records them (imports torch)."""
    args.device = args.device or models.default_device()
    args.bf16 = resolved_bf16(args.bf16, args.device)


def resolved_bf16(value, device):
    """--bf16 as a run records it: the demo preset's "auto" is whether `device` computes bf16 natively
    (policy.native_bf16); a flag given is kept."""
    return policy.native_bf16(device) if value == "auto" else bool(value)


def model_options(args):
    """models.load_policy's options from the flags (besides the model, its dtype and device)."""
    return dict(load_in_4bit=args.load_in_4bit, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                gradient_checkpointing=args.gradient_checkpointing,
                lora_target_modules=tuple(args.lora_target_modules.split(",")))
