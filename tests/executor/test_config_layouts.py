"""Both config.json layouts transformers writes, and the strict key tables.

transformers 5 writes RoPE as ``rope_parameters``; transformers 4 wrote a top-level
``rope_theta`` / ``rope_scaling``. Tiny random checkpoints written by transformers itself (Llama,
Llama with llama3 RoPE scaling, Qwen2 with θ = 10⁶, Mistral with θ = 10⁶), served by kvgate's
executor from either layout, must give transformers' own greedy ids. The unit tests pin down the
rule: a key that changes the math and is not understood is an error, never a default.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kvgate.executor.config import CheckpointError, parse_config
from kvgate.executor.config_keys import MODEL_TYPES
from kvgate.executor.rope_config import LayerType, RopeType
from tests.executor.hf_checkpoints import (
    SHAPE,
    Written,
    as_transformers_4,
    config_of,
    copy_with_config,
    kvgate_greedy,
    write,
)

# ---------------------------------------------------------------- checkpoints by transformers

# original_max_position_embeddings 16: the llama3 scaling acts on every wavelength above 16
# positions, so it changes the rotation of a 12-token prompt from its second position on.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_SHAPE = {k: v for k, v in SHAPE.items() if k != "pad_token_id"}


def _transformers_config(family: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(**_SHAPE)
    if family == "llama3-scaled":
        return LlamaConfig(**_SHAPE, rope_parameters=dict(_LLAMA3_ROPE))
    if family == "qwen2":
        return Qwen2Config(**_SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert family == "mistral"
    return MistralConfig(**_SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


_FAMILIES = ["llama", "llama3-scaled", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    return {
        f: write(_transformers_config(f), tmp_path_factory.mktemp(f), seed=sum(map(ord, f)))
        for f in _FAMILIES
    }


@pytest.mark.parametrize("family", _FAMILIES)
def test_transformers_5_layout_gives_transformers_greedy_ids(
    written: dict[str, Written], family: str
) -> None:
    checkpoint = written[family]
    config = config_of(checkpoint.model_dir)
    assert "rope_parameters" in config and "rope_theta" not in config  # the layout under test
    assert kvgate_greedy(checkpoint.model_dir) == checkpoint.greedy_ids


@pytest.mark.parametrize("family", _FAMILIES)
def test_transformers_4_layout_gives_transformers_greedy_ids(
    written: dict[str, Written], family: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    checkpoint = written[family]
    old_config = as_transformers_4(config_of(checkpoint.model_dir))
    old_dir = copy_with_config(checkpoint.model_dir, tmp_path / "v4", old_config)
    # transformers reads the rewritten file as the same RoPE: the two files mean one model.
    theirs_new = AutoConfig.from_pretrained(checkpoint.model_dir).rope_parameters
    assert AutoConfig.from_pretrained(old_dir).rope_parameters == theirs_new
    assert kvgate_greedy(old_dir) == checkpoint.greedy_ids


@pytest.mark.parametrize(
    ("family", "wrong_rope"),
    [
        ("llama3-scaled", {"rope_type": "default", "rope_theta": 500000.0}),  # scaling lost
        ("llama3-scaled", {"rope_type": "default", "rope_theta": 10000.0}),  # all of it lost
        ("qwen2", {"rope_type": "default", "rope_theta": 10000.0}),  # θ lost
        ("mistral", {"rope_type": "default", "rope_theta": 10000.0}),
    ],
)
def test_the_greedy_ids_see_a_lost_rope_setting(
    written: dict[str, Written], family: str, wrong_rope: dict[str, Any], tmp_path: Path
) -> None:
    """The greedy tests can fail: served with the RoPE a reader that lost the settings would
    use, each checkpoint gives other tokens than transformers."""
    checkpoint = written[family]
    config = {**config_of(checkpoint.model_dir), "rope_parameters": wrong_rope}
    wrong_dir = copy_with_config(checkpoint.model_dir, tmp_path / "wrong", config)
    wrong_ids = kvgate_greedy(wrong_dir)
    assert all(w != t for w, t in zip(wrong_ids, checkpoint.greedy_ids, strict=True))


# -------------------------------------------------- transformers' own configs parse (drift)


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen2", "mistral", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text"]
)
def test_every_key_transformers_writes_is_in_a_table(model_type: str) -> None:
    """The full dictionary of the installed transformers' config class (not only the keys it
    saves): a transformers upgrade that adds a key fails here, not in production."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_SHAPE)
    parsed = parse_config(config.to_dict())
    assert parsed.model_type == model_type
    theirs = config.rope_parameters
    per_type = theirs if "full_attention" in theirs else dict.fromkeys(LayerType, theirs)
    for layer_type, rope in per_type.items():
        assert parsed.rope_by_layer_type[LayerType(layer_type)].theta == rope["rope_theta"]


def test_tables_are_disjoint() -> None:
    for keys in MODEL_TYPES.values():
        tables = [set(keys.used), set(keys.ignored), set(keys.neutral)]
        for i, table in enumerate(tables):
            for other in tables[i + 1 :]:
                assert not table & other, (keys.model_type, table & other)


# ------------------------------------------------------------------------- unit: the rules

# A Llama config.json as transformers 5.24 saves it.
_LLAMA_V5: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "dtype": "float32",
    "eos_token_id": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "vocab_size": 384,
}


def _v5(**changes: Any) -> dict[str, Any]:
    return {**_LLAMA_V5, **changes}


def _v4(**changes: Any) -> dict[str, Any]:
    """The same config as transformers 4 saved it."""
    config = {k: v for k, v in _LLAMA_V5.items() if k not in {"rope_parameters", "dtype"}}
    old = {"rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32"}
    return {**config, **old, "transformers_version": "4.46.0", **changes}


def _refused(raw: dict[str, Any], *fragments: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        parse_config(raw)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        # math keys at a value other than their neutral one
        ("mlp_bias", True, "mlp_bias=true"),
        ("hidden_act", "gelu", 'hidden_act="gelu"'),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
        ("rope_interleaved", True, "rope_interleaved=true"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
        ("query_pre_attn_scalar", 144, "query_pre_attn_scalar=144"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
        ("is_encoder_decoder", True, "is_encoder_decoder=true"),
        # keys no table knows (Granite's multipliers, SmolLM3's NoPE layers, Phi-3's
        # top-level original_max_position_embeddings, a method of quantization kvgate does not
        # read, ...)
        ("embedding_multiplier", 12.0, "embedding_multiplier=12.0"),
        ("logits_scaling", 8.0, "logits_scaling=8.0"),
        ("no_rope_layers", [1, 1, 0], "no_rope_layers=[1, 1, 0]"),
        ("original_max_position_embeddings", 4096, "original_max_position_embeddings=4096"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ("total_ut_steps", 4, "total_ut_steps=4"),  # a looped key on a llama
        ("use_sliding_window", True, "use_sliding_window=true"),  # a Qwen2 key on a llama
    ],
)
def test_each_refused_key_names_itself_and_its_value(key: str, value: Any, shown: str) -> None:
    _refused(_v5(**{key: value}), shown)


def test_every_refused_key_is_named_at_once() -> None:
    message = _refused(_v5(mlp_bias=True, logits_scaling=8.0), "mlp_bias", "logits_scaling")
    assert message.count(";") == 1


def _as_model_type(model_type: str) -> dict[str, Any]:
    raw = {k: v for k, v in _LLAMA_V5.items() if k != "attention_bias"}
    raw["model_type"] = model_type
    return raw | {"total_ut_steps": 2} if model_type == "ouro" else raw


@pytest.mark.parametrize(
    ("model_type", "key", "value", "shown"),
    [
        ("mistral", "attention_bias", True, "unknown config key attention_bias=true"),
        ("qwen2", "attention_bias", False, "unknown config key attention_bias=false"),
        ("ouro", "attention_bias", True, "unsupported attention_bias=true"),
        ("llama", "max_window_layers", 28, "unknown config key max_window_layers=28"),
    ],
)
def test_keys_are_per_model_type(model_type: str, key: str, value: Any, shown: str) -> None:
    assert parse_config(_as_model_type(model_type)).model_type == model_type
    _refused({**_as_model_type(model_type), key: value}, shown, f"model_type {model_type}")


def test_neutral_values_are_served_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    raw = _v5(
        partial_rotary_factor=1.0,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,  # = head_dim: the usual 1/sqrt(head_dim)
        rope_interleaved=False,
    )
    with caplog.at_level(logging.INFO, logger="kvgate.executor.config"):
        parse_config(raw)
    (line,) = [r.getMessage() for r in caplog.records if "model config" in r.getMessage()]
    assert "family llama (model_type llama)" in line
    assert "RoPE default θ=10000 from rope_parameters" in line
    for seen in ("mlp_bias=false", "partial_rotary_factor=1.0", "query_pre_attn_scalar=16"):
        assert seen in line


def test_the_log_line_names_theta_type_and_layouts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvgate.executor.config"):
        parse_config(_v5(rope_parameters=dict(_LLAMA3_ROPE)))
        parse_config({k: v for k, v in _v4().items() if k not in {"rope_theta", "rope_scaling"}})
    first, second = [r.getMessage() for r in caplog.records if "model config" in r.getMessage()]
    assert "RoPE llama3 θ=500000 (factor 8," in first and "from rope_parameters" in first
    assert "RoPE default θ=10000 from no RoPE key (no RoPE key: transformers' default θ)" in second
    assert "full attention, context 2048" in second


# ------------------------------------------------------------------------ unit: the layouts


def test_both_layouts_read_the_same_rope() -> None:
    scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
    new = parse_config(_v5(rope_parameters=dict(_LLAMA3_ROPE)))
    old = parse_config(_v4(rope_theta=500000, rope_scaling=scaling))
    older = parse_config(_v4(rope_theta=500000, rope_scaling={"type": "llama3", **scaling}))
    assert new.rope == old.rope == older.rope
    assert new.rope_theta == 500000.0 and new.rope_scaling.rope_type is RopeType.LLAMA3
    assert new.rope_scaling.original_max_position_embeddings == 16


def test_agreeing_layouts_are_accepted() -> None:
    scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
    both = _v5(rope_parameters=dict(_LLAMA3_ROPE), rope_theta=500000.0, rope_scaling=scaling)
    assert parse_config(both).rope == parse_config(_v5(rope_parameters=dict(_LLAMA3_ROPE))).rope


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        (
            {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            ("rope_parameters.rope_theta = 1000000.0", "rope_theta = 10000.0", "θ"),
        ),
        (
            {
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": _LLAMA3_ROPE,
            },
            ("rope_parameters = {rope_type='llama3'", "rope_scaling = {rope_type='linear'"),
        ),
        (
            # null rope_scaling says "no scaling": transformers 4 would run plain RoPE
            {"rope_scaling": None, "rope_parameters": _LLAMA3_ROPE},
            ("rope_parameters = {rope_type='llama3'", "rope_scaling = {rope_type='default'}"),
        ),
    ],
    ids=["theta", "scaling", "null-scaling"],
)
def test_disagreeing_layouts_are_refused_naming_both(
    changes: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    _refused(_v5(**changes), "disagree", *fragments)


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_unimplemented_rope_types_are_refused_by_name(layout: str) -> None:
    rope = {"rope_type": "proportional", "factor": 4.0}
    raw = (
        _v5(rope_parameters={**rope, "rope_theta": 1e4})
        if layout == "rope_parameters"
        else _v4(rope_scaling=rope)
    )
    _refused(raw, f"unsupported {layout} type 'proportional' (not implemented yet)")


_SCALED = {
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"factor": 2.0},
    "longrope": {
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope_type", list(_SCALED))
@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_yarn_dynamic_and_longrope_read_from_either_layout(rope_type: str, layout: str) -> None:
    rope = {"rope_type": rope_type, **_SCALED[rope_type]}
    raw = (
        _v5(rope_parameters={**rope, "rope_theta": 1e4})
        if layout == "rope_parameters"
        else _v4(rope_scaling=rope)
    )
    scaling = parse_config(raw).rope_scaling
    assert scaling.rope_type is RopeType(rope_type)
    if rope_type == "dynamic":  # θ grows past the config's context, 2048 here
        assert scaling.original_max_position_embeddings == 2048
    if rope_type == "longrope":  # no factor stated: the ratio of the two contexts
        assert scaling.factor == 2048 / 64 and scaling.long_factor == (2.0,) * 8


@pytest.mark.parametrize(
    ("rope_type", "lacking", "missing"),
    [
        ("yarn", "original_max_position_embeddings", "original_max_position_embeddings"),
        ("yarn", "factor", "factor"),
        ("dynamic", "factor", "factor"),
        ("longrope", "long_factor", "long_factor"),
    ],
)
def test_a_scaled_rope_lacking_a_required_parameter_is_refused(
    rope_type: str, lacking: str, missing: str
) -> None:
    rope = {k: v for k, v in _SCALED[rope_type].items() if k != lacking}
    _refused(
        _v5(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, **rope}),
        f"rope_parameters of RoPE type {rope_type!r} lacks {missing}",
    )


def test_the_served_context_follows_the_rope() -> None:
    """dynamic NTK and yarn extend the context they were scaled for; the others keep the
    config's (llama3 and LongRoPE configs state the extended one themselves)."""
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert parse_config(_v5(rope_parameters=dynamic)).max_model_len == 4096
    yarn_long = {**yarn, "original_max_position_embeddings": 1024}
    assert parse_config(_v5(rope_parameters=yarn_long)).max_model_len == 4096
    yarn_short = {**yarn, "original_max_position_embeddings": 256}
    assert parse_config(_v5(rope_parameters=yarn_short)).max_model_len == 2048
    assert parse_config(_v5(rope_parameters=dict(_LLAMA3_ROPE))).max_model_len == 2048


def test_rope_parameters_never_default_a_scaling_parameter() -> None:
    lacking = {k: v for k, v in _LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    _refused(_v5(rope_parameters=lacking), "lacks original_max_position_embeddings")
    _refused(_v4(rope_scaling={"rope_type": "linear"}), "rope_scaling", "lacks factor")


def test_unknown_keys_inside_a_rope_object_are_refused() -> None:
    extra = {**_LLAMA3_ROPE, "attention_factor": 1.0}
    _refused(_v5(rope_parameters=extra), "rope_parameters.attention_factor=1.0")
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    _refused(_v5(rope_parameters=partial), "rope_parameters.partial_rotary_factor=0.5")


def test_dtype_and_torch_dtype_must_agree() -> None:
    assert parse_config(_v5(dtype="bfloat16")).torch_dtype == "bfloat16"
    assert parse_config(_v4(torch_dtype="float16")).torch_dtype == "float16"
    _refused(_v5(dtype="bfloat16", torch_dtype="float16"), "dtype 'bfloat16'", "'float16'")


# ------------------------------------------------------------ unit: RoPE per layer type

_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}


def test_per_layer_type_rope_is_parsed_into_the_config() -> None:
    config = parse_config(_v5(rope_parameters=_GEMMA3_ROPE))
    by_type = config.rope_by_layer_type
    assert by_type[LayerType.FULL_ATTENTION].theta == 1e6
    assert by_type[LayerType.SLIDING_ATTENTION].theta == 1e4
    assert config.rope_theta == 1e6  # every layer is full attention: no layer_types key


def test_one_rope_for_all_layer_types_serves_sliding_layers() -> None:
    same = {name: {"rope_type": "default", "rope_theta": 1e6} for name in _GEMMA3_ROPE}
    types = ["sliding_attention", "full_attention"]
    config = parse_config(_v5(rope_parameters=same, layer_types=types, sliding_window=64))
    assert config.layer_types == (LayerType.SLIDING_ATTENTION, LayerType.FULL_ATTENTION)
    assert config.rope_theta == 1e6 and config.max_model_len == 64


def test_layers_that_need_two_ropes_are_refused_naming_both() -> None:
    types = ["sliding_attention", "full_attention"]
    _refused(
        _v5(rope_parameters=_GEMMA3_ROPE, layer_types=types, sliding_window=64),
        "sliding_attention: default θ=10000",
        "full_attention: default θ=1e+06",
        "model_type llama applies one RoPE to every layer",
    )


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"rope_parameters": {"chunked_attention": {"rope_theta": 1e4}}}, "'chunked_attention'"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "'chunked_attention'"),
        ({"rope_parameters": {"full_attention": None}}, "rope_parameters.full_attention is null"),
        (
            {
                "rope_parameters": {"full_attention": {"rope_theta": 1e4}},
                "layer_types": ["sliding_attention"] * 2,
            },
            "no RoPE parameters for layer type(s) sliding_attention",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers"),
        (
            {"rope_parameters": _GEMMA3_ROPE, "rope_scaling": {"rope_type": "linear", "factor": 2}},
            "both rope_scaling and per-layer-type rope_parameters",
        ),
    ],
    ids=["unknown-rope-key", "unknown-layer-type", "no-rope", "missing-type", "count", "both"],
)
def test_unsupported_layer_types_are_refused_by_name(
    changes: dict[str, Any], fragment: str
) -> None:
    _refused(_v5(**changes), fragment)


# ------------------------------------------------------- real configs in the old layout


def test_published_transformers_4_configs_parse() -> None:
    """Key sets of real checkpoints: SmolLM2-135M-Instruct's (a nanotron export) and a Llama
    3.1-style one (llama3 scaling, a list of eos ids)."""
    smollm2 = _v4(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000,
        is_llama_config=True,
        rope_interleaved=False,
        pad_token_id=2,
        tie_word_embeddings=True,
        **{"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}},
    )
    del smollm2["head_dim"]
    config = parse_config(smollm2)
    assert config.rope_theta == 100000.0 and config.head_dim == 64
    scaling = {k: v for k, v in _LLAMA3_ROPE.items() if k != "rope_theta"}
    llama31 = parse_config(_v4(rope_theta=500000.0, rope_scaling=scaling, eos_token_id=[2, 3]))
    assert llama31.rope_scaling.rope_type is RopeType.LLAMA3 and llama31.eos_token_id == 2
