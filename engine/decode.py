"""The decode loop of the engine (package docstring: the design): the model families it runs, per-model Engine
records, row and cache-length buckets, and `generate`, which prefills, decodes step by step and drops finished rows.
"""

import dataclasses
import functools
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

import engine.gpu_paths as gpu_paths
import engine.graphs as graphs
import engine.ops as ops
import engine.prefix as prefix
import engine.step as decode_step
import policy
import stopwatch

# The step's operations (engine/ops.py): None = fused kernels on CUDA, plain PyTorch elsewhere; "reference" = the
# plain step with separate projections (bench decode's baseline); "fused" = the fused ops on any device.
KERNELS = os.environ.get("PODS_DECODE_KERNELS") or None
EAGER_WINDOW = True         # eager decoding reads only the columns written so far (benchmarks switch it off)
CACHE_BUCKET_TOKENS = 256   # cache lengths are multiples of this: a few graphs cover every prompt width
CHECK_EVERY = 16            # decode steps between host checks for finished rows
EOS_SLOTS = 8               # EOS ids padded to this many (-1 = none): the step's shapes never change
DEFAULT_COMPILE_BACKEND = False   # False: eager (graphs on CUDA); "inductor" compiles once per bucket (~1 min)
NEVER = 2 ** 62


@dataclass
class DecodeStats:
    """Process totals in STATS (copy with dataclasses.replace before a call, subtract after)."""
    prefill_s: float = 0.0
    prefill_tokens: int = 0     # token positions the prefill ran (a shared prefix counts once per call)
    decode_s: float = 0.0       # host checks and compaction included
    decode_steps: int = 0
    row_steps: int = 0          # the bucket's rows summed over step launches (the work done)
    warmup_s: float = 0.0       # compilation + CUDA-graph recording
    compiled_graphs: int = 0    # graphs handed to the compile backend
    captured_graphs: int = 0    # CUDA graphs recorded


STATS = DecodeStats()


@dataclass(frozen=True)
class Layer:
    """One decoder layer. As a family finds it, qkv and gate_up are the modules giving q|k|v and gate|up; as the
    engine calls it (`build_layer`), qkv: x -> (q, k, v), gate_up: x -> (gate, up). q_norm, k_norm: None if none."""
    input_norm: object
    qkv: object
    o: object
    post_norm: object
    gate_up: object
    down: object
    act: object
    q_norm: object = None
    k_norm: object = None


def separate_projections(layer):
    """Separate q, k, v and gate, up projections (the merged copy stacks them)."""
    attention, mlp = layer.self_attn, layer.mlp
    return Layer(layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj), attention.o_proj,
                 layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), mlp.down_proj, mlp.act_fn)


def normed_heads(layer):
    """Separate projections (`separate_projections`), q and k RMS-normed per head (q_norm, k_norm) before rotary."""
    attention = layer.self_attn
    return dataclasses.replace(separate_projections(layer), q_norm=attention.q_norm, k_norm=attention.k_norm)


def fused_projections(layer):
    """q|k|v and gate|up already one projection each (rotary may cover part of a head)."""
    attention, mlp = layer.self_attn, layer.mlp
    return Layer(layer.input_layernorm, (attention.qkv_proj,), attention.o_proj, layer.post_attention_layernorm,
                 (mlp.gate_up_proj,), mlp.down_proj, mlp.activation_fn)


# The families the engine decodes (paper §4: Qwen2.5, Llama-3), model_type -> where its layer keeps its modules: any
# pre-norm RMSNorm, rotary, grouped-query, gated-MLP layout. Other model types generate through Hugging Face.
FAMILIES = {"llama": separate_projections, "qwen2": separate_projections, "mistral": separate_projections,
            "phi3": fused_projections, "qwen3": normed_heads}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass
class Engine:
    """One model's decode-time callables, cached per model and process, with its weight copies, its step and
    kernels, and each bucket's buffers (cache_len -> (rows, tensors)) and states (key -> (State, graph or None))."""
    embed: object
    layers: list
    norm: object
    lm_head: object
    rotary: object
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    scaling: float
    signature: tuple
    copies: list
    step: object
    capture: bool             # record / replay CUDA graphs
    layouts: list | None      # on a CPU: (weight, slot of its decode_step.cpu_layout) of every copy and the LM head
    kernels: object = decode_step.PLAIN
    buffers: dict = field(default_factory=dict)
    states: dict = field(default_factory=dict)
    graph_pool: object = None  # one CUDA memory pool for every graph's temporaries (see record_graph)


@dataclass
class State:
    """One bucket of rows: views of buffers shared by every bucket of a cache length."""
    keys: list                # [rows, kv_heads, cache_len, head_dim] per layer
    values: list
    start: torch.Tensor       # [rows] first column of the row's own prompt (after the shared prefix and the pads)
    tokens: torch.Tensor      # [rows] the next step's input token; positions: its position id
    positions: torch.Tensor
    done: torch.Tensor        # [rows] bool: emitted EOS (emits pad from then on)
    stop_at: torch.Tensor     # [rows] step at which EOS is forced (benchmarks), NEVER otherwise
    row_keys: torch.Tensor    # [rows] 32-bit noise key
    out: torch.Tensor         # [rows, cache_len] generated tokens, column = step
    logprobs: torch.Tensor    # [rows, cache_len] float32 sampler log-prob of each generated token (0 once done)
    draws: torch.Tensor       # [rows, cache_len] float32 the row's uniform draw of each step
    scalars: dict             # slot, step [1] (views of counters [2]), shared [1]; temperature, top_p, pad; eos
    sample: bool              # temperature > 0 (else greedy)
    nucleus: bool             # top_p < 1
    attend_len: int = 0       # eager decoding: the cache columns written so far (0: all, a graph's fixed shape)
    shared_len: int = 0       # eager decoding: the shared prefix's columns, read once for all rows (0: per row)


ROW_FIELDS = ("start", "tokens", "positions", "done", "stop_at", "row_keys", "out", "logprobs", "draws")


_ENGINES = weakref.WeakKeyDictionary()


def unsupported_reason(model, cache_len=0):
    """None if the engine can decode this model, else why not (sampling.py then uses HF generate)."""
    hf = policy.hf_model(model)
    config, inner = hf.config, getattr(hf, "model", None)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "peft prompt learning adds virtual tokens"
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "unexpected module layout (no model.embed_tokens / layers / norm / rotary_emb)"
    try:
        FAMILIES[config.model_type](inner.layers[0])
    except AttributeError as error:
        return f"unexpected layer layout for {config.model_type!r} ({error})"
    if getattr(inner.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return "RoPE frequencies that change with the sequence length"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and window < cache_len:
        return f"sliding-window attention ({window}) shorter than the cache ({cache_len})"
    return None


def engine_for(model, generation_copy=None, compile_backend=None, refresh_weights=True, capture=None):
    """The cached Engine of `model`, rebuilt when its signature changed; refresh_weights: recompute the merged
    copies. generation_copy None: a copy unless 4-bit. compile_backend None: DEFAULT_COMPILE_BACKEND, else False or
    a dynamo backend. capture None: CUDA graphs where `records_graphs`; False: never."""
    hf = policy.hf_model(model)
    quantized = getattr(hf.config, "quantization_config", None) is not None
    copy = not quantized if generation_copy is None else bool(generation_copy)
    backend = DEFAULT_COMPILE_BACKEND if compile_backend is None else compile_backend
    if capture is None:
        capture = records_graphs(model, copy, quantized)
    device = hf.model.embed_tokens.weight.device
    key = (copy, backend if isinstance(backend, (str, bool)) else id(backend), bool(capture), KERNELS)
    engine, signature = _ENGINES.setdefault(model, {}).get(key), decode_step.model_signature(model)
    fresh = engine is None or engine.signature != signature
    if fresh:
        kernels = decode_step.PLAIN if KERNELS is None and device.type not in gpu_paths.DEVICE_TYPES else \
            ops.kernels_for(device, KERNELS)
        config, copies = hf.config, []
        # oneDNN layouts for the plain step of a CPU only, not the kernels a benchmark asks for
        layouts = [] if kernels is decode_step.PLAIN and KERNELS is None and device.type == "cpu" else None
        attention = hf.model.layers[0].self_attn
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attention.head_dim
        layers = [build_layer(FAMILIES[config.model_type](layer), copy, copies, kernels.stacked,
                              (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), config.intermediate_size,
                              layouts) for layer in hf.model.layers]
        engine = _ENGINES[model][key] = Engine(
            hf.model.embed_tokens, layers, hf.model.norm, decode_step.head(hf.lm_head, layouts), hf.model.rotary_emb,
            heads, kv_heads, head_dim, config.intermediate_size, attention.scaling, signature, copies,
            graphs.compiled(decode_step.decode_step, backend, STATS) if backend else decode_step.decode_step,
            bool(capture), layouts, kernels)
    if refresh_weights or fresh:
        decode_step.refresh_copies(engine.copies)
        decode_step.lay_out(engine.layouts or [])
    return engine


def build_layer(modules, copy, copies, stacked, qkv_sizes, intermediate_size, layouts=None):
    """The Layer the engine calls over a family's Layer of one decoder layer's modules."""
    return dataclasses.replace(
        modules, qkv=decode_step.projections(modules.qkv, qkv_sizes, copy, copies, stacked, layouts),
        o=decode_step.projection(modules.o, copy, copies, layouts),
        gate_up=decode_step.projections(modules.gate_up, (intermediate_size, intermediate_size), copy, copies,
                                        stacked, layouts),
        down=decode_step.projection(modules.down, copy, copies, layouts))


def records_graphs(model, copy, quantized):
    """Whether CUDA graphs are recorded by default: on CUDA, unless bitsandbytes kernels or FSDP run in the step."""
    hf = policy.hf_model(model)
    on_cuda = hf.model.embed_tokens.weight.device.type == "cuda"
    return on_cuda and (copy or not quantized) and not graphs.fsdp_sharded(model)


def release(model=None):
    """Free the cached buffers, weight copies and graphs of `model` (of every model if None)."""
    _ENGINES.clear() if model is None else _ENGINES.pop(model, None)


def row_buckets(max_rows):
    """Batch sizes a chunk of at most max_rows rows runs at: powers of two below max_rows, and max_rows."""
    return sorted({2 ** i for i in range(max_rows.bit_length()) if 2 ** i < max_rows} | {max_rows})


def bucket_for(rows, max_rows):
    return next(size for size in row_buckets(max_rows) if size >= rows)


def next_size(alive, size, max_rows, exact):
    """The rows the loop runs once `alive` of its `size` are left: their bucket, or, eager (`exact`), the live rows
    once an eighth finished (gathering the cache costs about one step)."""
    if exact and alive <= size * 7 // 8:
        return alive
    return min(size, bucket_for(alive, max_rows))


def state_for(engine, rows, cache_len, max_rows, sample, nucleus):
    """The State of a bucket. With CUDA graphs, the first use of a (cache length, sampling mode) records every row
    bucket's graph, so none is recorded mid-run; recording runs the step on the buffers, so callers fill it after."""
    dec, (allocated, buffers) = engine, engine.buffers.get(cache_len, (0, None))
    if allocated < max_rows:  # (re)allocate; zeros keep never-written cache entries finite under the mask
        engine.states = {key: value for key, value in engine.states.items() if key[1] != cache_len}
        zeros = functools.partial(torch.zeros, device=dec.embed.weight.device)
        kv = [zeros(max_rows, dec.num_kv_heads, cache_len, dec.head_dim, dtype=dec.embed.weight.dtype)
              for _ in range(2 * len(dec.layers))]
        counters = zeros(2, dtype=torch.long)   # the slot and step counters: one kernel advances both
        buffers = dict(keys=kv[::2], values=kv[1::2], done=zeros(max_rows, dtype=torch.bool),
                       out=zeros(max_rows, cache_len, dtype=torch.long), logprobs=zeros(max_rows, cache_len),
                       draws=zeros(max_rows, cache_len),
                       **{name: zeros(max_rows, dtype=torch.long) for name in ("start", "tokens", "positions",
                                                                               "stop_at", "row_keys")},
                       scalars=dict(counters=counters, slot=counters[0:1], step=counters[1:2],
                                    shared=zeros(1, dtype=torch.long), pad=zeros((), dtype=torch.long),
                                    eos=zeros(EOS_SLOTS, dtype=torch.long), temperature=zeros(()), top_p=zeros(())))
        engine.buffers[cache_len] = (max_rows, buffers)
    new = {}
    for size in row_buckets(max_rows) if engine.capture and (rows, cache_len, sample, nucleus) not in engine.states \
            else [rows]:
        if (size, cache_len, sample, nucleus) not in engine.states:
            views = {name: value if name == "scalars" else [t[:size] for t in value] if isinstance(value, list)
                     else value[:size] for name, value in buffers.items()}
            new[size, cache_len, sample, nucleus] = State(**views, sample=sample, nucleus=nucleus)
    check_kernels(engine, new.values())
    for key, state in new.items():
        engine.states[key] = (state, graphs.record_graph(engine, state, STATS) if engine.capture else None)
    return engine.states[rows, cache_len, sample, nucleus]


def check_kernels(engine, states):
    """Each new bucket's fused ops checked against their references (ops.check); a failing op runs its reference
    from then on, and the graphs recorded with it are dropped."""
    start = time.perf_counter()
    for state in states if engine.kernels.fused else []:
        failed = ops.check(engine, state)
        if failed:
            engine.kernels = ops.with_fused(engine.kernels.fused - set(failed))
            engine.states = {key: value for key, value in engine.states.items() if value[1] is None}
    STATS.warmup_s += time.perf_counter() - start


def compacted(engine, state, alive, row_ids, size, cache_len, max_rows, flags):
    """The live rows `alive` of `state` gathered into a bucket of `size` rows (extra rows: copies marked done):
    (its State, its graph, the chunk row of each of its rows, -1 for the extra ones)."""
    index = torch.cat([alive, alive[:1].expand(size - len(alive))])
    fields = lambda s: [getattr(s, name) for name in ROW_FIELDS] + s.keys + s.values  # noqa: E731
    kept = [tensor[index] for tensor in fields(state)]
    row_ids = row_ids[index].masked_fill(torch.arange(size, device=alive.device) >= len(alive), -1)
    state, graph = state_for(engine, size, cache_len, max_rows, *flags)
    for target, value in zip(fields(state), kept):
        target.copy_(value)
    state.done[len(alive):] = True
    return state, graph, row_ids


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, row_prompt, max_new_tokens, eos_ids, pad_id, *, temperature=1.0,
             top_p=1.0, seed=0, max_rows=None, forced_lengths=None, check_every=CHECK_EVERY, generation_copy=None,
             compile_backend=None, refresh_weights=True, cache_tokens=0, capture=None, return_logprobs=False,
             prefix_sharing=True):
    """Completions [R, max_new_tokens] (pad after the first EOS) of R rows; row r continues prompt row_prompt[r] of
    the left-padded prompt_ids / prompt_mask [D, W]. return_logprobs: also the sampler's log-probs [R, max_new_tokens].

    temperature 0 = greedy; row r's tokens depend on (seed, r, its prompt) only. max_rows: the process's largest
    chunk (its row buckets). cache_tokens: a floor on the cache length, so a run's calls share one set of graphs.
    forced_lengths [R] (benchmarks): row r emits eos_ids[0] as token number forced_lengths[r]. eos_ids=[]: no row
    ends. generation_copy, compile_backend, refresh_weights, capture: see engine_for. prefix_sharing: the prompts'
    common prefix is prefilled once for all (prefix.shared_prefix_layout). Pass the prompts on the host (their layout
    is decided there); the caller sets the model's mode (eval())."""
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu()
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left padded (the last column real for every prompt)")
    shared = 0
    if prefix_sharing:
        prompt_ids, prompt_mask, shared = prefix.shared_prefix_layout(prompt_ids, prompt_mask)
    own = prompt_mask[:, shared:]
    if bool((own[:, 1:] < own[:, :-1]).any()):
        raise ValueError("prompts must be left padded (no padding after a prompt's first token)")
    rows, width = len(row_prompt), prompt_ids.shape[1]
    needed = max(width - 1 + max_new_tokens, cache_tokens)
    cache_len = -(-needed // CACHE_BUCKET_TOKENS) * CACHE_BUCKET_TOKENS
    if (reason := unsupported_reason(model, cache_len)) is not None:
        raise ValueError(f"the decode engine cannot run this model: {reason}")
    if len(eos_ids) > EOS_SLOTS or (forced_lengths is not None and not eos_ids):
        raise ValueError(f"need 1..{EOS_SLOTS} EOS ids with forced_lengths, at most {EOS_SLOTS} otherwise")
    engine = engine_for(model, generation_copy, compile_backend, refresh_weights, capture)
    device = engine.embed.weight.device
    prompt_ids, prompt_mask = (tensor.to(device, non_blocking=True) for tensor in (prompt_ids, prompt_mask))
    max_rows = max(max_rows or rows, rows)
    with stopwatch.timed(STATS, "prefill_s", device):
        prompt_keys, prompt_values = decode_step.prefill(engine, prompt_ids, prompt_mask, shared)
    STATS.prefill_tokens += shared + len(prompt_ids) * (width - 1 - shared)
    with stopwatch.timed(STATS, "decode_s", device):  # host checks and compaction included
        # Eager decoding has no shapes to reuse: a chunk runs its own rows, not a padded bucket's.
        exact = not engine.capture and engine.step is decode_step.decode_step
        size, flags = rows if exact else bucket_for(rows, max_rows), (temperature > 0, top_p < 1)
        state, graph = state_for(engine, size, cache_len, max_rows, *flags)
        row_prompt = row_prompt.to(device)
        for cache, prompt in zip(state.keys + state.values, prompt_keys + prompt_values):
            cache[:rows, :, :width - 1] = prompt[row_prompt]
        real = torch.arange(size, device=device) < rows   # rows past `rows` only pad the bucket
        # A row's own columns start after the prefix and its pads; extra rows read only their own.
        state.start.fill_(width - 1)[:rows] = shared + (prompt_mask[row_prompt, shared:width - 1] == 0).sum(1)
        state.tokens.fill_(pad_id)[:rows] = prompt_ids[row_prompt, -1]
        state.positions.zero_()[:rows] = prompt_mask[row_prompt].sum(1) - 1
        state.done.copy_(~real)
        state.stop_at.fill_(NEVER)
        if forced_lengths is not None:
            state.stop_at[:rows] = torch.as_tensor(forced_lengths).to(device) - 1
        state.row_keys.copy_(decode_step.row_noise_keys(seed, size))
        state.draws.copy_(decode_step.uniform_draws(state.row_keys[:, None], torch.arange(cache_len, device=device)))
        for name, value in dict(slot=width - 1, step=0, shared=shared, temperature=max(temperature, 1e-6),
                                top_p=top_p, pad=pad_id).items():
            state.scalars[name].fill_(value)
        state.scalars["eos"].copy_(torch.tensor(list(eos_ids) + [-1] * (EOS_SLOTS - len(eos_ids))))
        # One spare row past the chunk's: where the bucket's padding rows write (`record`).
        result = torch.full((rows + 1, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(rows + 1, max_new_tokens, device=device)
        row_ids = torch.arange(size, device=device).masked_fill(~real, -1)   # chunk row of each bucket row
        windowed = graph is None and compile_backend is None and EAGER_WINDOW   # eager: no fixed shape to keep
        for step in range(max_new_tokens):
            if graph is not None:
                graph.replay()
            else:   # attention reads the columns written so far: a CPU step is bound by reading the cache
                state.attend_len, state.shared_len = (width + step, shared) if windowed else (0, 0)
                engine.step(engine, state)
            STATS.decode_steps, STATS.row_steps = STATS.decode_steps + 1, STATS.row_steps + size
            if (step + 1) % check_every and step + 1 < max_new_tokens:
                continue
            alive = (~state.done).nonzero().flatten()   # the loop's only host synchronisation
            if len(alive) == 0 or step + 1 == max_new_tokens:
                break
            smaller = next_size(len(alive), size, max_rows, exact)
            if smaller < size:   # drop finished rows
                record(result, logprobs, state, row_ids, step + 1)
                size = smaller
                state, graph, row_ids = compacted(engine, state, alive, row_ids, size, cache_len, max_rows, flags)
        record(result, logprobs, state, row_ids, step + 1)
    return (result[:rows], logprobs[:rows]) if return_logprobs else result[:rows]


def record(result, logprobs, state, row_ids, columns):
    """The bucket's first `columns` tokens and log-probs into the chunk's rows `row_ids` (-1: the spare last row)."""
    rows = torch.where(row_ids >= 0, row_ids, len(result) - 1)
    result[rows, :columns] = state.out[:, :columns]
    logprobs[rows, :columns] = state.logprobs[:, :columns]
