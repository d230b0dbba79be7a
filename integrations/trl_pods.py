"""PODS (paper §3.2-3.3, Algorithm 1) for TRL users: `PODSGRPOTrainer`, TRL's `GRPOTrainer` trained on m of n.

A TRL user changes three lines: import `PODSConfig` and `PODSGRPOTrainer` from here, use `PODSConfig(...,
num_generations=16, num_generations_kept=4)` for `GRPOConfig(...)`, and `PODSGRPOTrainer` for `GRPOTrainer`.

What it does, per generation batch (everything else is TRL's own code path):
1. TRL generates `num_generations` (n) completions per prompt and scores them (`_generate_and_score_completions`).
2. From the weighted reward sum TRL computed (its `sum_then_normalize` sum, gathered over all processes), each
   prompt keeps m completions by the rule (`pods.select`: max-variance by default, Algorithm 2; the ablation's
   random / percentile / max-reward rules too), and the advantages are recomputed over the kept subset as the
   paper does (§3.2; `advantage_normalization="group"` uses all n, the appendix ablation), with TRL's
   `scale_rewards` ("group", "batch": the std over the kept rewards, "none") and TRL's eps of 1e-4.
3. Every per-row tensor of the batch is cut to the kept rows (in generation order), padding columns no kept row
   uses are dropped, and the loss normaliser `num_items_in_batch` is recounted over the kept tokens: TRL's default
   loss ("dapo") divides by it, and a count over all n rows would scale the loss by about m/n.
The update (`compute_loss`, micro-batching over `steps_per_generation`, optimizer) then runs on m rows per prompt,
unchanged. Evaluation is untouched (every completion is scored, nothing is dropped).

Several processes (accelerate / DeepSpeed / FSDP): the selection runs on the gathered rewards on every process,
which then keeps its own rows; this is exact when each prompt's n completions sit on one process, i.e. when the
per-process generation batch (`per_device_train_batch_size` x `steps_per_generation`) is a multiple of n.

Refused at construction, with one line naming the setting (never trained silently wrong): a prompt group spread
over processes; a kept batch that does not split into `steps_per_generation` equal micro-batches;
`multi_objective_aggregation="normalize_then_sum"` (its advantages are not a function of one reward per
completion); vision inputs; `tools`, `environment_factory` and `rollout_func` (multi-turn masks, untested here);
a TRL other than the version this file was tested with. At run time, a completion for which every reward function
returned None stops the run (PODS needs a reward for every completion to choose among them).

Costs that are TRL's, not the paper's: with `beta > 0`, `num_iterations > 1`, misaligned `steps_per_generation`
or vLLM's importance-sampling correction, TRL computes the reference / old log-probs of all n completions before
the rewards exist (one no-grad forward over n rows); the gradient step itself runs on the m kept rows. The vLLM
per-row tensors are cut like the others, but the tests here run on CPU without vLLM.

Vendoring: copy this file and the repository's `pods.py` and `lazy.py` (they need only torch) next
to your training script; `import pods` must find that copy (tested: the four files alone import). The selection has one
implementation, pods.py, which the tests pin down.
"""

import dataclasses
import importlib.metadata

import torch

import pods

TESTED_TRL_VERSION = "1.16"  # major.minor: the TRL internals used below are those of this release


def check_trl_version(installed: str) -> None:
    """Refuse a TRL release this module was not tested with (it overrides TRL internals that change between them)."""
    if installed.split(".")[:2] != TESTED_TRL_VERSION.split("."):
        raise ImportError(f"trl_pods was tested with TRL {TESTED_TRL_VERSION}.x, but TRL {installed} is installed: "
                          f"pip install 'trl=={TESTED_TRL_VERSION}.*'")


check_trl_version(importlib.metadata.version("trl"))

from trl import GRPOConfig, GRPOTrainer  # noqa: E402  (after the version check, which names the fix)

# The entries of TRL's batch dict: per-row tensors are cut to the kept rows (those of completion width also lose
# trailing padding columns), prompt-width ones lose leading padding columns, the normaliser is recounted. An entry
# not listed here (a new TRL feature) stops the step rather than being passed through uncut.
PER_ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio")
PROMPT_WIDTH_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_WIDTH_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                         "sampling_per_token_logps", "importance_sampling_ratio")
NORMALISER_KEY = "num_items_in_batch"


@dataclasses.dataclass
class PODSConfig(GRPOConfig):
    """`GRPOConfig` plus the PODS settings; n is TRL's `num_generations`."""

    num_generations_kept: int | None = dataclasses.field(
        default=None, metadata={"help": "m: completions per prompt trained on, of the num_generations (n) generated "
                                        "(None: n, plain GRPO)."})
    downsampling_rule: str = dataclasses.field(
        default="max_variance", metadata={"help": f"which m to keep, one of {pods.RULES} (paper: max_variance)."})
    advantage_normalization: str = dataclasses.field(
        default="selected", metadata={"help": "advantage statistics over the kept m ('selected', paper §3.2) or "
                                              "all n ('group', the appendix ablation)."})

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations_kept is None:
            self.num_generations_kept = self.num_generations
        problem = unsupported_setting(self)
        if problem:
            raise ValueError(problem)


def unsupported_setting(args: PODSConfig) -> str | None:
    """The one line refusing `args`, or None when PODS trains it faithfully."""
    n, m, rule = args.num_generations, args.num_generations_kept, args.downsampling_rule
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= n:
        return f"num_generations_kept = {m!r} must be an int in [1, num_generations = {n}]"
    if rule not in pods.RULES or (rule == "none" and m != n):
        return (f"downsampling_rule = {rule!r}: expected one of {pods.RULES} ('none' keeps every completion, "
                f"so it needs num_generations_kept == num_generations)")
    if args.advantage_normalization not in pods.NORMALIZE_MODES:
        return f"advantage_normalization = {args.advantage_normalization!r}: expected one of {pods.NORMALIZE_MODES}"
    if args.scale_rewards not in pods.SCALE_MODES:
        return f"scale_rewards = {args.scale_rewards!r}: PODS supports {pods.SCALE_MODES}"
    if args.multi_objective_aggregation != "sum_then_normalize":
        return (f"multi_objective_aggregation = {args.multi_objective_aggregation!r} is not supported by PODS, "
                "which selects on one reward per completion: use 'sum_then_normalize'")
    local_rows = args.generation_batch_size // args.world_size
    if local_rows % n:
        return (f"a prompt's {n} generations would span processes: the per-process generation batch "
                f"(per_device_train_batch_size x steps_per_generation = {local_rows}) must be a multiple of "
                f"num_generations = {n}")
    kept_rows = local_rows // n * m
    if kept_rows % args.steps_per_generation:
        return (f"the kept rows per process ({local_rows // n} prompts x {m} = {kept_rows}) do not split into "
                f"steps_per_generation = {args.steps_per_generation} equal micro-batches: change "
                "per_device_train_batch_size, num_generations_kept or gradient_accumulation_steps")
    return None


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One reward per completion [B] from TRL's [B, F] per-function rewards: TRL's weighted sum (a function's None
    counts 0). A completion every function returned None for is refused: PODS cannot rank it."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if bool(unscorable.any()):
        raise ValueError(f"{int(unscorable.sum())} completion(s) got None from every reward function; PODS needs a "
                         "reward for every completion to choose among them (return 0 instead of None)")
    return (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)


def kept_rows(rewards: torch.Tensor, m: int, rule: str, *, normalize: str = "selected", scale_rewards: str = "group",
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [P, m] ascending, their advantages [P, m]) of the completions each prompt keeps, rewards [P, n];
    pods.select computes both, the sort only keeps the kept rows in generation order."""
    kept, advantages, _ = pods.select(rewards, m, rule, normalize=normalize, scale_rewards=scale_rewards,
                                      generator=generator)
    order = kept.argsort(dim=-1)
    return kept.gather(-1, order), advantages.gather(-1, order)


def cut_batch(batch: dict, rows: torch.Tensor, advantages: torch.Tensor, trim_padding: bool = True) -> dict:
    """TRL's batch dict with only `rows` (local positions, ascending) and their `advantages`; padding columns that no
    kept row uses are dropped when `trim_padding`. The normaliser is left for the caller to recount."""
    unknown = set(batch) - set(PER_ROW_KEYS) - {NORMALISER_KEY}
    if unknown:
        raise RuntimeError(f"TRL's batch holds {sorted(unknown)}, which PODS does not know how to cut; "
                           f"use TRL {TESTED_TRL_VERSION}.x without that feature")
    kept = {key: (value[rows.to(value.device)] if value is not None else None)
            for key, value in batch.items() if key in PER_ROW_KEYS}
    kept["advantages"] = advantages.to(batch["advantages"].device, batch["advantages"].dtype)
    if trim_padding:
        prompt_used = kept["prompt_mask"].bool().any(dim=0)  # prompts are left padded
        first = int(prompt_used.nonzero()[0]) if bool(prompt_used.any()) else prompt_used.numel() - 1
        completion_used = kept["completion_mask"].bool().any(dim=0)  # completions are right padded
        width = int(completion_used.nonzero()[-1]) + 1 if bool(completion_used.any()) else 1
        full_width = kept["completion_ids"].shape[1]
        for key in PROMPT_WIDTH_KEYS:
            kept[key] = kept[key][:, first:]
        for key in COMPLETION_WIDTH_KEYS:  # sequence-level importance ratios are [B, 1]: left as they are
            if kept.get(key) is not None and kept[key].dim() == 2 and kept[key].shape[1] == full_width:
                kept[key] = kept[key][:, :width]
    return kept


@dataclasses.dataclass
class Selection:
    """The last training generation's choice, global over processes: rewards [P, n], kept positions [P, m]
    (ascending) and their advantages [P, m]; `local_rows`: this process's kept rows in its own batch."""
    rewards: torch.Tensor
    kept: torch.Tensor
    advantages: torch.Tensor
    local_rows: torch.Tensor


class PODSGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer training on `args.num_generations_kept` of `args.num_generations` completions per prompt
    (module docstring). Takes GRPOTrainer's arguments; `args` must be a PODSConfig."""

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, **kwargs):
        if not isinstance(args, PODSConfig):
            raise ValueError(f"PODSGRPOTrainer needs args=PODSConfig(...) (a GRPOConfig with num_generations_kept "
                             f"and downsampling_rule), got {type(args).__name__}")
        problem = unsupported_setting(args)
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                problem = problem or f"{name} is not supported by PODSGRPOTrainer (multi-turn masks are untested)"
        columns = getattr(train_dataset, "column_names", None) or []
        if {"image", "images"} & set(columns):
            problem = problem or "vision inputs (an 'image'/'images' column) are not supported by PODSGRPOTrainer"
        if problem:
            raise ValueError(problem)
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        from transformers import ProcessorMixin

        if isinstance(self.processing_class, ProcessorMixin):
            raise ValueError("vision models (a processor, not a tokenizer) are not supported by PODSGRPOTrainer")
        self._pods_rewards_per_func = None
        self.last_selection = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL returns them gathered over processes; kept for the selection below (TRL does not return them).
        self._pods_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._pods_rewards_per_func

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return batch  # evaluation scores every completion
        return self._downsample(batch, len(inputs))

    def _downsample(self, batch: dict, local_size: int) -> dict:
        """The PODS step on TRL's scored batch of this process's `local_size` completions (module docstring, 2-3)."""
        args, n = self.args, self.num_generations
        rewards = weighted_rewards(self._pods_rewards_per_func, self.reward_weights).view(-1, n)
        self._pods_rewards_per_func = None
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self._step)  # same on every process
        kept, advantages = kept_rows(rewards.cpu(), args.num_generations_kept, args.downsampling_rule,
                                     normalize=args.advantage_normalization, scale_rewards=self.scale_rewards,
                                     generator=generator)
        global_rows = (kept + torch.arange(rewards.shape[0])[:, None] * n).flatten()
        start = self.accelerator.process_index * local_size
        mine = (global_rows >= start) & (global_rows < start + local_size)
        local_rows = global_rows[mine] - start
        batch = cut_batch(batch, local_rows, advantages.flatten()[mine], trim_padding=self.pad_to_multiple_of is None)
        batch[NORMALISER_KEY] = self.accelerator.gather(batch["completion_mask"].sum()).sum()
        self.last_selection = Selection(rewards.cpu(), kept, advantages, local_rows)
        self._log_selection(rewards.cpu(), kept, advantages)
        return batch

    def _log_selection(self, rewards, kept, advantages):
        """PODS metrics next to TRL's (whose reward metrics cover all n), and the trained advantages in the
        completions table (NaN: not trained)."""
        kept_rewards = rewards.gather(-1, kept)
        metrics = self._metrics["train"]
        metrics["pods/kept_reward_mean"].append(kept_rewards.mean().item())
        metrics["pods/kept_reward_std"].append(kept_rewards.std().item() if kept_rewards.numel() > 1 else 0.0)
        metrics["pods/frac_zero_variance_groups"].append(pods.zero_variance_prompts(rewards).float().mean().item())
        logged = self._logs["advantages"]
        if len(logged) >= rewards.numel():
            trained = torch.full(rewards.shape, float("nan")).scatter(-1, kept, advantages.float())
            for _ in range(rewards.numel()):
                logged.pop()
            logged.extend(trained.flatten().tolist())
