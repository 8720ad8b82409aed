"""The model's shape and numerics, read from an HF config.json or GGUF metadata.

One frozen record for the Llama family we run (Llama, Mistral, Qwen2): they
share one decoder (RMSNorm, rotary attention with GQA, SwiGLU MLP) and differ
only in the flags below. Anything outside that family, or a feature our decoder
lacks, is rejected here with a ValueError naming it, so a model never loads
half-supported.

Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not
implemented by the attention backends. A model with a window shorter than its
context is accepted with max_position_embeddings lowered to the window: no
sequence can then outgrow the window, so full causal attention is exact.
`sliding_window` is therefore always None in a ModelConfig. Keys a
config.json leaves out take transformers' defaults for its model type (a
Mistral window of 4,096, for one), since that is what the model was run with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

# transformers' defaults where a config.json leaves a key out, by model type.
_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_SLIDING_WINDOW = 4096  # MistralConfig's and Qwen2Config's (Qwen2 only with use_sliding_window)
_QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2: layers from this index on slide

# Extra keys each rope type needs (HF names); "default" needs none.
_ROPE_TYPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2"
    model_name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", <HF keys>}.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None:
            raise ValueError("sliding_window must be None: fold the window into max_position_embeddings")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], model_name: str = "") -> ModelConfig:
        """Reads a config.json dict (transformers 4.x or 5.x spelling)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            named = hf.get("architectures") or []
            raise ValueError(
                f"unsupported architecture {arch!r} (architectures={named}); "
                f"supported model_type: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in hf
        ]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # two names of x * sigmoid(x)
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
        if hf.get("mlp_bias", False):
            raise ValueError("unsupported: mlp_bias=True")
        if arch == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v bias (and none on o_proj)
        else:
            # Llama's attention_bias also puts a bias on o_proj, which we do not carry.
            if hf.get("attention_bias", False):
                raise ValueError(f"unsupported: attention_bias=True for {arch!r}")
            attention_bias = False

        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope_theta, rope_scaling = _hf_rope(hf)
        max_pos = int(hf.get("max_position_embeddings", _MAX_POSITIONS[arch]))
        window = _sliding_window(hf, arch)
        if window is not None and int(window) < max_pos:
            max_pos = int(window)

        eos = hf.get("eos_token_id")
        return cls(
            architecture=arch,
            model_name=model_name or str(hf.get("_name_or_path", "")),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], model_name: str = ""
    ) -> ModelConfig:
        """Reads llama.cpp metadata keys ("llama.block_count", ...) as plain Python values.

        `tensor_shapes` (GGUF name -> torch-order shape) tells what metadata does
        not: untied models carry "output.weight", Qwen2 has q/k/v biases, and
        Llama 3.1-style rope scaling lives in a "rope_freqs" tensor.
        """
        arch = metadata.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: 'llama', 'qwen2'")
        if arch == "llama" and "blk.0.attn_q.bias" in tensor_shapes:
            raise ValueError("unsupported GGUF: llama architecture with attention biases")
        if "rope_freqs.weight" in tensor_shapes:
            raise ValueError("unsupported GGUF: per-frequency rope factors (rope_freqs tensor, Llama 3.1+ scaling)")

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // num_heads)))
        rotary = int(key("rope.dimension_count", head_dim))
        if rotary != head_dim:  # llama.cpp's n_rot: rope on the first dims of each head only
            raise ValueError(f"unsupported GGUF: partial rotary embeddings (rope over {rotary} of {head_dim} dims)")
        rope_scaling = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type != "none":
            raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}; supported: none, linear")
        if "token_embd.weight" not in tensor_shapes:
            raise ValueError("GGUF file has no token_embd.weight tensor")
        vocab = tensor_shapes["token_embd.weight"][0]
        max_pos = int(key("context_length"))
        window = metadata.get(f"{arch}.attention.sliding_window")  # as on the HF path: the window caps the context
        if window and int(window) < max_pos:
            max_pos = int(window)
        return cls(
            architecture=arch,
            model_name=model_name or str(metadata.get("general.name", "")),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias=arch == "qwen2",
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple(metadata.get("tokenizer.ggml.eos_token_id")),
        )


def _as_id_tuple(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(int(i) for i in ids)


def _sliding_window(hf: Mapping[str, Any], arch: str) -> int | None:
    """The window of a model whose layers slide (any of them), as transformers
    reads it: Mistral's `sliding_window` (4,096 if absent, none if null); Qwen2's
    only with `use_sliding_window`, on the layers `layer_types` names or, without
    it, from `max_window_layers` on."""
    if arch == "llama":
        return None
    if arch == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window", _SLIDING_WINDOW)
    if window is None:
        return None
    if arch == "qwen2":
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        else:
            sliding = int(hf.get("max_window_layers", _QWEN2_MAX_WINDOW_LAYERS)) < int(hf["num_hidden_layers"])
        if not sliding:
            return None
    return int(window)


def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (transformers 4). A config with both, as a
    hand edit following a model card leaves, is read only where they agree:
    transformers 5 takes `rope_scaling` and drops the other's theta, which is
    seldom what the editor meant."""
    new, old = hf.get("rope_parameters"), hf.get("rope_scaling")
    if new and old:
        read = _rope_params(hf, new), _rope_params(hf, old)
        if read[0] != read[1]:
            raise ValueError(
                f"config.json has both rope_parameters {new} and rope_scaling {old}, and they disagree "
                f"(theta and scaling {read[0]} vs {read[1]}): keep the one the model should run with"
            )
        return read[0]
    return _rope_params(hf, new or old or {})


def _rope_params(hf: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[float, dict | None]:
    params = dict(given)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported: partial_rotary_factor != 1")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_TYPE_KEYS:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")
    missing = [k for k in _ROPE_TYPE_KEYS[rope_type] if k not in params]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **{k: params[k] for k in _ROPE_TYPE_KEYS[rope_type]}}
