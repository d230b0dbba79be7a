"""Several processes, one update: torchrun + FSDP2 + torch.distributed.checkpoint (paper settings (e), (f)).

    torchrun --nproc-per-node 8 -m multigpu --preset e [--baseline] [train.py flags]   # train
    python -m multigpu export RUN/checkpoints/step_000100 OUT                         # -> a Hugging Face folder
    python -m multigpu eval --checkpoint RUN [eval.py flags]                          # eval.py, sharded checkpoints

The paper trains Qwen2.5-3B (e) and -7B (f) with all parameters on 8 GPUs (the authors: DeepSpeed ZeRO-2). We use
PyTorch's own stack: torchrun starts one process per GPU, FSDP2 (`fully_shard`) shards parameters, gradients and
optimizer state, torch.distributed.checkpoint writes sharded checkpoints. Nothing here is loaded by a plain
`python train.py`: the multi-process run is train.py's own loop with its seams (train.OneProcess) filled in by
run.py. Each rank generates rollouts for its own share of the step's prompts and down-samples per prompt, with no
communication; the loss is normalised by the kept rows of *all* ranks and FSDP *sums* gradients across ranks, so
the step equals the single-process step on the same global batch.

Memory per GPU (W ranks, P parameters; fp32 masters + AdamW, bf16 compute): 16 P / W bytes of shards
(param 4, grad 4, Adam 8); generation (`full_weights_for_generation`) gathers all layers once per step: + 2 P
bytes, plus the KV cache (2 x layers x kv_heads x head_dim x 2 bytes per token, x rows x cache length) in eager
decode (no CUDA graphs over FSDP's re-allocated weights: engine/); the update holds one gathered layer, the
gathered root unit (embeddings, lm_head) with its fp32 gradient, and, with gradient checkpointing, each layer's
input (rows x tokens x hidden x 2 bytes x layers) plus a micro-batch's logits (bf16, their gradient, one row in
fp32). Presets (e)/(f) on 8 GPUs, rollout batch 64 rows x 2048 tokens, micro-batch 4:
    (e) 3.09 B: shards 5.8 GiB, gathered 5.8, KV cache 4.5 (36 KiB/token)  -> generation ~16 GiB;
        update: shards 5.8 + root 1.7 + checkpoints 1.1 + logits ~3.5 + layer ~0.5   -> ~13 GiB
    (f) 7.62 B: shards 14.2 GiB, gathered 14.2, KV cache 7.0 (56 KiB/token) -> generation ~36 GiB;
        update: shards 14.2 + root 6.1 (untied lm_head) + checkpoints 1.5 + logits ~3.5 + layer ~1.3 -> ~27 GiB
Both fit on 80 GB (estimates, not measured; allocator fragmentation and the CUDA context add a few GiB), so
--rollout-batch-size 128 also fits ((f): +7 GiB). One GPU ((e), W = 1): 46 + 5.8 + 4.5 GiB, ~57 GiB.

Failures: a rank's exception ends every rank (`distributed.run_main`, collectives bounded by --dist-timeout-s), and
torchrun names the failing rank; with `torchrun --max-restarts N` the ranks start again (each attempt gets fresh
rendezvous keys) and resume from the last complete checkpoint.

Files: run.py (the seams, the checks, the training entry), distributed.py (process group, FSDP2, collectives),
sharded_checkpoint.py (DCP checkpoints, export), __main__.py (the command line).
Simplifications: one node tested; each rank loads the whole model on CPU before sharding (no meta-device init);
LoRA runs shard the frozen base too (same path); 4-bit weights cannot be sharded.
"""
