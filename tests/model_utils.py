"""Test helpers for the model: tiny random HF checkpoints, a dense attention
backend, and a minimal paged engine that drives model.forward step by step.

The paged engine mimics what the model runner does, without the scheduler:

    step([(seq_a, 5), (seq_b, 1)])   seq_a: prefill 5 tokens, seq_b: one decode
      input_ids  = [a a a a a | b]            positions = [c_a .. c_a+4 | c_b]
      slot(pos)  = block_ids[pos // bs] * bs + pos % bs
      logits for the last scheduled token of each sequence

Block 0 is the null block; blocks are handed out in shuffled order so block
tables are not contiguous, and the caches start as NaN so a read of a slot
nobody wrote poisons the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import gguf
import torch

from executor_svc.attention import get_backend
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.reference import dense_attention
from executor_svc.gguf_loader import gguf_tensor_name
from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LlamaForCausalLM


class DenseAttentionBackend:
    """Gathers each request's K/V through its block table and runs dense causal attention."""

    name = "dense"

    def prepare(self, meta: AttentionMetadata) -> None:
        slots = []
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            pos = torch.arange(seq_len)
            table = meta.block_tables[i].to(torch.int64)
            slots.append(table[pos // meta.block_size] * meta.block_size + pos % meta.block_size)
        meta.extra[self.name] = slots

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_heads, head_dim = k_cache.shape[2:]
        k_rows, v_rows = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        loc = meta.query_start_loc.tolist()
        outs = [
            dense_attention(query[loc[i] : loc[i + 1]], k_rows[slots], v_rows[slots], scale, torch.float32)
            for i, slots in enumerate(meta.extra[self.name])
        ]
        return torch.cat(outs).to(query.dtype)


def make_backend(name: str):
    if name == "dense":
        return DenseAttentionBackend()
    return get_backend(name)


def same_weights(model, backend, dtype: torch.dtype | None = None):
    """A model over `model`'s weights with another backend: shared tensors when the
    dtype is unchanged, cast copies otherwise."""
    dtype = dtype or model.embed_tokens.dtype
    twin = LlamaForCausalLM(model.config, backend, dtype=dtype)
    twin.load_state_dict(model.state_dict(), assign=dtype == model.embed_tokens.dtype)
    return twin.eval()


def load_hf_folder(folder: str, backend, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Our model from an HF folder without a tokenizer (the tiny test models have none)."""
    checkpoint = HFCheckpoint(folder)
    model = LlamaForCausalLM(checkpoint.config, backend, dtype=dtype, device=device)
    model.load_weights(checkpoint.tensor)
    return model.eval()


@dataclass
class Seq:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedEngine:
    def __init__(
        self, model, num_blocks: int = 64, block_size: int = 16, seed: int = 0, kv_dtype: torch.dtype | None = None
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        dtype = kv_dtype or model.embed_tokens.dtype
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def add(self, token_ids: list[int], prefix_from: Seq | None = None, num_prefix_blocks: int = 0) -> Seq:
        """A new sequence; with prefix_from, it reuses that sequence's first full blocks
        as a prefix-cache hit (their tokens must be identical)."""
        seq = Seq(list(token_ids))
        if prefix_from is not None:
            shared = num_prefix_blocks * self.block_size
            assert prefix_from.num_computed >= shared, "can only share computed blocks"
            assert prefix_from.token_ids[:shared] == seq.token_ids[:shared], "shared blocks must hold the same tokens"
            seq.block_ids = prefix_from.block_ids[:num_prefix_blocks]
            seq.num_computed = shared
        return seq

    def step(self, work: list[tuple[Seq, int]]) -> torch.Tensor:
        """Computes `n` more tokens of each (seq, n); returns logits [len(work), vocab]
        of each sequence's last computed token."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            assert end <= len(seq.token_ids), f"scheduling {n} tokens past the known {len(seq.token_ids)}"
            while len(seq.block_ids) * self.block_size < end:
                seq.block_ids.append(self.free_blocks.pop())
            input_ids += seq.token_ids[start:end]
            for pos in range(start, end):
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            seq_lens.append(end)
        width = max(len(seq.block_ids) for seq, _ in work)
        tables = torch.zeros(len(work), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(work):
            tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            num_tokens=len(input_ids),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        with torch.inference_mode():
            self.model.attn_backend.prepare(meta)
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                self.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden[torch.tensor(starts[1:]) - 1])
        for seq, n in work:
            seq.num_computed += n
        return logits

    def decode(self, seqs: list[Seq], num_steps: int) -> None:
        """Greedy: each step appends the argmax of the previous logits to every sequence."""
        for _ in range(num_steps):
            logits = self.step([(seq, 1) for seq in seqs])
            for seq, token in zip(seqs, logits.argmax(-1).tolist()):
                seq.token_ids.append(token)


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor, float]:
    """transformers' greedy continuation with its own KV cache, never stopping at EOS.

    Returns (new tokens, float32 logits of the first new position, the smallest
    top-1 minus top-2 logit gap along the way: a tie closer than float noise
    would make a token mismatch meaningless).
    """
    tokens, first_logits, min_gap = [], None, float("inf")
    ids = torch.tensor([prompt])
    cache = None
    with torch.inference_mode():
        for _ in range(num_new):
            out = hf_model(input_ids=ids, cache=cache, use_cache=True)
            cache = out.cache
            logits = out.logits[0, -1].float()
            top2 = logits.topk(2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            if first_logits is None:
                first_logits = logits
            token = int(logits.argmax())
            tokens.append(token)
            ids = torch.tensor([[token]])
    return tokens, first_logits, min_gap


def save_tiny_hf_model(kind: str, folder: str, seed: int = 0, **overrides):
    """A random 2-layer model of `kind` saved as an HF folder; returns the HF model (float32).
    `overrides` replace the tiny shape's config values (e.g. hidden_size).

    Weights are drawn wider than transformers' default init so logits are
    spread out and greedy choices are not near-ties.
    """
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
    )
    common.update(overrides)
    configs = {
        "llama3": lambda: transformers.LlamaConfig(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        ),
        "llama_tied": lambda: transformers.LlamaConfig(tie_word_embeddings=True, **common),
        "llama_linear": lambda: transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **common),
        "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=False, **common),
        "mistral": lambda: transformers.MistralConfig(sliding_window=4096, **common),
    }
    config = configs[kind]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The default init leaves norms at 1 and biases at 0; perturb them so a
    # loader that drops or swaps them cannot pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(folder)
    return model


def save_tiny_gguf(hf_model, path: str, quantize: str | None = None) -> None:
    """Writes an HF Llama/Qwen2 model as a GGUF the way llama.cpp's converter
    does, including its Q/K row permutation for Llama: unquantized, or every
    matrix quantized to `quantize` ("Q4_1", "Q8_0")."""
    cfg = hf_model.config
    arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if cfg.rope_parameters.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        weight = tensor.detach().float().numpy()
        gguf_name = gguf_tensor_name(name)
        assert gguf_name is not None, f"no GGUF name for {name}"
        if arch == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_key_value_heads
            rows, cols = weight.shape
            weight = weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
        if quantize and weight.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, weight.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_tiny_model_with_tokenizer(folder: str, kind: str = "qwen2", **overrides):
    """A tiny random HF model (see save_tiny_hf_model, `overrides` its config's) plus a word-level
    tokenizer ("t0 t1 ...", EOS "t2"), so a Worker can load the folder as it would a real
    checkpoint. Returns the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = save_tiny_hf_model(kind, folder, **overrides)
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf.config.vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t2").save_pretrained(folder)
    return hf
