"""Hugging Face's model families in our terms: each family's ``config.json`` and tensor names, both ways.

Seven families map onto the one ``GPT`` (``llmscratch.model.gpt``):
- gpt2: LayerNorm, GELU (or squared ReLU), learned positions, biases;
- llama: RMSNorm, SwiGLU, RoPE, grouped-query attention;
- arcee: Llama with a plain up/down MLP, squared ReLU (or GELU) between: the shape the course trains;
- qwen3: Llama with QK-norm (and a head size of its own, no biases);
- gemma3_text: Qwen3's attention with a GeGLU MLP, norms after each sublayer too, scaled embeddings,
  sliding-window layers between the global ones (each kind with its own RoPE base), and norm gains
  stored as (gain - 1); also the language model of the multimodal Gemma 3 (model_type gemma3);
- qwen3_moe: Qwen3 with a mixture of experts for its MLPs;
- mixtral: Llama with a mixture of experts (and an optional sliding window in every layer).
``weights.load_hf`` and ``weights.save_hf`` read and write the files.
"""

from collections.abc import Callable

import torch

from llmscratch.model.checks import ConfigFields
from llmscratch.model.config import GPTConfig

__all__ = ["FAMILIES", "config_from_hf", "config_to_hf", "family_of", "hf_to_ours", "language_model_tensors",
           "ours_to_hf", "size_fields"]

FAMILIES = ("gpt2", "llama", "arcee", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "arcee": "ArceeForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

# HF GPT-2 uses Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
_GPT2_LAYER = {  # ours -> HF, inside block i / h.i; "T" marks a transposed Conv1D weight
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight T", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight T", "attn.out_proj.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight T", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight T", "mlp.proj.bias": "mlp.c_proj.bias",
}
# An expert's three matrices: ours (stacked over experts) -> each family's name for one expert's
_EXPERT_NAMES = {"qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                 "mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
# Our plain MLPs' activations under transformers' names (its ACT2FN): GPT-2's own, and Arcee's
_GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu2": "relu2"}
_PLAIN_ACTIVATIONS = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu"}
# Buffers some GPT-2 checkpoints carry (the causal mask): derived, never needed.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict, source: str = "config.json") -> GPTConfig:
    """Our GPTConfig for a Hugging Face ``config.json`` of one of the ``FAMILIES`` (read from ``source``).

    Every field goes through one checked reader (``llmscratch.model.checks.ConfigFields``): a value of the wrong
    kind or out of range is a ValueError naming ``source`` and the field. The sizes are checked against the
    weights' shapes by ``weights.load_hf``, before the model is built.
    """
    fields = _fields(hf, source)
    if fields.family == "gpt2":
        return _make(_gpt2_config(fields), fields)
    return _make(_decoder_config(fields, fields.family), fields)


def _fields(hf: dict, source: str) -> ConfigFields:
    """The reader of ``hf``'s language model: the config itself, or a multimodal Gemma 3's ``text_config``."""
    family = hf.get("model_type")
    prefix = ""
    if family == "gemma3":  # the multimodal Gemma 3 (4B and larger): its language model is a gemma3_text
        if not isinstance(hf.get("text_config"), dict):
            raise ValueError(f"{source}: a model_type 'gemma3' config needs its 'text_config' (the language model's)")
        hf, family, prefix = hf["text_config"], "gemma3_text", "text_config."
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type {family!r} is not supported; expected one of {list(FAMILIES)}")
    return ConfigFields(hf, source, family, prefix)


def size_fields(hf: dict) -> dict[str, int]:
    """The integer fields of a ``config.json`` that set tensor shapes, under their names in the file (a multimodal
    Gemma 3's as ``text_config.vocab_size``, ...): what a message about a shape names."""
    fields = _fields(hf, "config.json")
    return {fields.prefix + name: fields.hf[name] for name in _SIZE_FIELDS
            if isinstance(fields.hf.get(name), int) and not isinstance(fields.hf[name], bool)}


_SIZE_FIELDS = ("vocab_size", "n_positions", "max_position_embeddings", "n_embd", "hidden_size", "n_layer",
                "num_hidden_layers", "n_head", "num_attention_heads", "num_key_value_heads", "head_dim", "n_inner",
                "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts")


def _make(settings: dict, fields: ConfigFields) -> GPTConfig:
    """The GPTConfig of ``settings``; what it refuses (a combination the reader does not check) names the file."""
    try:
        return GPTConfig(**settings)
    except ValueError as err:
        raise ValueError(f"{fields.source}: these values make no model: {err}") from None


def _gpt2_config(hf: ConfigFields) -> dict:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.flag(flag, False):
            raise ValueError(f"{hf.source}: GPT-2 option {flag}=true is not supported")
    if not hf.flag("scale_attn_weights", True):
        raise ValueError(f"{hf.source}: GPT-2 option scale_attn_weights=false is not supported: our attention "
                         "always divides the scores by sqrt(head_dim)")
    activation = hf.text("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise ValueError(f"{hf.source}: GPT-2 activation {activation!r} is not supported; "
                         "expected the tanh GELU ('gelu_new') or squared ReLU ('relu2')")
    width, heads = hf.size("n_embd"), hf.count("n_head")
    if width % heads:
        raise hf.problem("n_embd", f"a multiple of n_head={heads}")
    return dict(vocab_size=hf.size("vocab_size"), context_length=hf.size("n_positions"), d_model=width,
                n_layers=hf.count("n_layer"), n_heads=heads, d_ff=hf.size("n_inner", None),
                mlp=_GPT2_ACTIVATIONS[activation],
                norm_eps=hf.number("layer_norm_epsilon", 1e-5), tie_embeddings=hf.flag("tie_word_embeddings", True))


def _rope(params: ConfigFields, default_theta: float) -> tuple[float, float]:
    """(base, linear scaling factor) of one RoPE parameter object; plain and linear RoPE only."""
    kind = params.text("rope_type", params.text("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"{params.source}: RoPE scaling of type {kind!r} ({params.prefix.rstrip('.')}) is not "
                         "supported; only plain RoPE and linear scaling")
    return params.number("rope_theta", default_theta), params.number("factor", 1.0) if kind == "linear" else 1.0


def _decoder_config(hf: ConfigFields, family: str) -> dict:
    """Llama and the families built on it."""
    width, heads, n_layers = hf.size("hidden_size"), hf.count("num_attention_heads"), hf.count("num_hidden_layers")
    kv_heads = hf.count("num_key_value_heads", heads)
    if heads % kv_heads:
        raise hf.problem("num_key_value_heads", f"a divisor of num_attention_heads={heads}")
    head_dim = hf.size("head_dim", 256 if family == "gemma3_text" else None)
    if head_dim is None and width % heads:
        raise hf.problem("hidden_size", f"a multiple of num_attention_heads={heads} (or give head_dim)")
    head_dim = head_dim or width // heads
    if head_dim % 2:
        raise hf.problem("head_dim" if hf.has("head_dim") else "hidden_size",
                         "such that each head's width is even (RoPE turns pairs)", head_dim)
    activation = hf.text("hidden_activation" if family == "gemma3_text" else "hidden_act")
    expected = {"gemma3_text": ("gelu_pytorch_tanh",), "arcee": tuple(_PLAIN_ACTIVATIONS)}.get(family, ("silu",))
    if activation not in (None, *expected):
        raise ValueError(f"{hf.source}: {family} activation {activation!r} is not supported; "
                         f"expected {' or '.join(map(repr, expected))}")
    bias = hf.flag("attention_bias", False)
    if family in ("llama", "arcee") and hf.flag("mlp_bias", False) != bias:
        raise ValueError(f"{hf.source}: attention_bias and mlp_bias must be equal (both biases or none)")
    if family not in ("llama", "arcee") and bias:
        raise ValueError(f"{hf.source}: attention_bias=true is not supported for {family}: its MLP has no biases, "
                         "ours would")
    fields = dict(
        vocab_size=hf.size("vocab_size"), context_length=hf.size("max_position_embeddings"), d_model=width,
        n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, d_ff=hf.size("intermediate_size"), norm="rmsnorm",
        mlp=_PLAIN_ACTIVATIONS[activation or "relu2"] if family == "arcee" else "swiglu", position="rope",
        qkv_bias=bias, bias=bias, norm_eps=hf.number("rms_norm_eps", 1e-6),
        tie_embeddings=hf.flag("tie_word_embeddings", family == "gemma3_text"),
        head_size=None if head_dim * heads == width else head_dim,
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"),
    )
    rope = hf.within("rope_parameters" if hf.has("rope_parameters") else "rope_scaling")
    types = _layer_types(hf, n_layers)  # checked in every family; used by those with sliding layers
    if family == "gemma3_text":
        fields.update(_gemma3_fields(hf, rope, n_layers, head_dim, types))
    else:
        fields["rope_theta"], fields["rope_scaling"] = _rope(rope, hf.number("rope_theta", 10_000.0))
        fields.update(_sliding_fields(hf, family, n_layers, types))
    if family in ("qwen3_moe", "mixtral"):
        fields.update(_moe_fields(hf, family, n_layers))
    return fields


def _layer_types(hf: ConfigFields, n_layers: int) -> tuple[str, ...] | None:
    types = hf.choices("layer_types", n_layers, ("sliding_attention", "full_attention"))
    return None if types is None else tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def _sliding_fields(hf: ConfigFields, family: str, n_layers: int, types: tuple[str, ...] | None) -> dict:
    window = hf.size("sliding_window", None)
    if family in ("llama", "arcee") or window is None or (family in ("qwen3", "qwen3_moe")
                                               and not hf.flag("use_sliding_window", False)):
        return {}
    if family == "qwen3":  # the layers from max_window_layers on slide, unless layer_types says otherwise
        first = hf.count("max_window_layers", 28, low=0)
        types = types or tuple("sliding" if i >= first else "full" for i in range(n_layers))
        return {"sliding_window": window, "layer_types": types} if "sliding" in types else {}
    return {"sliding_window": window}  # Mixtral, Qwen3-MoE: every layer


def _gemma3_fields(hf: ConfigFields, rope: ConfigFields, n_layers: int, head_dim: int,
                   types: tuple[str, ...] | None) -> dict:
    for option in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.has(option):
            raise ValueError(f"{hf.source}: Gemma option {option}={hf.hf[option]} is not supported (Gemma 2's "
                             "soft-capping)")
    if hf.flag("use_bidirectional_attention", False):
        raise ValueError(f"{hf.source}: Gemma option use_bidirectional_attention=true is not supported: a GPT is "
                         "causal")
    if rope.has("full_attention") or rope.has("sliding_attention"):  # transformers 5: one object per kind of layer
        theta, scaling = _rope(rope.within("full_attention"), 1_000_000.0)
        local_theta, local_scaling = _rope(rope.within("sliding_attention"), 10_000.0)
        if local_scaling != 1:
            raise ValueError(f"{hf.source}: RoPE scaling of Gemma's sliding layers is not supported (only of its "
                             "full layers)")
    else:  # the hub's files: rope_theta, rope_local_base_freq and rope_scaling for the full layers
        theta, scaling = _rope(rope, hf.number("rope_theta", 1_000_000.0))
        local_theta = hf.number("rope_local_base_freq", 10_000.0)
    pattern = hf.count("sliding_window_pattern", 6)
    types = types or tuple("sliding" if (i + 1) % pattern else "full" for i in range(n_layers))
    scalar = hf.number("query_pre_attn_scalar", 256.0)
    return dict(mlp="geglu", post_norms=True, scale_embeddings=True, rope_theta=theta, rope_scaling=scaling,
                rope_local_theta=local_theta, layer_types=types, sliding_window=hf.size("sliding_window", 4096),
                query_scale=None if scalar == head_dim else scalar, head_size=head_dim)


def _moe_fields(hf: ConfigFields, family: str, n_layers: int) -> dict:
    if hf.number("router_jitter_noise", 0.0, zero=True):
        raise ValueError(f"{hf.source}: Mixtral option router_jitter_noise is not supported (noise on the router "
                         "in training)")
    # transformers 5 writes num_local_experts for both families; the hub's Qwen3-MoE files, num_experts
    n_experts = hf.count("num_experts" if family == "qwen3_moe" and hf.has("num_experts") else "num_local_experts",
                         low=2)
    k = hf.count("num_experts_per_tok")
    if k > n_experts:
        raise hf.problem("num_experts_per_tok", f"at most the {n_experts} experts")
    # transformers' balancing loss is k times ours (it counts each of a token's k slots as a token)
    aux = hf.number("router_aux_loss_coef", 0.001, zero=True) * k
    if family == "mixtral":
        return dict(n_experts=n_experts, experts_per_token=k, norm_topk=True, router_aux_weight=aux)
    step = hf.count("decoder_sparse_step", 1)
    dense = sorted(set(hf.indices("mlp_only_layers", n_layers)) | {i for i in range(n_layers) if (i + 1) % step})
    return dict(n_experts=n_experts, experts_per_token=k, d_expert=hf.size("moe_intermediate_size"),
                norm_topk=hf.flag("norm_topk_prob", False), dense_layers=tuple(dense), router_aux_weight=aux)


def family_of(config: GPTConfig) -> str:
    """The Hugging Face family (one of ``FAMILIES``) that can hold this configuration; ValueError naming what no
    family has if none can."""
    if (config.norm, config.position) == ("layernorm", "learned"):
        family = "gpt2"
    elif (config.norm, config.position) != ("rmsnorm", "rope"):
        raise ValueError(f"this configuration has norm={config.norm} with position={config.position}, which no "
                         f"Hugging Face family has (GPT-2: layernorm and learned; the others: rmsnorm and rope); "
                         f"its safetensors export still holds it")
    elif config.n_experts is not None:
        family = "qwen3_moe" if config.qk_norm else "mixtral"
    elif config.post_norms or config.scale_embeddings or config.mlp == "geglu":
        family = "gemma3_text"
    elif config.mlp in ("relu2", "gelu"):
        family = "arcee"
    else:
        family = "qwen3" if config.qk_norm else "llama"
    problems = _family_problems(config, family)
    if problems:
        raise ValueError(f"this configuration looks like {family} but {'; '.join(problems)}, which no Hugging Face "
                         f"{family} model has (its safetensors export still holds it)")
    return family


def _later_fields(config: GPTConfig) -> list[str]:
    """The choices beyond GPT-2 and Llama that this config makes."""
    made = {"sliding layers": "sliding" in config.attention_types, "post_norms": config.post_norms,
            "scale_embeddings": config.scale_embeddings, "query_scale": config.query_scale is not None,
            "rope_local_theta": config.rope_local_theta is not None, "rope_scaling": config.rope_scaling != 1,
            "n_experts": config.n_experts is not None, "qk_norm": config.qk_norm, "mlp=geglu": config.mlp == "geglu"}
    return [name for name, on in made.items() if on]


# What each family has, of _later_fields' choices
_FAMILY_CHOICES = {
    "gpt2": set(),
    "llama": {"rope_scaling"},
    "arcee": {"rope_scaling"},
    "qwen3": {"qk_norm", "sliding layers", "rope_scaling"},
    "gemma3_text": {"qk_norm", "sliding layers", "post_norms", "scale_embeddings", "query_scale", "rope_local_theta",
                    "rope_scaling", "mlp=geglu"},
    "qwen3_moe": {"qk_norm", "n_experts", "sliding layers", "rope_scaling"},
    "mixtral": {"n_experts", "sliding layers", "rope_scaling"},
}


def _family_problems(config: GPTConfig, family: str) -> list[str]:
    problems = [f"it has {name}" for name in _later_fields(config) if name not in _FAMILY_CHOICES[family]]
    if family == "gpt2":
        return problems + _gpt2_problems(config)
    if config.qkv_bias != config.bias:
        problems.append(f"its qkv_bias={config.qkv_bias} differs from bias={config.bias}")
    if family in ("llama", "arcee", "gemma3_text") and config.d_model % config.n_heads:
        problems.append(f"its d_model={config.d_model} is not a multiple of n_heads={config.n_heads} (heads pruned "
                        f"away?), which transformers' {family} config refuses")
    if family == "gemma3_text":
        problems += [f"it lacks {name}" for name in ("qk_norm", "post_norms", "scale_embeddings", "mlp=geglu")
                     if name not in _later_fields(config)]
        if config.rope_scaling != 1 and config.rope_local_theta is None and "sliding" in config.attention_types:
            problems.append("its sliding layers share the full layers' scaled RoPE (Gemma's have their own base)")
    elif family != "arcee" and config.mlp != "swiglu":
        problems.append(f"its mlp is {config.mlp}")
    if family not in ("llama", "arcee") and config.bias:
        problems.append("it has biases")
    if family in ("qwen3_moe", "mixtral", "llama") and "sliding" in config.attention_types \
            and "full" in config.attention_types:
        problems.append("it mixes sliding and full layers")
    if config.n_experts is not None and config.shared_experts:
        problems.append("it has shared experts")
    if family == "mixtral" and (not config.norm_topk or config.dense_layers):
        problems.append("its routing weights are not renormalised or it has dense layers")
    if family == "qwen3_moe" and config.dense_layers and config.d_ff is None:
        problems.append("its dense layers have no d_ff")
    return problems


def _gpt2_problems(config: GPTConfig) -> list[str]:
    """What a LayerNorm model with learned positions has that GPT-2 does not."""
    problems = [f"its mlp is {config.mlp}"] if config.mlp not in ("gelu", "relu2") else []
    if not (config.qkv_bias and config.bias):
        problems.append("it lacks biases")
    if config.kv_heads != config.n_heads:
        problems.append(f"it has grouped-query attention ({config.kv_heads} key/value heads)")
    if config.head_dim * config.n_heads != config.d_model:
        problems.append(f"its {config.n_heads} heads of {config.head_dim} do not make d_model={config.d_model}")
    return problems


def config_to_hf(config: GPTConfig) -> dict:
    """The ``config.json`` transformers needs to rebuild this model.

    Its special token ids are left out (None): each family's defaults name other vocabularies' tokens (Arcee's
    128000); the tokenizer's files, written beside it, say which are ours.
    """
    family = family_of(config)
    return {**_family_config(config, family), "bos_token_id": None, "eos_token_id": None}


def _family_config(config: GPTConfig, family: str) -> dict:
    if family == "gpt2":
        return {"architectures": [ARCHITECTURES[family]], "model_type": "gpt2",
                "vocab_size": config.vocab_size, "n_positions": config.context_length,
                "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads,
                "n_inner": config.d_ff, "activation_function": "relu2" if config.mlp == "relu2" else "gelu_new",
                "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
                "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout}
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling != 1:
        rope.update(rope_type="linear", factor=config.rope_scaling)
    hf = {"architectures": [ARCHITECTURES[family]], "model_type": family,
          "vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.head_dim, "intermediate_size": config.hidden_dim, "hidden_act": "silu",
          "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "rope_parameters": rope,
          "attention_bias": config.bias, "tie_word_embeddings": config.tie_embeddings,
          "attention_dropout": config.dropout}
    sliding = "sliding" in config.attention_types
    hf_types = ["sliding_attention" if t == "sliding" else "full_attention" for t in config.attention_types]
    if family in ("llama", "arcee"):
        hf["mlp_bias"] = config.bias
    if family == "arcee":
        hf["hidden_act"] = "relu2" if config.mlp == "relu2" else "gelu_pytorch_tanh"
    elif family == "qwen3":
        hf.update(use_sliding_window=sliding, sliding_window=config.sliding_window, layer_types=hf_types,
                  max_window_layers=config.n_layers)
    elif family == "gemma3_text":
        del hf["hidden_act"], hf["rope_theta"]
        scalar = config.head_dim if config.query_scale is None else config.query_scale
        local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        hf.update(hidden_activation="gelu_pytorch_tanh", layer_types=hf_types,
                  sliding_window=config.sliding_window or config.context_length,
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  rope_parameters={"full_attention": rope,
                                   "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                  final_logit_softcapping=None, attn_logit_softcapping=None)
    else:  # the mixtures of experts
        hf.update(num_experts_per_tok=config.experts_per_token, sliding_window=config.sliding_window,
                  router_aux_loss_coef=config.router_aux_weight / config.experts_per_token)
        if family == "mixtral":
            hf.update(num_local_experts=config.n_experts, intermediate_size=config.expert_dim)
        else:
            hf.update(num_experts=config.n_experts, moe_intermediate_size=config.expert_dim,
                      norm_topk_prob=config.norm_topk, decoder_sparse_step=1, mlp_only_layers=list(config.dense_layers),
                      use_sliding_window=sliding)
    return hf


# --------------------------------------------------------------------------- tensors
# A multimodal checkpoint's language model, under the names of the hub's files and of transformers 5
_LANGUAGE_MODEL = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                   "model.language_model.": "model."}
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model_tensors(hf_config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the language model alone, under a text model's names, for a multimodal config (Gemma 3 4B
    and larger: model_type 'gemma3'); the vision tower and its projector are left out. Other configs: as given."""
    if hf_config.get("model_type") != "gemma3":
        return tensors
    text = {}
    for name, tensor in tensors.items():
        if name.startswith(_VISION):
            continue
        prefix = next((p for p in _LANGUAGE_MODEL if name.startswith(p)), None)
        text[name if prefix is None else _LANGUAGE_MODEL[prefix] + name[len(prefix):]] = tensor
    return text


def _decoder_names(config: GPTConfig, family: str) -> list[tuple[str, str]]:
    """(ours, HF) for every tensor of a Llama-like family that maps one to one (qkv and the experts apart)."""
    pairs = [("token_embedding.weight", "model.embed_tokens.weight"), ("final_norm.weight", "model.norm.weight")]
    for i in range(config.n_layers):
        names = {"attn_norm.weight": "input_layernorm.weight", "attn.out_proj.weight": "self_attn.o_proj.weight"}
        if config.qk_norm:
            names.update({"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"})
        if config.post_norms:  # Gemma: attention's post-norm takes the name that is Llama's pre-MLP norm
            names.update({"attn_post_norm.weight": "post_attention_layernorm.weight",
                          "mlp_norm.weight": "pre_feedforward_layernorm.weight",
                          "mlp_post_norm.weight": "post_feedforward_layernorm.weight"})
        else:
            names["mlp_norm.weight"] = "post_attention_layernorm.weight"
        if config.is_moe(i):
            names["mlp.router.weight"] = "block_sparse_moe.gate.weight" if family == "mixtral" else "mlp.gate.weight"
        elif family == "arcee":  # a plain MLP: up, the activation, down
            names.update({"mlp.fc.weight": "mlp.up_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight"})
        else:
            names.update({f"mlp.{ours}.weight": f"mlp.{ours}_proj.weight" for ours in ("gate", "up", "down")})
        if config.bias:
            names.update({name.replace(".weight", ".bias"): hf.replace(".weight", ".bias") for name, hf in
                          names.items() if name.startswith(("attn.out_proj", "mlp."))})
        pairs += [(f"blocks.{i}.{ours}", f"model.layers.{i}.{hf}") for ours, hf in names.items()]
    return pairs


def _is_gain(name: str) -> bool:
    return name.endswith("norm.weight")  # every RMSNorm's gain (attn_norm, q_norm, final_norm, ...)


def hf_to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Rename (and transpose, concatenate or stack) HF tensors into our state dict; strict about leftovers."""
    tensors = dict(tensors)
    take = _taker(tensors)
    family = family_of(config)
    ours = {}
    if family == "gpt2":
        prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        ours["token_embedding.weight"] = take(f"{prefix}wte.weight")
        ours["position_embedding.weight"] = take(f"{prefix}wpe.weight")
        ours["final_norm.weight"] = take(f"{prefix}ln_f.weight")
        ours["final_norm.bias"] = take(f"{prefix}ln_f.bias")
        for i in range(config.n_layers):
            for name, hf_name in _GPT2_LAYER.items():
                hf_name, _, transposed = hf_name.partition(" ")
                tensor = take(f"{prefix}h.{i}.{hf_name}")
                ours[f"blocks.{i}.{name}"] = tensor.t() if transposed else tensor
        for name in [k for k in tensors if k.endswith(IGNORED_SUFFIXES)]:
            del tensors[name]
    else:
        for name, hf_name in _decoder_names(config, family):
            tensor = take(hf_name)
            # Gemma stores each gain as (gain - 1), applied as x * (1 + w): ours holds the gain itself
            ours[name] = tensor.float() + 1 if family == "gemma3_text" and _is_gain(name) else tensor
        for i in range(config.n_layers):
            layer = f"model.layers.{i}"
            # Our fused qkv projection is q_proj, k_proj and v_proj stacked along the output rows.
            for part in ("weight", "bias") if config.qkv_bias else ("weight",):
                ours[f"blocks.{i}.attn.qkv.{part}"] = torch.cat([take(f"{layer}.self_attn.{p}_proj.{part}")
                                                                for p in "qkv"])
            if config.is_moe(i):
                ours.update(_experts_in(take, tensors, config, family, i))
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some files store the tied head as well
        ours["lm_head.weight"] = ours["token_embedding.weight"]
    else:
        ours["lm_head.weight"] = take("lm_head.weight")
    if tensors:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(tensors)[:10]}")
    return ours


def _experts_in(take: Callable[[str], torch.Tensor], tensors: dict, config: GPTConfig, family: str,
                layer: int) -> dict[str, torch.Tensor]:
    """Block ``layer``'s experts stacked (E, ...): from one tensor per expert (the hub's files), or from the
    (E, 2 d_expert, d) gate_up and (E, d, d_expert) down tensors that transformers 5 keeps in memory."""
    ours = f"blocks.{layer}.mlp"
    fused = f"model.layers.{layer}.mlp.experts"
    if f"{fused}.gate_up_proj" in tensors:
        gate, up = take(f"{fused}.gate_up_proj").chunk(2, dim=1)
        return {f"{ours}.gate": gate, f"{ours}.up": up, f"{ours}.down": take(f"{fused}.down_proj")}
    module = "block_sparse_moe" if family == "mixtral" else "mlp"
    return {f"{ours}.{name}": torch.stack([take(f"model.layers.{layer}.{module}.experts.{e}.{hf}.weight")
                                           for e in range(config.n_experts)])
            for name, hf in _EXPERT_NAMES[family].items()}


def ours_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict under transformers' names (the inverse of ``hf_to_ours``); experts one tensor each."""
    family = family_of(config)
    hf = {}
    if family == "gpt2":
        hf["transformer.wte.weight"] = state["token_embedding.weight"]
        hf["transformer.wpe.weight"] = state["position_embedding.weight"]
        hf["transformer.ln_f.weight"] = state["final_norm.weight"]
        hf["transformer.ln_f.bias"] = state["final_norm.bias"]
        for i in range(config.n_layers):
            for name, hf_name in _GPT2_LAYER.items():
                hf_name, _, transposed = hf_name.partition(" ")
                tensor = state[f"blocks.{i}.{name}"]
                hf[f"transformer.h.{i}.{hf_name}"] = tensor.t() if transposed else tensor
    else:
        for name, hf_name in _decoder_names(config, family):
            tensor = state[name]
            hf[hf_name] = (tensor.float() - 1).to(tensor.dtype) if family == "gemma3_text" and _is_gain(name) else tensor
        sizes = (config.n_heads * config.head_dim, config.kv_heads * config.head_dim,
                 config.kv_heads * config.head_dim)
        for i in range(config.n_layers):
            layer = f"model.layers.{i}"
            for part in ("weight", "bias") if config.qkv_bias else ("weight",):
                for proj, tensor in zip("qkv", state[f"blocks.{i}.attn.qkv.{part}"].split(sizes)):
                    hf[f"{layer}.self_attn.{proj}_proj.{part}"] = tensor
            if config.is_moe(i):
                module = "block_sparse_moe" if family == "mixtral" else "mlp"
                for name, hf_name in _EXPERT_NAMES[family].items():
                    for e, tensor in enumerate(state[f"blocks.{i}.mlp.{name}"]):
                        hf[f"{layer}.{module}.experts.{e}.{hf_name}.weight"] = tensor
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["lm_head.weight"]
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def _taker(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint has no tensor {name!r} (missing)")
        return tensors.pop(name)
    return take
