"""The model families the decode engine runs, and where each keeps a decoder layer's modules.

Paper §4 trains Qwen2.5 and Llama-3 models. A registry: a family whose layer is pre-norm RMSNorm, rotary attention
(grouped query heads) and a gated MLP is one entry here; any other model type generates through Hugging Face
`generate` (sampling.py says so in one line).

- Llama, Qwen2, Mistral: separate q, k, v and gate, up projections (the engine's merged copy joins them).
- Phi-3: q|k|v and gate|up already fused into one projection each (its rotary may cover part of a head).
Simplification: every family listed normalises with HF's LlamaRMSNorm formula (the fused norm computes it; its run-time
check compares it with the model's module).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer's modules, in the order the engine runs them. qkv and gate_up: the projections whose
    outputs, concatenated, are q|k|v and gate|up (three and two modules, or one already fused)."""
    input_norm: object
    qkv: tuple
    o: object
    post_norm: object
    gate_up: tuple
    down: object
    act: object


def separate_projections(layer):
    attention, mlp = layer.self_attn, layer.mlp
    return LayerModules(layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj),
                        attention.o_proj, layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj),
                        mlp.down_proj, mlp.act_fn)


def fused_projections(layer):
    attention, mlp = layer.self_attn, layer.mlp
    return LayerModules(layer.input_layernorm, (attention.qkv_proj,), attention.o_proj,
                        layer.post_attention_layernorm, (mlp.gate_up_proj,), mlp.down_proj, mlp.activation_fn)


# model_type (transformers config) -> the layer's modules. Add a family here when its layer has this shape.
FAMILIES = {"llama": separate_projections, "qwen2": separate_projections, "mistral": separate_projections,
            "phi3": fused_projections}


def layer_modules(model_type, layer):
    """The LayerModules of `layer` for `model_type` (a key of FAMILIES); AttributeError if the layout differs."""
    return FAMILIES[model_type](layer)
