"""Loading: HF folders (single and sharded safetensors), GGUF files, configs, and
the tokenizer description the scheduler receives."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from model_utils import PagedEngine, hf_greedy, load_hf_folder, make_backend, save_tiny_gguf, save_tiny_hf_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from executor_svc import packed_linear, weight_packing
from executor_svc.gguf_loader import GGUFCheckpoint
from executor_svc.hf_loader import INDEX_FILE, HFCheckpoint
from executor_svc.model import LlamaForCausalLM
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import default_model_path, load_model
from executor_svc.packed_linear import linear
from executor_svc.tokenizer_info import TokenizerInfo

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "Héllo wörld, ça va? 你好 🎉",
    "def f(x):\n\treturn [x, {'a': 1}]\n",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def first_tokens(model, prompt: list[int], num_new: int) -> list[int]:
    engine = PagedEngine(model, num_blocks=16, block_size=4)
    seq = engine.add(prompt)
    seq.token_ids.append(int(engine.step([(seq, len(prompt))]).argmax()))
    engine.decode([seq], num_new - 1)
    return seq.token_ids[len(prompt) :]


# --- HF folders -------------------------------------------------------------------


def test_sharded_safetensors_load_like_hf(tmp_path):
    hf_model = save_tiny_hf_model("qwen2", str(tmp_path / "single"))
    hf_model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert (tmp_path / "sharded" / INDEX_FILE).is_file() and len(shards) >= 3

    sharded = load_hf_folder(str(tmp_path / "sharded"), make_backend("dense"))
    single = load_hf_folder(str(tmp_path / "single"), make_backend("dense"))
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name
    prompt = [5, 17, 3, 99, 250, 8]
    assert first_tokens(sharded, prompt, 6) == hf_greedy(hf_model, prompt, 6)[0]


def test_missing_tensor_is_named(tmp_path):
    save_tiny_hf_model("llama3", str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_folder(str(tmp_path), make_backend("dense"))


def test_untied_model_without_lm_head_is_named(tmp_path):
    save_tiny_hf_model("mistral", str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        load_hf_folder(str(tmp_path), make_backend("dense"))


def test_wrong_shape_is_named(tmp_path):
    save_tiny_hf_model("llama_tied", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(160, 64\)"):
        load_hf_folder(str(tmp_path), make_backend("dense"))


def test_generation_config_eos_ids_are_added(tmp_path):
    save_tiny_hf_model("llama3", str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert HFCheckpoint(str(tmp_path)).config.eos_token_ids == (2, 7, 9)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), make_backend("dense"))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma"}, {})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "lacks low_freq_factor"),
    ],
)
def test_unsupported_config_features_are_named(change, message):
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**base, **change})


def test_transformers4_config_spelling():
    # A Llama 3.1 config.json as the hub has it: rope_theta beside rope_scaling, eos list.
    config = ModelConfig.from_hf_config(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128008, 128009],
            "head_dim": None,
        }
    )
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert (config.head_dim, config.num_key_value_heads) == (4, 2)
    old_linear = {
        "model_type": "qwen2",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    assert ModelConfig.from_hf_config(old_linear).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_short_sliding_window_caps_context():
    base = {
        "model_type": "mistral",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32768,
    }
    assert ModelConfig.from_hf_config({**base, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf_config({**base, "sliding_window": None}).max_position_embeddings == 32768
    qwen = {**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf_config(qwen).max_position_embeddings == 32768


TINY = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2}


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "mistral"},  # no sliding_window key: transformers' 4,096
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 64, "max_position_embeddings": 1024},
        {"model_type": "qwen2", "use_sliding_window": True},  # no window key, no max_window_layers
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4},
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
        },
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "layer_types": ["full_attention"] * 4,
        },
        {"model_type": "llama"},
    ],
)
def test_context_and_window_are_read_as_transformers_reads_them(config):
    """Keys left out take transformers' defaults for the model type, and the
    window caps the context exactly where some layer of transformers' model
    slides: a sequence past it would attend differently there."""
    transformers = pytest.importorskip("transformers")
    config = {**TINY, **config}
    hf = transformers.AutoConfig.for_model(**config)
    sliding = getattr(hf, "sliding_window", None)
    if hf.model_type == "qwen2" and "sliding_attention" not in hf.layer_types:
        sliding = None
    want = hf.max_position_embeddings if sliding is None else min(sliding, hf.max_position_embeddings)
    assert ModelConfig.from_hf_config(config).max_position_embeddings == want


def test_rope_parameters_beside_a_disagreeing_rope_scaling_are_refused():
    """A model card's rope_scaling added to a transformers-5 config: the two
    would be read differently by different readers, so neither is guessed."""
    base = {**TINY, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ValueError, match="both rope_parameters .* and rope_scaling .* disagree"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"type": "linear", "factor": 4.0}})
    same = {**base, "rope_theta": 1e6, "rope_scaling": {"rope_type": "default"}}
    assert ModelConfig.from_hf_config(same).rope_theta == 1e6


def test_missing_keys_and_other_names_of_silu():
    with pytest.raises(ValueError, match="config.json lacks intermediate_size, vocab_size"):
        ModelConfig.from_hf_config(
            {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
        )
    assert ModelConfig.from_hf_config({**TINY, "model_type": "llama", "hidden_act": "swish"}).hidden_size == 8


def test_gguf_with_partial_rotary_embeddings_is_refused():
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.key_length": 16,
        "llama.rope.dimension_count": 8,
        "llama.feed_forward_length": 128,
        "llama.block_count": 1,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 256,
    }
    shapes = {"token_embd.weight": (32, 64)}
    with pytest.raises(ValueError, match="partial rotary embeddings .rope over 8 of 16 dims"):
        ModelConfig.from_gguf_metadata(metadata, shapes)
    full = ModelConfig.from_gguf_metadata({**metadata, "llama.rope.dimension_count": 16}, shapes)
    assert full.head_dim == 16 and full.max_position_embeddings == 256
    windowed = {**metadata, "llama.rope.dimension_count": 16, "llama.attention.sliding_window": 64}
    assert ModelConfig.from_gguf_metadata(windowed, shapes).max_position_embeddings == 64


@pytest.mark.parametrize(
    "bad, error",
    [
        ("nope.gguf", "does not exist"),
        ("folder_without_config", "expected a .gguf file or a folder with config.json"),
        ("weights.bin", "expected a .gguf file or a folder with config.json"),
    ],
)
def test_unloadable_path_is_a_clear_error(tmp_path, bad, error):
    (tmp_path / "folder_without_config").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=error):
        load_model(str(tmp_path / bad), torch.float32, torch.device("cpu"), make_backend("dense"))


# --- GGUF ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_linear", "qwen2", "llama_tied"])
def test_gguf_written_like_llama_cpp_loads_like_hf(tmp_path, kind):
    hf_model = save_tiny_hf_model(kind, str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"))
    checkpoint = GGUFCheckpoint(str(tmp_path / "tiny.gguf"))
    assert checkpoint.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    model = LlamaForCausalLM(checkpoint.config, make_backend("dense"))
    model.load_weights(checkpoint.tensor)
    prompt = [3, 141, 59, 26, 53, 58, 97, 93, 23]
    assert first_tokens(model, prompt, 8) == hf_greedy(hf_model, prompt, 8)[0]


@pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_quantized_gguf_blocks_serve_the_float32_model(tmp_path, kind, quant):
    """A quantized GGUF: its blocks (rows un-permuted like the dequantized
    tensors) pack into block panels that multiply exactly like the float32
    weights, and the model gives the same greedy tokens and logits with and
    without them."""
    hf_model = save_tiny_hf_model(kind, str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"), quantize=quant)
    checkpoint = GGUFCheckpoint(str(tmp_path / "tiny.gguf"))
    name = "model.layers.1.self_attn.q_proj.weight"
    found, rows = checkpoint.blocks(name)
    assert found == quant
    qtype = gguf.GGMLQuantizationType[quant]
    dequantized = gguf.quants.dequantize(rows.reshape(rows.shape[0], -1).numpy(), qtype)
    assert torch.equal(torch.from_numpy(np.array(dequantized)), checkpoint.tensor(name))
    assert checkpoint.blocks("model.layers.0.input_layernorm.weight") is None  # float32 in the file

    models = []
    for blocks in (None, checkpoint.blocks):
        model = LlamaForCausalLM(checkpoint.config, make_backend("cpu"))
        model.load_weights(checkpoint.tensor)
        weight_packing.pack_linear_weights(model, blocks)
        models.append(model)
    plain, with_blocks = models
    assert plain.layers[0].packed["qkv"].blocks is None
    assert all(p.blocks is not None for layer in with_blocks.layers for p in layer.packed.values())
    assert with_blocks._head_packed.blocks is not None
    logits = []
    for model in models:
        engine = PagedEngine(model, num_blocks=32, block_size=16)
        seqs = [engine.add([3, 141, 59, 26, 53, 58, 97, 93, 23]), engine.add([5, 6, 7])]
        work = [(s, len(s.token_ids)) for s in seqs]
        steps = []
        for _ in range(6):  # a prefill of 12 rows, then decodes of 2: all on the block path
            steps.append(engine.step(work))
            for seq, token in zip(seqs, steps[-1].argmax(-1).tolist()):
                seq.token_ids.append(token)
            work = [(s, 1) for s in seqs]
        logits.append(torch.stack(steps))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
def test_block_panels_hold_each_tensor_parallel_share(tmp_path):
    """Rank 1 of 2 keeps its rows of q/k/v and gate/up and its columns of o;
    down's columns (intermediate 160 / 2 = 80) would split a 32-wide block,
    so it keeps float32 panels only. Multiplying the identity reads each
    packed weight back exactly."""
    hf_model = save_tiny_hf_model("llama_tied", str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"), quantize="Q8_0")
    checkpoint = GGUFCheckpoint(str(tmp_path / "tiny.gguf"))
    model = LlamaForCausalLM(checkpoint.config, make_backend("dense"), tp_rank=1, tp_size=2)
    model.load_weights(checkpoint.tensor)
    weight_packing.pack_linear_weights(model, checkpoint.blocks)
    layer = model.layers[1]
    assert layer.packed["down"].blocks is None
    for name in ("qkv", "o", "gate_up"):
        weight = getattr(layer, f"{name}_weight")
        eye = torch.eye(weight.shape[1])
        for start in range(0, weight.shape[1], 7):  # <= 32 rows a call: every column, all on the block path
            rows = eye[start : start + 7]
            assert packed_linear.route(rows.shape[0], layer.packed[name]) == "blocks"
            assert torch.equal(linear(rows, weight, None, layer.packed[name]), weight[:, start : start + 7].t())


# --- tokenizer description ------------------------------------------------------------


def assert_tokenizes_like(info: TokenizerInfo, hf_tok) -> None:
    backend = Tokenizer.from_str(info.tokenizer_json)
    for text in TEXTS:
        assert backend.encode(text).ids == hf_tok(text).input_ids, text
    rendered = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = hf_tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert backend.encode(rendered, add_special_tokens=False).ids == expected
    assert info.chat_template == hf_tok.chat_template
    assert (info.bos_token, info.eos_token) == (hf_tok.bos_token or "", hf_tok.eos_token or "")


def test_gguf_tokenizer_info_round_trips(hf_smollm2):
    _, hf_tok = hf_smollm2
    info = TokenizerInfo.from_gguf(default_model_path())
    assert_tokenizes_like(info, hf_tok)
    # SmolLM2 puts no BOS in front of plain text.
    assert not info.add_bos_token and hf_tok("Hello").input_ids[0] != hf_tok.bos_token_id


def test_hf_folder_tokenizer_info_round_trips(hf_smollm2, tmp_path):
    from transformers import AutoTokenizer

    _, gguf_tok = hf_smollm2
    gguf_tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()  # the template lives outside tokenizer_config.json
    info = TokenizerInfo.from_hf_folder(str(tmp_path))
    assert_tokenizes_like(info, AutoTokenizer.from_pretrained(str(tmp_path)))
    assert not info.add_bos_token


def test_hf_folder_tokenizer_that_adds_bos(hf_smollm2, tmp_path):
    from transformers import AutoTokenizer

    _, gguf_tok = hf_smollm2
    gguf_tok.save_pretrained(str(tmp_path))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf_tok("Hello").input_ids[0] == 1, "the edited post-processor should add BOS"
    info = TokenizerInfo.from_hf_folder(str(tmp_path))
    assert info.add_bos_token
    assert_tokenizes_like(info, hf_tok)


def test_load_model_from_hf_folder_with_tokenizer(hf_smollm2, tmp_path):
    _, gguf_tok = hf_smollm2
    hf_model = save_tiny_hf_model("llama3", str(tmp_path))
    gguf_tok.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"), make_backend("dense"))
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens, hf_model.model.embed_tokens.weight.to(torch.bfloat16))
    assert loaded.tokenizer.chat_template == gguf_tok.chat_template
