"""train.py's generation flags (the "generation" group; run/config.py assembles the parser): sampling, the backend,
the completion budget and the batch sizes of generation and of the update's forward/backward; their ranges, and
`generation_settings`, the sampling.GenerationSettings of them."""

import argparse

# The choices of --backend, written here so that --help needs no torch (a test keeps them equal to sampling.BACKENDS'
# own).
BACKENDS = ("engine", "hf")
POSITIVE_INTS = ("max_completion_tokens", "rollout_batch_size", "micro_batch_size")
RANGES = (("--temperature", "temperature", lambda value: value > 0, "> 0"),
          ("--top-p", "top_p", lambda value: 0 < value <= 1, "in (0, 1]"))


def add_flags(group):
    """The generation flags, in --help's order."""
    add = group.add_argument
    add("--temperature", type=float, help="sampling temperature of the rollouts (> 0)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling of the rollouts: keep the most likely tokens "
        "up to this probability mass (1 = off)")
    add("--backend", choices=BACKENDS, help="engine: the decode engine, any failure or log-prob gap an "
        "error; hf: generate(); default: the engine, falling back when it fails (docs/generation.md)")
    add("--generation-copy", action=argparse.BooleanOptionalAction, default=None,
        help="decode from a copy of the weights with LoRA merged in (plain GEMMs, CUDA graphs); default: on, except "
             "with --load-in-4bit, where the bf16 copy costs ~2 bytes per base parameter (5.5 GB for a 3B model)")
    add("--max-completion-tokens", type=int, help="tokens generated per rollout at most (a longer one is cut: "
        "truncated)")
    add("--rollout-batch-size", type=int, help="sequences per generate call (bounds generation's memory)")
    add("--micro-batch-size", type=int, help="sequences per forward/backward (bounds the update's memory)")


def generation_settings(args, **overrides):
    """The flags of generation as sampling.GenerationSettings (overrides: e.g. the evaluation's temperature). On
    CUDA one KV-cache length for every call (longest prompt + completion), so training and evaluation share one set
    of recorded decode graphs; elsewhere nothing is recorded and each call attends over its own prompts' length."""
    import sampling

    cuda = str(args.device).startswith("cuda")
    settings = dict(max_new_tokens=args.max_completion_tokens, temperature=args.temperature, top_p=args.top_p,
                    rollout_batch_size=args.rollout_batch_size, generation_copy=args.generation_copy,
                    backend=args.backend, prefix_sharing=args.prefix_sharing == "on",
                    cache_tokens=args.max_prompt_tokens + args.max_completion_tokens if cuda else 0)
    return sampling.GenerationSettings(**dict(settings, **overrides))
