"""Checkpoints of a multi-process run (torchrun + FSDP2, paper settings (e), (f)): sharded, atomic, exact resume.

The same run-folder layout as checkpoint.py, written by every rank at once with torch.distributed.checkpoint
(DCP) instead of save_pretrained:

    <out>/checkpoints/step_XXXXXX/
        dcp/                model + optimizer state, sharded (LoRA: the adapter only)
        rng/rank_XXXXX.pt   each rank's RNG states (each rank draws its own rollouts)
        trainer_state.pt    checkpoint.TrainerState fields + step + world_size
        config.json         the run's config

Every rank writes into one staging folder (checkpoint.staging_folder, named by rank 0); after a barrier rank 0
publishes it (checkpoint.publish: flush, rename, then latest.txt), so a crash at any point leaves the previous
checkpoint and latest.txt intact, and runfolder.newest_checkpoint / checkpoint.find_checkpoints read both kinds.

For evaluation a checkpoint becomes a plain model in one process (`load_merged_model`, `export_hf`):

    python -m multigpu export runs/e/checkpoints/step_000100 runs/e/hf_step_000100   # then eval.py --model
    python -m multigpu eval --checkpoint runs/e                                          # or every checkpoint directly

Simplifications: several nodes need a file system shared by all ranks; an exact resume needs as many
processes as the run that saved (each rank's RNG streams are replayed); the weights themselves reshard to
any number of processes (export reads them in one).
"""

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from run import checkpoint
import models
import multigpu.distributed as distributed

# Checkpoints hold the trainable parameters only (LoRA: the adapter; the frozen rest comes from the base
# model), so loading is non-strict; dcp.load itself fails on a trainable key the checkpoint lacks.
STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _only_trainable(model, model_state):
    # ignore_frozen_params keeps a tied weight (lm_head = embed_tokens) under its second name, which is not
    # in named_parameters: a LoRA checkpoint would store the frozen embedding.
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {k: v for k, v in model_state.items() if k in trainable}


def _trainable_state(model, optimizer):
    """{"model", "optimizer"} state of the trainable parameters, sharded as they are on this rank."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=STATE_OPTIONS)
    return {"model": _only_trainable(model, model_state), "optimizer": optimizer_state}


def save_sharded_checkpoint(run_dir, step, model, optimizer, trainer_state, config, ctx, keep_last=0):
    """Write <run_dir>/checkpoints/step_<step>/ from every rank, atomically; returns its path (all ranks).

    trainer_state: a checkpoint.TrainerState or a picklable dict. Non-finite trainable weights on any rank are
    refused (ValueError on every rank) as in checkpoint.save_checkpoint. Collective: every rank must call it."""
    if not distributed.all_ranks(checkpoint.trainable_weights_finite(model)):
        raise ValueError(f"not saving step {step}: the trainable weights hold NaN or inf")
    if dataclasses.is_dataclass(trainer_state):
        trainer_state = dataclasses.asdict(trainer_state)
    staging = distributed.broadcast_object(checkpoint.staging_folder(run_dir, step) if ctx.is_main else None)
    dcp.save(_trainable_state(model, optimizer), checkpoint_id=staging / "dcp")
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(checkpoint.rng_states(ctx.device), staging / "rng" / f"rank_{ctx.rank:05d}.pt")
    distributed.barrier()
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    if ctx.is_main:
        torch.save(dict(trainer_state, step=step, world_size=ctx.world_size), staging / "trainer_state.pt")
        (staging / checkpoint.CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
        checkpoint.publish(staging, step, keep_last)
    distributed.barrier()  # nobody reads or deletes checkpoints before this one is published
    return final


def load_sharded_checkpoint(path, model, optimizer, ctx):
    """Restore model, optimizer and this rank's RNG in place (collective); returns the trainer state dict."""
    path = Path(path)
    if not checkpoint.is_sharded(path):
        raise ValueError(f"{path} was written by one process (adapter/ or model/), not by torchrun: resume it "
                         "with python train.py, or start a new multi-process run from its weights")
    state = checkpoint.load_state_file(path / "trainer_state.pt")
    if state["world_size"] != ctx.world_size:
        raise ValueError(f"checkpoint {path} was written by {state['world_size']} processes, this run has "
                         f"{ctx.world_size}: resume with --nproc-per-node {state['world_size']}, or export it "
                         "(python -m multigpu export) and start a new run from the exported weights")
    state_dicts = _trainable_state(model, optimizer)
    dcp.load(state_dicts, checkpoint_id=path / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state_dicts["model"],
                   optim_state_dict=state_dicts["optimizer"], options=STATE_OPTIONS)
    rng = checkpoint.load_state_file(path / "rng" / f"rank_{ctx.rank:05d}.pt")
    checkpoint.restore_rng_states(rng)
    return state


def _config_and_base(checkpoint_dir, base_model_name):
    if not (checkpoint_dir / "dcp" / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a sharded checkpoint (no dcp/.metadata)")
    config_path = checkpoint_dir / checkpoint.CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not (base_model_name or config.get("model")):
        raise ValueError(f"{config_path} names no base model: pass one (--base-model)")
    return config, str(base_model_name or config["model"])


def load_merged_model(checkpoint_dir, base_model_name=None, *, dtype=torch.float32, device="cpu"):
    """The checkpoint's weights as a plain Hugging Face model in this one process (LoRA merged), e.g. for
    eval.py. base_model_name (anything models.load_policy takes; default: config.json's "model") gives the
    architecture and the frozen weights; LoRA settings come from config.json. DCP reshards whatever number
    of ranks wrote the checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    config, base_model_name = _config_and_base(checkpoint_dir, base_model_name)
    lora = dict(lora_rank=config.get("lora_rank") or 0, lora_alpha=config.get("lora_alpha"))
    if config.get("lora_target_modules"):
        lora["lora_target_modules"] = tuple(config["lora_target_modules"].split(","))
    model = models.load_policy(base_model_name, dtype=torch.float32, device="cpu", **lora)
    model_state = _only_trainable(model, get_model_state_dict(model, options=STATE_OPTIONS))
    with warnings.catch_warnings():  # "no process group, loading in a single process": intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model_state}, checkpoint_id=checkpoint_dir / "dcp")
    set_model_state_dict(model, model_state, options=STATE_OPTIONS)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(device=device, dtype=dtype)


def export_hf(checkpoint_dir, out_dir, base_model_name=None):
    """`load_merged_model` saved as a plain Hugging Face folder (save_pretrained, float32, plus the base's
    tokenizer) for eval.py --model or any other tool; returns out_dir."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    _, base_model_name = _config_and_base(checkpoint_dir, base_model_name)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"export folder {out_dir} is not empty")
    load_merged_model(checkpoint_dir, base_model_name).save_pretrained(out_dir)
    try:
        models.load_tokenizer(base_model_name).save_pretrained(out_dir)
    except (OSError, ValueError, TypeError) as error:  # a bare weights folder: no tokenizer to copy
        print(f"export: no tokenizer copied from {base_model_name} ({type(error).__name__}: {error})")
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m multigpu export", description="Export a sharded checkpoint "
                                     "(written under torchrun) to a plain Hugging Face model folder.")
    parser.add_argument("checkpoint", help="a checkpoint folder <run>/checkpoints/step_XXXXXX with dcp/")
    parser.add_argument("out_dir", help="a new (or empty) folder for the model")
    parser.add_argument("--base-model", help="override the base model named in the checkpoint's config.json")
    args = parser.parse_args(argv)
    print(f"exported to {export_hf(args.checkpoint, args.out_dir, args.base_model)}")

