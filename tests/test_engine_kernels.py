"""engine/ops.py, engine/triton_kernels.py, the families of engine/decode.py, the stacked copies of engine/step.py: the
fused decode step (custom ops; a CPU runs each op's reference behind it) gives the plain step's tokens and log-probs; one
step of it runs 9 operations a layer and builds no mask (counted by bench census); a fused op that disagrees with its
reference (a planted fault in each) or raises is replaced by it with one warning line, before anything runs it, so
the tokens stay the reference's; q|k|v and gate|up come from one merged copy each; Mistral, Phi-3 (fused
projections, partial rotary) and Qwen3 (q and k normed per head) decode as generate() does; every Triton kernel
compiles to sm_90 machine code, and the Triton kernels themselves, under its interpreter on CPU tensors (a fresh
process, ~10 s), equal their references (at shapes where a dropped RMSNorm eps or rotary read at another row's
position shows), pass the run-time check and, with the engine taking the GPU paths (engine/gpu_paths.py), decode
generate()'s tokens through the split attention."""

import collections
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import engine
import engine.decode
import engine.graphs
import engine.ops as ops
import models
import policy
from test_engine import EOS, VOCAB, eos_model, left_padded_prompts, lora_model, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")
R = ops.TENSOR_REFERENCE


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    """No op disabled by an earlier test; engines rebuilt (the kernel set is chosen when an engine is built)."""
    monkeypatch.setattr(ops, "DISABLED", {})
    engine.release()
    yield
    engine.release()


def decode(model, kernels, monkeypatch, temperature, **kwargs):
    """engine.generate with engine.decode.KERNELS = kernels (tokens, sampler log-probs): 3 prompts x 2 rows."""
    monkeypatch.setattr(engine.decode, "KERNELS", kernels)
    ids, mask = left_padded_prompts([4, 7, 2])
    return engine.generate(model, ids, mask, torch.arange(3).repeat_interleave(2), 12, [EOS], EOS,
                           temperature=temperature, seed=5, return_logprobs=True, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fused_step_gives_the_plain_steps_tokens_and_logprobs(arch, monkeypatch):
    model = lora_model(arch=arch)
    for temperature in (0.0, 1.0):
        plain, fused = (decode(model, kernels, monkeypatch, temperature) for kernels in ("reference", "fused"))
        assert torch.equal(plain[0], fused[0])
        torch.testing.assert_close(plain[1], fused[1], rtol=0, atol=1e-5)
    assert engine.decode.engine_for(model).kernels.fused == frozenset(ops.OPS)


def census_of_a_step(kernels, monkeypatch):
    """bench census's records of one decode step (64 rows, a 1024-column cache, LoRA merged) of a 1-layer and a
    2-layer model: {op: count} of the step and of one layer (their difference)."""
    from bench import census, common

    monkeypatch.setattr(engine.decode, "KERNELS", kernels)
    args = census.trainer_args("a", [])
    args.census_model = "qwen2.5-3b"
    real = common.real_config("qwen2.5-3b")
    mapping = census.width_map(real, census.Narrow(), 64, 200, 512, 16, 64, 1024)
    counts = []
    for layers in (1, 2):
        records = census.decode_run(args, layers, census.Narrow(), mapping, 64)
        counts.append(collections.Counter())
        for phase, op, dtype, nbytes, flops, count in records["ops"]:
            counts[-1][op] += count
    return counts[0], counts[1] - counts[0]


def test_one_fused_step_runs_nine_operations_a_layer_and_builds_no_mask(monkeypatch):
    """Per layer: the stacked q|k|v GEMM (Qwen2's bias: addmm), o, gate|up and down GEMMs, the residual add fused
    with each norm, rotary with the cache write, the attention over the written columns, SiLU x up. No mask is built
    (no where / repeat / comparison anywhere in the step); the sampler is one op. The plain step on a CPU stacks the
    projections too (4 GEMMs) but runs each norm, rotary and the masked attention in several kernels."""
    step, layer = census_of_a_step("fused", monkeypatch)
    assert layer == {"addmm": 1, "mm": 3, "add_rms_norm": 2, "rotary_cache_write": 1, "decode_attention": 1,
                     "silu_mul": 1}
    assert step["finish_step"] == 1 and not {"where", "repeat", "ge", "le", "lt", "index_fill_"} & set(step)
    assert sum(step.values()) - sum(layer.values()) <= 16   # embedding, rotary angles, final norm, LM head, counters
    plain_step, plain_layer = census_of_a_step("reference", monkeypatch)
    assert plain_layer["addmm"] + plain_layer["mm"] == 7 and sum(plain_layer.values()) > 30 and "masked_fill" in plain_layer


def test_q_k_v_and_gate_up_come_from_one_merged_copy_each(monkeypatch):
    """4 copies a layer (q|k|v with its stacked bias, o, gate|up, down) instead of 7, each the base weights plus the
    adapters' deltas stacked in order; the reference kernels keep one copy per projection."""
    model = lora_model(arch="qwen2")
    runtime = engine.decode.engine_for(model)
    layer = policy.hf_model(model).model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    sources = [source.modules for source, _ in runtime.copies[:4]]
    assert sources == [(attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
                       (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
    assert len(runtime.copies) == 4 * len(runtime.layers)
    (source, qkv), (_, gate_up) = runtime.copies[0], runtime.copies[2]
    merged = [module.get_base_layer().weight + module.get_delta_weight("default") for module in source.modules]
    assert torch.equal(qkv, torch.cat(merged))
    assert torch.equal(source.bias, torch.cat([module.get_base_layer().bias for module in source.modules]))
    assert gate_up.shape == (2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features)
    monkeypatch.setattr(engine.decode, "KERNELS", "reference")
    assert len(engine.decode.engine_for(model).copies) == 7 * len(runtime.layers)


FAULTS = {   # one planted fault per fused op, behind the op (what a wrong Triton kernel would do)
    "add_rms_norm": lambda x, residual, weight, eps: R["add_rms_norm"](x, residual, torch.ones_like(weight), eps),
    "rotary_cache_write": lambda q, k, v, cos, sin, *rest: R["rotary_cache_write"](q, k, v, cos, -sin, *rest),
    "decode_attention": lambda q, keys, values, start, shared, slot, scaling: R["decode_attention"](
        q, keys, values, start, shared, slot - 1, scaling),   # misses the column just written
    "act_mul": lambda gate, up: torch.sigmoid(gate) * up,
    "finish_step": lambda logits, temperature, *rest: R["finish_step"](logits, 1.3 * temperature, *rest),
}


@pytest.mark.parametrize("op", sorted(FAULTS))
def test_a_faulty_fused_op_is_replaced_by_its_reference_with_one_warning(op, monkeypatch):
    model = eos_model("qwen2", seed=1)
    plain = decode(model, "reference", monkeypatch, 1.0)
    implementation = ops.implementation
    monkeypatch.setattr(ops, "implementation", lambda name, device: FAULTS[op] if name == op else
                        implementation(name, device))
    with pytest.warns(UserWarning) as caught:
        first = decode(model, "fused", monkeypatch, 1.0)
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 1 and f"the fused {op} " in messages[0] and "\n" not in messages[0]
    assert messages[0].endswith("it runs as plain PyTorch from now on") and set(ops.DISABLED) == {op}
    assert engine.decode.engine_for(model).kernels.fused == frozenset(ops.OPS) - {op}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once
        second = decode(model, "fused", monkeypatch, 1.0)
    for got in (first, second):
        assert torch.equal(got[0], plain[0])
        torch.testing.assert_close(got[1], plain[1], rtol=0, atol=1e-5)


def test_a_fused_op_that_raises_is_replaced_with_one_line(monkeypatch):
    def no_kernel(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nCUDA kernel errors "
                           "might be asynchronously reported")

    model = eos_model("llama")
    implementation = ops.implementation
    monkeypatch.setattr(ops, "implementation", lambda name, device: no_kernel if name == "decode_attention" else
                        implementation(name, device))
    with pytest.warns(UserWarning, match=r"^decode engine: the fused decode_attention raised RuntimeError: CUDA error: "
                      r"no kernel image is available for execution on the device; it runs as plain PyTorch"):
        fused = decode(model, "fused", monkeypatch, 0.0)
    assert torch.equal(fused[0], decode(model, "reference", monkeypatch, 0.0)[0])


def test_graphs_recorded_with_an_op_that_fails_later_are_recorded_again(monkeypatch):
    """The check runs per bucket, before its graph is recorded: an op failing at a new cache length drops the
    graphs recorded with it (here: a stand-in graph replaying the step), and every later call uses the reference."""
    recorded = []

    class ReplayStep:
        def __init__(self, runtime, state):
            self.runtime, self.state, self.kernels = runtime, state, runtime.kernels

        def replay(self):
            assert self.runtime.kernels is self.kernels, "a graph replays the ops it was recorded with"
            self.runtime.step(self.runtime, self.state)

    def fake_record(runtime, state, stats):
        recorded.append((len(state.tokens), state.keys[0].shape[2]))
        return ReplayStep(runtime, state)

    model = eos_model("llama", seed=1)
    monkeypatch.setattr(engine.decode, "KERNELS", "fused")
    monkeypatch.setattr(engine.graphs, "record_graph", fake_record)
    engine.decode.engine_for(model).capture = True
    ids, mask = left_padded_prompts([4, 7])
    first = engine.generate(model, ids, mask, torch.arange(2), 6, [EOS], EOS, temperature=0.0, max_rows=2)
    assert sorted(recorded) == [(1, 256), (2, 256)]
    implementation = ops.implementation
    monkeypatch.setattr(ops, "implementation", lambda name, device: FAULTS["act_mul"] if name == "act_mul" else
                        implementation(name, device))
    with pytest.warns(UserWarning, match="the fused act_mul"):
        engine.generate(model, ids, mask, torch.arange(2), 6, [EOS], EOS, temperature=0.0, max_rows=2,
                        cache_tokens=300)   # a new cache length: checked there, fails
    again = engine.generate(model, ids, mask, torch.arange(2), 6, [EOS], EOS, temperature=0.0, max_rows=2)
    assert sorted(recorded) == [(1, 256), (1, 256), (1, 512), (2, 256), (2, 256), (2, 512)]
    assert torch.equal(first, again)


def phi3_model(**overrides):
    from transformers import AutoModelForCausalLM, Phi3Config

    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                    eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(4)
    return AutoModelForCausalLM.from_config(Phi3Config(**dict(settings, **overrides)), dtype=torch.float32).eval()


# Llama and Qwen2 decode generate()'s tokens in tests/test_engine.py; every other family here
FAMILY_CASES = ["mistral", "phi3", "phi3 partial rotary", "phi3 + LoRA", "qwen3", "qwen3 + LoRA"]


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("kernels", [None, "fused"])
def test_every_family_decodes_generates_tokens(family, kernels, monkeypatch):
    """Mistral's layout is Llama's; Phi-3 keeps q|k|v and gate|up fused in one projection each and may rotate part
    of a head; Qwen3 RMS-norms q and k per head before rotary (random norm weights here, so q's and k's norms
    differ): greedy tokens equal HF generate's, with and without a LoRA adapter on every projection."""
    from peft import LoraConfig, get_peft_model
    from test_engine import run

    if family == "mistral":
        from transformers import AutoModelForCausalLM, MistralConfig

        torch.manual_seed(4)
        model = AutoModelForCausalLM.from_config(MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS,
            tie_word_embeddings=False), dtype=torch.float32).eval()
    elif family.startswith("qwen3"):
        model = eos_model("qwen3")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.uniform_(0.2, 2.0, generator=generator)
    else:
        model = phi3_model(**({"partial_rotary_factor": 0.5} if "partial" in family else {}))
    if "LoRA" in family:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=models.lora_targets(model)))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
        model.eval()
    assert engine.unsupported_reason(model) is None
    monkeypatch.setattr(engine.decode, "KERNELS", kernels)
    ids, mask = left_padded_prompts([4, 7, 2, 5])
    fast = run(model, ids, mask, 2, 12, temperature=0.0)
    reference = run(model, ids, mask, 2, 12, temperature=0.0, backend="hf")
    assert all(torch.equal(a, b) for a, b in zip(fast, reference))
    if "LoRA" in family:   # q|k|v (64 + 2 x 32 rows) and o, merged
        assert [tuple(weight.shape) for _, weight in engine.decode.engine_for(model).copies[:2]] == [(128, 64),
                                                                                                     (64, 64)]


def test_every_family_the_engine_runs_is_tested_against_generate():
    """A family added to FAMILIES without its case in FAMILY_CASES (or test_engine.py's) fails here."""
    from engine.decode import FAMILIES

    assert engine.decode.SUPPORTED_MODEL_TYPES == tuple(FAMILIES)
    assert set(FAMILIES) <= {"llama", "qwen2", *(case.split()[0] for case in FAMILY_CASES)}


def test_prompts_padded_inside_are_refused():
    """A row reads its own columns from one start on: a pad after a prompt's first token cannot be expressed (prefix
    sharing re-lays such prompts out; without it they are refused)."""
    model = eos_model("llama")
    ids, mask = left_padded_prompts([4, 6])
    mask[1, 2] = 0   # a pad between two real tokens
    with pytest.raises(ValueError, match="left padded"):
        engine.generate(model, ids, mask, torch.arange(2), 4, [EOS], EOS, prefix_sharing=False)


def test_an_adapter_that_is_not_additive_runs_unmerged():
    """DoRA rescales the merged weight: it is not merged into the engine's copy; the module itself runs (as in
    training), and the engine decodes generate()'s greedy tokens."""
    from peft import LoraConfig, get_peft_model

    base = eos_model("llama")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    model.eval()
    ids, mask = left_padded_prompts([4, 7])
    fast = run(model, ids, mask, 1, 8, temperature=0.0)
    assert all(torch.equal(a, b) for a, b in zip(fast, run(model, ids, mask, 1, 8, temperature=0.0, backend="hf")))
    assert not engine.decode.engine_for(model).copies   # nothing merged: q and v run their adapters unmerged


def test_what_the_engine_cannot_decode_is_said_in_one_line_and_refused():
    """A sliding window shorter than the cache, RoPE frequencies that change with the length, a prompt-learning
    adapter: each a reason (sampling.py then uses HF generate); engine.generate refuses such a model."""
    from peft import PromptTuningConfig, get_peft_model

    window = models.tiny_random_model("mistral", vocab_size=VOCAB, sliding_window=16)
    assert "sliding-window attention (16)" in engine.unsupported_reason(window, 256)
    assert engine.unsupported_reason(window, 8) is None
    dynamic = models.tiny_random_model("llama", vocab_size=VOCAB, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "RoPE frequencies" in engine.unsupported_reason(dynamic)
    prompted = get_peft_model(models.tiny_random_model("llama", vocab_size=VOCAB),
                              PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "prompt learning" in engine.unsupported_reason(prompted)
    ids, mask = left_padded_prompts([4, 6])
    with pytest.raises(ValueError, match="cannot run this model: RoPE"):
        engine.generate(dynamic, ids, mask, torch.arange(2), 4, [EOS], EOS)


def test_the_ops_refuse_what_they_cannot_run_and_the_checks_name_a_shape(monkeypatch):
    """The kernel set's name is checked; a CPU with no set forced takes the plain step; a fused op giving a wrong
    shape is named; the top-p nucleus runs the reference sampler (a sort); the Triton launchers refuse a
    non-contiguous last dimension before launching anything; a shared prefix longer than the prompts is refused."""
    import engine.step as step
    import engine.triton_kernels as triton_kernels

    with pytest.raises(ValueError, match="PODS_DECODE_KERNELS"):
        ops.kernels_for(torch.device("cpu"), "triton")
    assert not ops.kernels_for(torch.device("cpu")).fused and ops.kernels_for(torch.device("cpu")).stacked
    assert "of shape (2,), not (3,)" in ops.differs("x", torch.zeros(2), torch.zeros(3), torch.float32)
    model = eos_model("llama")
    monkeypatch.setattr(engine.decode, "KERNELS", "fused")
    dec = engine.decode.engine_for(model)
    state = engine.decode.state_for(dec, 2, 256, 2, True, True)[0]
    assert ops.check_finish_step(dec, state, torch.Generator().manual_seed(0)) is None   # top-p: the reference's
    ids, mask = left_padded_prompts([4, 7, 2])
    nucleus = engine.generate(model, ids, mask, torch.arange(3), 6, [EOS], EOS, temperature=1.0, top_p=0.9, seed=1)
    monkeypatch.setattr(engine.decode, "KERNELS", "reference")
    engine.release()
    assert torch.equal(nucleus, engine.generate(model, ids, mask, torch.arange(3), 6, [EOS], EOS, temperature=1.0,
                                                top_p=0.9, seed=1))
    wide = torch.zeros(2, 1, 32).transpose(0, 2)   # last dimension not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        triton_kernels.rotary_cache_write(wide, wide, wide, wide, wide, wide, wide, torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous"):
        triton_kernels.decode_attention(torch.zeros(2, 4, 1, 8).transpose(-1, -2), *[torch.zeros(2, 2, 8, 8)] * 2,
                                        torch.zeros(2), torch.zeros(1), torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match="contiguous over the vocabulary"):
        triton_kernels.finish_step(torch.zeros(16, 2).t(), *[None] * 11, sample=False)
    with pytest.raises(ValueError, match="a shared prefix of 9 tokens"):
        step.prefill(dec, ids, mask, shared=9)


# ------------------------------------------------------------------------- the Triton kernels (interpreter)

@pytest.fixture(scope="module")
def interpreted():
    """engine_triton_worker.py's results {check: "ok" or why not}: triton's interpreter must be on before triton is
    first imported (torch may have imported it here), so the Triton kernels run in a fresh process; skipped without
    triton."""
    pytest.importorskip("triton")
    worker = Path(__file__).resolve().parent / "engine_triton_worker.py"
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["each kernel equals its reference (float32)", "each kernel equals its reference "
                                   "(bfloat16)", "the sampler equals the reference (greedy)",
                                   "the sampler equals the reference (sampled)",
                                   "the engine on Triton kernels decodes generate()'s tokens",
                                   "a fault inside a Triton kernel is caught"])
def test_the_triton_kernels_under_the_interpreter(interpreted, check):
    assert interpreted[check] == "ok", interpreted[check]


TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                torch.int32: "i32", torch.bool: "i1"}


def launches(kernels, call):
    """[(kernel, its arguments by name, constexprs)] that call() launches, recorded instead of run."""
    recorded = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constexprs = {name: value for name, value in kwargs.items() if name not in ("num_warps", "num_stages")}
                recorded.append((self.kernel, dict(zip(self.kernel.arg_names, args)), constexprs))
            return launch

    with pytest.MonkeyPatch.context() as patch:   # undone before compiling: kernels call the helpers by name
        for name in [name for name in vars(kernels) if name.startswith("_") and hasattr(getattr(kernels, name),
                                                                                         "run")]:
            patch.setattr(kernels, name, Recorder(getattr(kernels, name)))
        call()
    return recorded


def test_every_triton_kernel_compiles_for_an_h100_at_setting_a_shapes():
    """The launchers' calls at Qwen2.5-3B's shapes (64 rows, a 1024-column cache, 151 936-token vocabulary, bf16),
    compiled by triton to sm_90 machine code here, without a GPU: what the GPU will compile, minus running it."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import engine.triton_kernels as kernels

    if ops.interpreting():
        pytest.skip("TRITON_INTERPRET=1 decorates the kernels for the interpreter")
    rows, heads, kv_heads, head_dim, length, hidden, inner, vocab = 64, 16, 2, 128, 1024, 2048, 11008, 151936
    bf16 = dict(dtype=torch.bfloat16)
    q, k, v = torch.zeros(rows, 1, (heads + 2 * kv_heads) * head_dim, **bf16).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    cache = torch.zeros(rows, kv_heads, length, head_dim, **bf16)
    gate, up = torch.zeros(rows, 1, 2 * inner, **bf16).split([inner, inner], -1)
    counters = torch.zeros(rows, dtype=torch.long)
    index = torch.zeros(1, dtype=torch.long)

    def every_launch():
        residual = torch.zeros(rows, 1, hidden, **bf16)
        for x in (None, residual.clone()):
            kernels.add_rms_norm(x, residual, torch.ones(hidden, **bf16), 1e-6)
        cos = torch.zeros(rows, 1, head_dim, **bf16)
        kernels.rotary_cache_write(q, k, v, cos, cos, cache, cache, index)
        for splits in (1, 4):
            kernels.decode_attention(torch.zeros(rows, heads, 1, head_dim, **bf16), cache, cache, counters, index,
                                     index, 0.088, splits=splits)
        kernels.act_mul(gate, up)
        for sample in (False, True):
            kernels.finish_step(torch.zeros(rows, 1, vocab, **bf16)[:, -1], torch.tensor(0.9),
                                torch.zeros(rows, length), index, counters, torch.zeros(8, dtype=torch.long),
                                torch.tensor(0), torch.zeros(rows, dtype=torch.bool),
                                torch.zeros(rows, length, dtype=torch.long), torch.zeros(rows, length), counters,
                                counters, sample)

    recorded = launches(kernels, every_launch)
    assert len(recorded) == 2 + 1 + 2 + 1 + 1 + 2   # the attention's second pass when split
    for kernel, args, constexprs in recorded:
        signature = {name: f"*{TRITON_TYPES[value.dtype]}" if isinstance(value, torch.Tensor) else
                     "fp32" if isinstance(value, float) else "i32" for name, value in args.items()}
        signature.update({name: "constexpr" for name in constexprs})
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024, kernel


def test_bench_decode_kernels_part_runs_on_cpu(tmp_path, capsys):
    """`python -m bench decode --parts kernels` (the GPU check's new part) at toy sizes: the plain and the fused step
    at two batches with their bound, bandwidth and greedy check, PODS's generation with each, the float32 agreement
    of the two on the device, the verdict lines; kernel counts come from the CUDA profiler (n/a here)."""
    import bench.__main__ as cli

    result = cli.main(["decode", "--device", "cpu", "--prompt-tokens", "4", "--batch", "4", "--new-tokens", "6",
                       "--bandwidth-gbs", "10", "--repeats", "1", "--parts", "kernels", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert result["rows"] == [] and result["lengths"] == [] and "## Decode step's kernels (fp32)" in out
    assert [(row["kernels"], row["batch"]) for row in result["kernels"]] == [("reference", 2), ("reference", 4),
                                                                             ("fused", 2), ("fused", 4)]
    for row in result["kernels"]:
        assert row["fused_ops"] == ("none" if row["kernels"] == "reference" else ",".join(sorted(ops.OPS)))
        assert row["kernels_per_step"] is None and row["bound_ms"] > 0
        assert (row["tokens_equal_hf_frac"] is None) == (row["batch"] == 2)
        if row["step_ms"] is not None:
            assert row["bandwidth_gbs"] == pytest.approx(10 * row["bound_ms"] / row["step_ms"])
    assert [row["kernels"] for row in result["generation"]] == ["reference", "fused"]
    [exact] = result["exactness"]
    assert exact["greedy_tokens_equal"] and exact["sampled_tokens_equal"] and exact["logprob_max_diff"] < 1e-4
    assert "targets (fused)" in out and "PODS generation" in out and result["fused_ops_disabled"] == {}
    with pytest.raises(ValueError, match="--parts"):
        cli.main(["decode", "--device", "cpu", "--parts", "speed"])
    with pytest.raises(ValueError, match="--kernels"):
        cli.main(["decode", "--device", "cpu", "--kernels", "triton"])


def test_the_decode_census_in_benchmarks_is_recomputed_from_the_committed_records(capsys):
    """Each row of BENCHMARKS.md's census table is what `python -m bench show` prints from the records it names:
    kernels per layer and per step, and per operation class."""
    import bench.__main__ as cli

    root = Path(__file__).resolve().parents[1]
    files = [root / "results/census/census_before.json", root / "results/census/census_after.json",
             *sorted((root / "results/decode-census").glob("*.json"))]
    assert len(files) == 3
    cli.main(["show", *map(str, files)])
    printed = {}
    for name, block in re.findall(r"^# \S*/(\S+\.json)\n(.*?)(?=^# \S+\.json\n|\Z)", capsys.readouterr().out,
                                  re.M | re.S):
        classes = block.split("## decode_classes")[1].split("\n\n")[0]
        figures = {row.split(" | ")[0].strip("| "): row.split(" | ")[1] for row in classes.splitlines()
                   if row.startswith("| ") and "---" not in row and "operation class" not in row}
        for key in ("decode_kernels_per_layer", "decode_kernels_per_step"):
            figures[key] = block.split(f"\n{key}: ")[1].split()[0]
        printed[name] = figures
    section = (root / "BENCHMARKS.md").read_text().split("## The decode step's kernels (census)")[1].split("\n## ")[0]
    header, *rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert [name for name in printed if not any(name in row for row in rows)] == []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        figures = printed[next(name for name in printed if name in cells[0])]
        want = [figures["decode_kernels_per_layer"], figures["decode_kernels_per_step"],
                *(figures.get(column, "0") for column in columns[3:])]
        assert cells[1:] == want, cells[0]
