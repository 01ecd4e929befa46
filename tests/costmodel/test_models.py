"""The models flashcp plans for (flashcp.costmodel.models): the built-in table and the config.json reader.

Configs are written by the installed transformers' own config classes (offline) and read back; the kinds per
layer are compared with what transformers says per layer (its ``layer_types`` after construction, its
attention modules' ``sliding_window``).
"""

import json

import pytest

transformers = pytest.importorskip("transformers")

from flashcp.costmodel.models import (  # noqa: E402
    BUILTIN_MODELS,
    CLASS_DEFAULTS,
    DEFAULT_MODEL,
    LayerKind,
    ModelError,
    ModelSpec,
    model_from_config,
    resolve_model,
)
from flashcp.errors import FlashcpError  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=128)
"""A tiny shape for configs whose layer kinds are under test."""

FULL = LayerKind()


def window(size, **extra):
    return LayerKind(kind="window", size=size, **extra)


def chunk(size):
    return LayerKind(kind="chunk", size=size)


def transformers_kinds(config) -> list[LayerKind]:
    """The kind of every layer as transformers' modeling code decides it from a constructed config object."""
    text = config.get_text_config()
    sinks = text.model_type == "gpt_oss"  # GptOssAttention holds a sinks parameter on every layer
    softcap = getattr(text, "attn_logit_softcapping", None)
    types = getattr(text, "layer_types", None)
    if types is None:  # Mistral: create_sliding_window_causal_mask on every layer when sliding_window is set
        local = getattr(text, "sliding_window", None) is not None
        types = ["sliding_attention" if local else "full_attention"] * text.num_hidden_layers
    kinds = []
    for entry in types:
        if entry == "linear_attention":  # a hybrid's recurrent layer: ModelSpec.recurrent counts it
            continue
        kind = {"full_attention": "full", "sliding_attention": "window", "chunked_attention": "chunk"}[entry]
        size = text.sliding_window if kind == "window" else text.attention_chunk_size if kind == "chunk" else None
        kinds.append(LayerKind(kind=kind, size=size, sinks=sinks, softcap=softcap))
    return kinds


def write(config, tmp_path, drop=(), rename=None) -> dict:
    """``config.to_json_file`` into ``tmp_path/config.json``; ``drop`` fields removed from the (text) config as a
    file written before transformers added them would lack them. Returns the JSON written."""
    path = tmp_path / "config.json"
    config.to_json_file(path)
    data = json.loads(path.read_text())
    text = data.get("text_config", data)
    for field in drop:
        text.pop(field, None)
    for old, new in (rename or {}).items():
        text[new] = text.pop(old)
    path.write_text(json.dumps(data))
    return data


# ---- the built-in table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_every_builtin_validates_and_round_trips(name):
    spec = BUILTIN_MODELS[name]
    assert spec.name == name == name.lower()
    assert ModelSpec.from_dict(spec.as_dict()) == spec
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict()))) == spec  # through plan.json's JSON
    assert sum(spec.kind_counts().values()) == spec.num_layers
    shape = spec.attention_shape()
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.layers) == (
        spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_layers)
    assert shape.token_flops() == pytest.approx(spec.token_flops(), rel=1e-12), \
        f"{name}: AttentionShape prices {shape.token_flops():.6g} FLOPs per token and layer, the model " \
        f"{spec.token_flops():.6g}"
    assert name in spec.describe() and "\n" not in spec.describe()


def test_default_model_is_grouped_query():
    spec = resolve_model(DEFAULT_MODEL)
    assert spec is BUILTIN_MODELS["llama-3-8b"] and spec.num_kv_heads < spec.num_heads


EXPECTED_KINDS = {
    "llama-3-8b": {FULL: 32},
    "llama-3-70b": {FULL: 80},
    "qwen3-8b": {FULL: 36},
    "mistral-7b-v0.1": {window(4096): 32},
    "gemma-3-12b": {window(1024): 40, FULL: 8},
    "gpt-oss-20b": {window(128, sinks=True): 12, LayerKind(sinks=True): 12},
    "llama-4-scout": {chunk(8192): 36, FULL: 12},
    "qwen3-next-80b-a3b": {FULL: 12},
}


@pytest.mark.parametrize("name", list(EXPECTED_KINDS))
def test_builtin_kind_counts(name):
    assert BUILTIN_MODELS[name].kind_counts() == EXPECTED_KINDS[name]


def test_builtin_layer_order():
    gemma = BUILTIN_MODELS["gemma-3-12b"].layers
    assert [layer.kind for layer in gemma[:12]] == ["window"] * 5 + ["full"] + ["window"] * 5 + ["full"]
    assert [layer.kind for layer in BUILTIN_MODELS["gpt-oss-20b"].layers[:4]] == ["window", "full"] * 2
    assert [layer.kind for layer in BUILTIN_MODELS["llama-4-scout"].layers[:8]] == (["chunk"] * 3 + ["full"]) * 2


def test_describe_is_one_line_by_kind():
    assert BUILTIN_MODELS["gpt-oss-20b"].describe() == (
        "gpt-oss-20b: 24 layers (12 window 128 + sinks, 12 full + sinks), 64 heads / 8 K/V x 64, hidden 2880, "
        "MLP 11520, vocab 201088")
    softcapped = ModelSpec.from_dict({**BUILTIN_MODELS["llama-3-8b"].as_dict(), "layers": [
        {"kind": "window", "size": 4096, "sinks": False, "softcap": 50, "count": 2}]})
    assert softcapped.describe().startswith("llama-3-8b: 2 layers (2 window 4096 softcap 50), 32 heads / 8 K/V")
    assert softcapped.layers[0].softcap == 50.0 and isinstance(softcapped.layers[0].softcap, float)


def test_token_flops_by_hand():
    # Llama-3-8B: Q, O 4096x4096, K, V 4096x1024, gate/up/down 4096x14336; hidden_mult = 1.5 * 14336 / 4096
    spec = BUILTIN_MODELS["llama-3-8b"]
    h, f = 4096, 14336
    assert spec.token_flops() == 3 * 2 * (2 * h * h + 2 * h * 1024 + 3 * h * f)
    assert spec.attention_shape().hidden_mult == 1.5 * f / h
    # gpt-oss-20B: model width 2880, attention width 64 x 64 = 4096, 4 experts of 2880 per token
    oss = BUILTIN_MODELS["gpt-oss-20b"]
    assert oss.token_flops() == 3 * 2 * (2 * 2880 * 4096 + 2 * 2880 * 512 + 3 * 2880 * 11520)
    assert oss.attention_shape(dtype_bytes=4).dtype_bytes == 4


PUBLISHED = {
    # the published config.json values of each built-in, given to transformers' config class
    "llama-3-8b": lambda: transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                                    num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256),
    "llama-3-70b": lambda: transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                                     num_key_value_heads=8, num_hidden_layers=80, vocab_size=128256),
    "qwen3-8b": lambda: transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                                  num_key_value_heads=8, head_dim=128, num_hidden_layers=36,
                                                  vocab_size=151936, max_window_layers=36, use_sliding_window=False),
    "mistral-7b-v0.1": lambda: transformers.MistralConfig(hidden_size=4096, intermediate_size=14336,
                                                           num_attention_heads=32, num_key_value_heads=8,
                                                           num_hidden_layers=32, vocab_size=32000, sliding_window=4096),
    "gemma-3-12b": lambda: transformers.Gemma3Config(text_config=dict(  # the fields google's text_config sets
        hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_hidden_layers=48, num_key_value_heads=8,
        sliding_window=1024)),
    "gpt-oss-20b": lambda: transformers.GptOssConfig(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                                      num_key_value_heads=8, head_dim=64, num_hidden_layers=24,
                                                      vocab_size=201088, num_local_experts=32, num_experts_per_tok=4,
                                                      sliding_window=128),
    "llama-4-scout": lambda: transformers.Llama4Config(text_config=dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, num_hidden_layers=48, vocab_size=202048, num_local_experts=16,
        num_experts_per_tok=1, attention_chunk_size=8192, interleave_moe_layer_step=1)),
    "qwen3-next-80b-a3b": lambda: transformers.Qwen3NextConfig(),  # its defaults are the published config
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_builtin_equals_its_published_config(name, tmp_path):
    config = PUBLISHED[name]()
    assert model_from_config(config.to_dict(), name=name) == BUILTIN_MODELS[name]
    assert list(BUILTIN_MODELS[name].layers) == transformers_kinds(config)
    folder = tmp_path / name
    folder.mkdir()
    write(config, folder)
    assert resolve_model(str(folder)) == BUILTIN_MODELS[name]  # named after its folder


def test_sparse_published_gemma3_config_reads_with_class_defaults():
    # google/gemma-3-12b-pt's config.json: no head_dim, vocab_size or layer_types in its text_config
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                                 "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                                 "sliding_window_pattern": 6}}
    assert model_from_config(published, name="gemma-3-12b") == BUILTIN_MODELS["gemma-3-12b"]


def test_class_defaults_are_transformers_defaults():
    from transformers import CONFIG_MAPPING

    for model_type, defaults in CLASS_DEFAULTS.items():
        config = CONFIG_MAPPING[model_type]()
        for field, value in defaults.items():
            actual = getattr(config, "_" + field if field == "sliding_window_pattern" else field)
            assert actual == value, f"{model_type}.{field}: flashcp assumes {value!r}, transformers {actual!r}"


# ---- configs of every family with local layers, written by transformers ----------------------------------------

FAMILIES = {
    # id: (config factory, fields a pre-layer_types file lacks, renames, expected kinds)
    "llama": (lambda: transformers.LlamaConfig(**TINY, num_hidden_layers=3), (), None, [FULL] * 3),
    "mistral": (lambda: transformers.MistralConfig(**TINY, num_hidden_layers=3, sliding_window=64), (), None,
                [window(64)] * 3),
    "mistral-no-window": (lambda: transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=None), (),
                          None, [FULL] * 2),
    "qwen3": (lambda: transformers.Qwen3Config(**TINY, num_hidden_layers=3), ("layer_types",), None, [FULL] * 3),
    "qwen3-window": (lambda: transformers.Qwen3Config(**TINY, num_hidden_layers=4, use_sliding_window=True,
                                                      sliding_window=32, max_window_layers=2),
                     ("layer_types",), None, [FULL, FULL, window(32), window(32)]),
    "qwen3-moe-window": (lambda: transformers.Qwen3MoeConfig(**TINY, num_hidden_layers=2, use_sliding_window=True,
                                                             sliding_window=32), ("layer_types",), None,
                         [window(32)] * 2),
    "gemma2": (lambda: transformers.Gemma2Config(**TINY, num_hidden_layers=4, sliding_window=32), ("layer_types",),
               None, [window(32, softcap=50.0), LayerKind(softcap=50.0)] * 2),
    "gemma3": (lambda: transformers.Gemma3TextConfig(**TINY, num_hidden_layers=13, sliding_window=32),
               ("layer_types",), {"_sliding_window_pattern": "sliding_window_pattern"},
               ([window(32)] * 5 + [FULL]) * 2 + [window(32)]),
    "gemma3-pattern-3": (lambda: transformers.Gemma3TextConfig(**TINY, num_hidden_layers=6, sliding_window=32,
                                                               sliding_window_pattern=3),
                         ("layer_types",), {"_sliding_window_pattern": "sliding_window_pattern"},
                         [window(32), window(32), FULL] * 2),
    "gemma3-multimodal": (lambda: transformers.Gemma3Config(text_config=dict(**TINY, num_hidden_layers=7,
                                                                             sliding_window=16)),
                          ("layer_types",), {"_sliding_window_pattern": "sliding_window_pattern"},
                          [window(16)] * 5 + [FULL, window(16)]),
    "gpt_oss": (lambda: transformers.GptOssConfig(**TINY, num_hidden_layers=4, num_local_experts=4), ("layer_types",),
                None, [window(128, sinks=True), LayerKind(sinks=True)] * 2),
    "llama4": (lambda: transformers.Llama4TextConfig(**TINY, num_hidden_layers=8, attention_chunk_size=16),
               ("layer_types",), None, ([chunk(16)] * 3 + [FULL]) * 2),
    "llama4-multimodal": (lambda: transformers.Llama4Config(text_config=dict(**TINY, num_hidden_layers=4,
                                                                             attention_chunk_size=32)),
                          ("layer_types", "no_rope_layers"), None, [chunk(32)] * 3 + [FULL]),
    "llama4-no-chunk": (lambda: transformers.Llama4TextConfig(**TINY, num_hidden_layers=4, attention_chunk_size=None),
                        (), None, [FULL] * 4),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("with_layer_types", [True, False], ids=["as-written", "without-layer_types"])
def test_config_files_read_back_to_transformers_kinds(family, with_layer_types, tmp_path):
    factory, drop, rename, expected = FAMILIES[family]
    config = factory()
    assert transformers_kinds(config) == expected, "the expected kinds disagree with transformers' own"
    write(config, tmp_path, drop=() if with_layer_types else drop, rename=None if with_layer_types else rename)
    spec = model_from_config(tmp_path / "config.json")
    assert list(spec.layers) == expected
    assert spec.name == tmp_path.name  # the folder holding config.json
    text = config.get_text_config()
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size, spec.vocab_size) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.hidden_size, text.vocab_size)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss", "qwen3-window"])
def test_kinds_match_the_built_model(family):
    # transformers' attention modules: sliding_window per layer, sinks on gpt-oss's
    torch = pytest.importorskip("torch")
    config = FAMILIES[family][0]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_from_config(config.to_dict())
    for layer, kind in zip(model.model.layers, spec.layers, strict=True):
        assert layer.self_attn.sliding_window == kind.size
        assert hasattr(layer.self_attn, "sinks") == kind.sinks


def verified_model_types() -> list[str]:
    from flashcp.integrations.hf_support import VERIFIED_MODEL_TYPES

    return sorted(VERIFIED_MODEL_TYPES & set(transformers.CONFIG_MAPPING))


def hybrid_model_types() -> list[str]:
    from flashcp.integrations.hf_support import CP_RECURRENT_MIXERS

    return sorted(set(CP_RECURRENT_MIXERS) & set(transformers.CONFIG_MAPPING))


@pytest.mark.parametrize("model_type", sorted(set(verified_model_types()) - set(hybrid_model_types())))
def test_every_architecture_flashcp_trains_is_priced(model_type):
    # the default config of every architecture hf_support lets train: read to transformers' own kinds per layer
    config = transformers.CONFIG_MAPPING[model_type]()
    spec = model_from_config(config.to_dict())
    assert list(spec.layers) == transformers_kinds(config)
    text = config.get_text_config()
    assert spec.num_heads == text.num_attention_heads and spec.num_layers == text.num_hidden_layers


@pytest.mark.parametrize("model_type", hybrid_model_types())
def test_hybrids_flashcp_trains_are_read_with_their_recurrent_layers(model_type):
    # their recurrent layers run under CP (flashcp.integrations.hf_recurrent) and are priced beside attention
    config = transformers.CONFIG_MAPPING[model_type]()
    data = config.to_dict()
    entries = data.get("layer_types") or data.get("layers_block_type")
    attention = [entry for entry in entries if entry in ("full_attention", "attention")]
    recurrent = [entry for entry in entries if entry in ("linear_attention", "mamba")]
    spec = model_from_config(data)
    assert spec.num_layers == len(attention) and spec.recurrent is not None
    assert spec.recurrent.num_layers == len(recurrent) > 0
    assert all(layer == LayerKind() for layer in spec.layers)
    if spec.recurrent.kind == "ssd":  # Nemotron-H: Mamba-2
        assert (spec.recurrent.num_heads, spec.recurrent.value_dim, spec.recurrent.key_dim, spec.recurrent.num_groups,
                spec.recurrent.conv_width) == (config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                               config.n_groups, config.conv_kernel)
    else:  # Qwen3-Next, Qwen3.5: Gated DeltaNet
        assert (spec.recurrent.num_heads, spec.recurrent.key_dim, spec.recurrent.value_dim, spec.recurrent.num_groups,
                spec.recurrent.conv_width) == (config.linear_num_value_heads, config.linear_key_head_dim,
                                               config.linear_value_head_dim, config.linear_num_key_heads,
                                               config.linear_conv_kernel_dim)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict()))) == spec  # plan.json round trip
    assert spec.attention_shape().recurrent == spec.recurrent


def test_head_dim_defaults_to_width_over_heads():
    data = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=1).to_dict()
    del data["head_dim"], data["num_key_value_heads"]
    spec = model_from_config(data)
    assert (spec.head_dim, spec.num_kv_heads) == (8, 8)


# ---- MLP widths --------------------------------------------------------------------------------------------------


def test_mixture_of_experts_widths():
    qwen3_moe = transformers.Qwen3MoeConfig(**TINY, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=40, mlp_only_layers=[0])
    assert model_from_config(qwen3_moe.to_dict()).mlp_width == round((96 + 3 * 2 * 40) / 4)
    qwen2_moe = transformers.Qwen2MoeConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2,
                                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                            shared_expert_intermediate_size=80)
    assert model_from_config(qwen2_moe.to_dict()).mlp_width == 2 * 40 + 80
    mixtral = transformers.MixtralConfig(**TINY, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    assert model_from_config(mixtral.to_dict()).mlp_width == 2 * 96
    maverick_like = transformers.Llama4TextConfig(**TINY, num_hidden_layers=4, interleave_moe_layer_step=2,
                                                  intermediate_size_mlp=300, num_experts_per_tok=1)
    assert model_from_config(maverick_like.to_dict()).mlp_width == round((300 + 2 * 96) / 2)


def expert_width(config) -> float:
    """Mean active MLP width per token over the layers, from the numbers of a family's default config."""
    if config.model_type == "hy_v3":  # mlp_layer_types: dense or sparse per layer; num_shared_experts
        moe = (config.num_experts_per_tok + config.num_shared_experts) * config.moe_intermediate_size
        widths = [moe if kind == "sparse" else config.intermediate_size for kind in config.mlp_layer_types]
    elif config.model_type == "aria_text":  # moe_topk experts and moe_num_shared_experts of intermediate_size
        widths = [(config.moe_topk + config.moe_num_shared_experts) * config.intermediate_size]
    elif config.model_type == "ernie4_5_moe":  # moe_k experts on the layers start..end, moe_num_shared_experts
        moe = (config.moe_k + config.moe_num_shared_experts) * config.moe_intermediate_size
        widths = [moe if config.moe_layer_start_index <= i <= config.moe_layer_end_index else config.intermediate_size
                  for i in range(config.num_hidden_layers)]
    else:  # solar_open, glm4_moe: the first first_k_dense_replace layers dense, n_shared_experts
        moe = (config.num_experts_per_tok + config.n_shared_experts) * config.moe_intermediate_size
        dense = getattr(config, "first_k_dense_replace", 0) or 0
        widths = [getattr(config, "intermediate_size", None)] * dense + [moe] * (config.num_hidden_layers - dense)
    return sum(widths) / len(widths)


@pytest.mark.parametrize("model_type", ["hy_v3", "aria_text", "ernie4_5_moe", "solar_open", "glm4_moe"])
def test_expert_widths_by_family(model_type):
    config = transformers.CONFIG_MAPPING[model_type]()
    assert model_from_config(config.to_dict()).mlp_width == round(expert_width(config))


def test_plain_mlp_is_priced_with_two_matrices():
    neox = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4,
                                      num_hidden_layers=2, vocab_size=100)
    spec = model_from_config(neox.to_dict())
    assert not spec.gated_mlp and spec.layers == (FULL, FULL)
    assert spec.token_flops() == 3 * 2 * (4 * 64 * 64 + 2 * 64 * 256)
    assert spec.attention_shape().hidden_mult == 256 / 64


@pytest.mark.parametrize("config, kinds", [
    (lambda: transformers.Qwen3NextConfig(num_hidden_layers=4), (1, "gdn", 3)),
    (lambda: transformers.NemotronHConfig(layers_block_type=["full_attention", "mlp", "mamba", "mlp"]),
     (1, "ssd", 1)),  # transformers names the Mamba-2 block 'linear_attention'
    (lambda: {"model_type": "nemotron_h", "hybrid_override_pattern": "*-M-", "num_attention_heads": 4,
              "hidden_size": 64, "vocab_size": 10, "intermediate_size": 8}, (1, "ssd", 1)),
])
def test_small_hybrids_are_read(config, kinds):
    """Attention layers, the recurrent kind and its layers; a config.json leaving out the recurrent fields
    takes transformers' class defaults (``CLASS_DEFAULTS``)."""
    made = config()
    spec = model_from_config(made if isinstance(made, dict) else made.to_dict())
    assert spec.recurrent is not None
    assert (spec.num_layers, spec.recurrent.kind, spec.recurrent.num_layers) == kinds


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    (lambda: transformers.DeepseekV3Config(num_hidden_layers=2),
     r"layer 0 is multi-head latent attention \(kv_lora_rank=512\)"),
    (lambda: transformers.JambaConfig(num_hidden_layers=4),
     r"layer 0 is recurrent \(its config sets attn_layer_period"),
    (lambda: transformers.LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "conv"]),
     r"layer 1 is 'conv' \(layer_types\)"),
])
def test_unpriceable_layers_are_refused_by_name(config, message):
    made = config()
    data = made if isinstance(made, dict) else made.to_dict()
    with pytest.raises(ModelError, match=message) as caught:
        model_from_config(data)
    assert "flashcp cannot price" in str(caught.value) and isinstance(caught.value, FlashcpError | ValueError)


def test_per_layer_shapes_are_refused_by_layer():
    config = transformers.LlamaConfig(**TINY, num_hidden_layers=3, per_layer_config={2: {"intermediate_size": 64},
                                                                                       1: {"rms_norm_eps": 1e-5}})
    with pytest.raises(ModelError, match=r"layer 2 overrides intermediate_size \(per_layer_config\)"):
        model_from_config(config.to_dict())
    harmless = transformers.LlamaConfig(**TINY, num_hidden_layers=2, per_layer_config={1: {"rms_norm_eps": 1e-5}})
    assert model_from_config(harmless.to_dict()).layers == (FULL, FULL)


def test_missing_and_contradictory_fields_are_named(tmp_path):
    qwen = transformers.Qwen3Config(**TINY, num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                    max_window_layers=0).to_dict()
    with pytest.raises(ModelError, match=r"layer 0 is windowed attention and needs sliding_window"):
        model_from_config({**qwen, "sliding_window": None})
    with pytest.raises(ModelError, match=r"needs vocab_size \(the vocabulary size\)"):
        model_from_config({k: v for k, v in qwen.items() if k != "vocab_size"})
    with pytest.raises(ModelError, match="layer_types lists 2 layers, num_hidden_layers is 3"):
        model_from_config({**qwen, "num_hidden_layers": 3})
    with pytest.raises(ModelError, match="num_kv_heads must divide num_heads"):
        model_from_config({**qwen, "num_key_value_heads": 3})
    qwen2_moe = transformers.Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=8,
                                            intermediate_size=8, use_sliding_window=True).to_dict()
    del qwen2_moe["layer_types"]
    with pytest.raises(ModelError, match="use_sliding_window without layer_types.*give the config its layer_types"):
        model_from_config(qwen2_moe)
    ernie_vl = transformers.Ernie4_5_VLMoeConfig().to_dict()  # one expert width per modality: [text, vision]
    with pytest.raises(ModelError, match=r"needs moe_intermediate_size \(the expert width\) as a positive whole "
                                         r"number, got \[1536, 512\]"):
        model_from_config(ernie_vl)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read .*config.json as a Hugging Face config.json"):
        model_from_config(tmp_path)
    with pytest.raises(ModelError, match="no Hugging Face config at"):
        model_from_config(tmp_path / "missing")


# ---- resolve_model -----------------------------------------------------------------------------------------------


def test_resolve_model_by_name_any_case_and_by_path(tmp_path):
    assert resolve_model("Llama-3-8B") is BUILTIN_MODELS["llama-3-8b"]
    assert resolve_model(" GPT-OSS-20B ") is BUILTIN_MODELS["gpt-oss-20b"]
    config = transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=8)
    write(config, tmp_path)
    by_file, by_folder = resolve_model(str(tmp_path / "config.json")), resolve_model(str(tmp_path))
    assert by_file == by_folder and by_file.layers == (window(8),) * 2


def test_resolve_model_lists_the_builtin_names(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'llama-5'") as caught:
        resolve_model("llama-5")
    for name in BUILTIN_MODELS:
        assert name in str(caught.value)
    with pytest.raises(ModelError, match="no Hugging Face config at"):
        resolve_model(str(tmp_path))  # a folder without config.json
    with pytest.raises(ModelError, match="unknown model ''"):
        resolve_model("")


# ---- validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(kind="sliding"), "a layer kind must be one of full, window, chunk, got 'sliding'"),
    (dict(kind="window"), "a window layer needs its size as a positive number of tokens, got None"),
    (dict(kind="chunk", size=0), "a chunk layer needs its size"),
    (dict(kind="window", size=True), "a window layer needs its size"),
    (dict(size=4), "a full attention layer has no size, got size=4"),
    (dict(softcap=0.0), "softcap must be a positive number or None, got 0.0"),
    (dict(sinks=1), "sinks must be true or false, got 1"),
])
def test_bad_layer_kinds_are_refused(fields, message):
    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LayerKind(**fields)


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=3), "num_kv_heads must divide num_heads, got 3 K/V heads for 32 heads"),
    (dict(head_dim=0), "head_dim must be a positive whole number, got 0"),
    (dict(mlp_width=1.5), "mlp_width must be a positive whole number, got 1.5"),
    (dict(layers=()), "layers must be a non-empty tuple of LayerKind"),
    (dict(layers=("full",)), "layers must be a non-empty tuple of LayerKind"),
    (dict(name=""), "a model needs a name"),
])
def test_bad_model_specs_are_refused(change, message):
    fields = {**BUILTIN_MODELS["llama-3-8b"].as_dict(), "layers": BUILTIN_MODELS["llama-3-8b"].layers, **change}
    with pytest.raises(ModelError, match=message):
        ModelSpec(**fields)


def test_from_dict_names_missing_and_unknown_fields():
    data = BUILTIN_MODELS["gemma-3-12b"].as_dict()
    with pytest.raises(ModelError, match="missing: vocab_size, unknown: vocab"):
        ModelSpec.from_dict({**{k: v for k, v in data.items() if k != "vocab_size"}, "vocab": 1})
    with pytest.raises(ModelError, match="layer run 0 needs a positive count, got 0"):
        ModelSpec.from_dict({**data, "layers": [{**data["layers"][0], "count": 0}]})
    assert ModelSpec(**{**data, "layers": list(BUILTIN_MODELS["gemma-3-12b"].layers)}).layers == \
        BUILTIN_MODELS["gemma-3-12b"].layers  # a list is stored as a tuple
