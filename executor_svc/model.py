"""Our Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

One forward runs a packed batch of new tokens from several requests (see
AttentionMetadata); each layer appends the new K/V to the paged cache through
the attention backend and attends over everything cached so far:

    h = embed(input_ids)                                      [T, hidden]
    per layer:
        qkv = rms_norm(h) @ W_qkv (+ b_qkv)                   [T, (Hq + 2 Hkv) * D]
        q, k = rope(q, k at positions);  v
        write_kv(k, v -> slots);  o = attention(q over cache)  [T, Hq, D]
        h = h + o @ W_o
        gate, up = rms_norm(h) @ W_gate_up                    [T, 2 I]
        h = h + (silu(gate) * up) @ W_down
    return rms_norm(h)

Each residual add is fused into the RMSNorm that follows it (`add_rms_norm`):
a layer takes the residual stream h and the previous layer's last output
`delta`, and returns them as (h, delta) for the next layer to add.

Numerics follow transformers' Llama so greedy outputs match it token for
token: RMSNorm normalises in float32 and rounds before the weight multiply
(layer_ops.py), rotary (rope.py) uses the "rotate_half" layout with cos/sin computed in float32, and
logits are computed in the model dtype before the cast to float32. (A
bfloat16 model widened for CPUs without bf16 arithmetic, `weight_packing.widen_bf16`,
computes in float32 over its bfloat16 weights instead.) The native bfloat16
norm, rope and gate (fused_ops.py) round to bfloat16 wherever the plain-torch
code in layer_ops.py and rope.py does, so a bf16 model gets the same values either way, up to one
bf16 step where a sum or an exp is computed in another order.

This file is the architecture only. The native CPU GEMM's packed copies of
the weights are made after loading, by weight_packing.py, into the slots the
model keeps for them (`DecoderLayer.packed`, `_head_packed`, `_tied_head`).
The linear layers and the norms run through `Kernels` (packed_linear.linear
and layer_ops.add_rms_norm by default), which --deterministic on CUDA replaces
with batch-invariant Triton kernels (triton_invariant/hook.py).

Weights are loaded by `load_weights` from tensors under transformers' names
("model.layers.3.self_attn.q_proj.weight", ...); the GGUF loader renames to
those, so one mapping serves both formats. Parameters are created empty (no
random init: loading a checkpoint overwrites every one of them).

Tensor parallelism (Megatron-style; `tp_size` > 1, one process per rank, the
default torch.distributed group spanning them): rank r holds heads
[r*Hq/tp, (r+1)*Hq/tp) of q and the matching share of KV heads, and the same
share of the MLP's intermediate columns. Each layer then needs two all-reduces:

    qkv  = x @ W_qkv[rank's rows]     column-parallel: local heads only, no communication
    o    = attn @ W_o[:, rank's cols] row-parallel: a partial sum ... all_reduce(o)
    gate_up = x @ W_gate_up[rank's rows]; down likewise row-parallel ... all_reduce

Embeddings, norms and the LM head are replicated on every rank (simplest; a
vocab-parallel head would save memory for large vocabularies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from executor_svc.attention.backend import AttentionBackend
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.gemm_epilogues import argmax_dot
from executor_svc.layer_ops import Kernels, mlp, norm_for_gemm
from executor_svc.model_config import ModelConfig
from executor_svc.packed_linear import PackedWeight, linear
from executor_svc.rope import apply_rope, rope_cache
from executor_svc.sampler import argmax

if TYPE_CHECKING:
    from executor_svc.decoder_stack import DecoderStack

KVCache = tuple[torch.Tensor, torch.Tensor]


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _empty_linear(out_features: int, in_features: int, *, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A [out, in] weight stored transposed (column-major).

    F.linear(x, w) multiplies x by w.t(), which is then a contiguous [in, out]
    matrix: MKL's float32 GEMM runs that layout 2-4x faster than the row-major
    one for 8-63 rows (small decode batches) and as fast for larger ones
    (docs/optimization_log.md, "Linear weights stored column-major"). Loading
    is unchanged: copy_ into a view writes through any strides.
    """
    return nn.Parameter(torch.empty(in_features, out_features, dtype=dtype, device=device).t(), requires_grad=False)


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raises ValueError unless `tp_size` splits the model into equal whole shares."""
    shares = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name}={n}" for name, n in shares.items() if n % tp_size]
    if bad:
        fits = [d for d in range(1, config.num_key_value_heads + 1) if all(n % d == 0 for n in shares.values())]
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide {', '.join(bad)} of {config.model_name or 'this model'}: "
            "each rank must hold whole attention and KV heads (replicating KV heads across ranks is not "
            f"implemented); sizes that fit this model: {', '.join(map(str, fits))}"
        )


# Each fused linear weight of a layer: the checkpoint tensors stacked in its
# rows (under "model.layers.N."), and the dimension tensor parallelism cuts
# (0: rows, column-parallel; 1: columns, row-parallel).
LINEAR_PARTS = {
    "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), 0),
    "o": (("self_attn.o_proj",), 1),
    "gate_up": (("mlp.gate_proj", "mlp.up_proj"), 0),
    "down": (("mlp.down_proj",), 1),
}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        # This rank's share; with tp_size == 1, the whole model.
        hidden, inter = config.hidden_size, config.intermediate_size // tp_size
        self.attn_backend = attn_backend
        self.eps = config.rms_norm_eps
        self.tp_size = tp_size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.input_norm = _empty_param(hidden, dtype=dtype, device=device)
        # Rows: [q heads | k heads | v heads]; one matmul instead of three.
        self.qkv_weight = _empty_linear(qkv_size, hidden, dtype=dtype, device=device)
        self.qkv_bias = _empty_param(qkv_size, dtype=dtype, device=device) if config.attention_bias else None
        self.o_weight = _empty_linear(hidden, self.num_heads * self.head_dim, dtype=dtype, device=device)
        self.post_norm = _empty_param(hidden, dtype=dtype, device=device)
        # Rows: [gate | up].
        self.gate_up_weight = _empty_linear(2 * inter, hidden, dtype=dtype, device=device)
        self.down_weight = _empty_linear(hidden, inter, dtype=dtype, device=device)
        # Packed copies for the native CPU GEMM, by weight name ("qkv", "o",
        # "gate_up", "down"); empty unless weight_packing.py filled them.
        self.packed: dict[str, PackedWeight] = {}
        self.kernels = Kernels()  # set for the whole model by LlamaForCausalLM.use_kernels

    def part_rows(self, name: str) -> list[int]:
        """This rank's rows of each of LINEAR_PARTS[name]'s tensors, in order."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.down_weight.shape[1]
        return {"qkv": [q, kv, kv], "gate_up": [inter, inter]}.get(name) or [getattr(self, f"{name}_weight").shape[0]]

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream h, previous layer's output delta or None) -> the same
        pair for the next layer; h is updated in place."""
        num_tokens = h.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        ops = self.kernels
        x = norm_for_gemm(ops, h, delta, self.input_norm, self.eps, self.packed.get("qkv"))
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias, self.packed.get("qkv"))
        qkv = qkv.view(num_tokens, qk_heads + self.num_kv_heads, self.head_dim)
        # q and k rotate together: one set of rope kernels for both.
        qk = apply_rope(qkv[:, :qk_heads], cos, sin_signed)
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, qk_heads:]
        k_cache, v_cache = kv_cache
        self.attn_backend.write_kv(k, v, k_cache, v_cache, meta)
        attn = self.attn_backend.forward(q, k_cache, v_cache, meta, self.scale)
        attn_out = self._reduce(ops.linear(attn.reshape(num_tokens, -1), self.o_weight, None, self.packed.get("o")))

        x = norm_for_gemm(ops, h, attn_out, self.post_norm, self.eps, self.packed.get("gate_up"))
        down = mlp(
            x, self.gate_up_weight, self.down_weight, self.packed.get("gate_up"), self.packed.get("down"), ops.linear
        )
        return h, self._reduce(down)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sums a row-parallel output over the ranks (in place); nothing to do on one rank."""
        if self.tp_size > 1:
            dist.all_reduce(partial)
        return partial


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        check_tensor_parallel(config, tp_size)
        assert 0 <= tp_rank < tp_size, f"tp_rank {tp_rank} outside 0..{tp_size - 1}"
        device = torch.device(device)
        self.config = config
        self.attn_backend = attn_backend
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.embed_tokens = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attn_backend, dtype, device, tp_size) for _ in range(config.num_hidden_layers)
        )
        self.norm = _empty_param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _empty_linear(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        # Tied embeddings share the embedding's row-major weight (row lookups
        # need it), except on CPU, where load_weights adds a column-major copy
        # for the head's faster GEMM: vocab x hidden more memory there. Not a
        # parameter: state dicts keep the checkpoint's tensors only.
        self._tied_head: torch.Tensor | None = None
        self._head_packed: PackedWeight | None = None  # filled by weight_packing.py
        # The activations' dtype: the weights' own, except after weight_packing.widen_bf16().
        self.compute_dtype = dtype
        self.kernels = Kernels()
        cos, sin_signed = rope_cache(config, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", sin_signed, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        stack: DecoderStack | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden].

        The caller runs attn_backend.prepare(meta) once per step before this.
        `stack` (built over these kv_caches) runs the layers in one native
        call where it takes the step, with the same result (decoder_stack.py).
        """
        assert len(kv_caches) == len(self.layers), f"got {len(kv_caches)} KV caches for {len(self.layers)} layers"
        cos = self.rope_cos[positions]
        sin_signed = self.rope_sin_signed[positions]
        h, delta = F.embedding(input_ids, self.embed_tokens).to(self.compute_dtype), None
        if stack is not None and (out := stack.forward(h, cos, sin_signed, meta, kv_caches)) is not None:
            return out
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, delta = layer(h, delta, cos, sin_signed, kv_cache, meta)
        return self.kernels.add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32."""
        head = self.lm_head if self.lm_head is not None else self._tied_head
        weight = self.embed_tokens if head is None else head
        return self.kernels.linear(hidden, weight, None, self._head_packed).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> int64 [S]: each row's argmax of compute_logits(hidden)
        (its first largest index, or first NaN's), the sampler's greedy answer.
        Where the head's GEMM takes the bf16 dot route (a batch of decodes on
        a CPU with AVX512-BF16), its tiles are reduced in place and the
        [S, vocab] logits are never written: 12.6 MB written and read back
        at 64 rows of the embedded model (gemm_epilogues.argmax_dot)."""
        if self.kernels.linear is linear and (tokens := argmax_dot(hidden, None, self._head_packed)) is not None:
            return tokens
        return argmax(self.compute_logits(hidden))

    def use_kernels(self, kernels: Kernels) -> None:
        """Runs every layer's linears and norms, the final norm and the head through `kernels`."""
        self.kernels = kernels
        for layer in self.layers:
            layer.kernels = kernels

    @torch.no_grad()
    def load_weights(self, tensor: Callable[[str], torch.Tensor]) -> None:
        """Fills every parameter from `tensor(hf_name)`, which raises for a missing name.

        q/k/v and gate/up are copied into their slices of the fused matrices;
        each copy casts to this model's dtype and device. With tensor
        parallelism, `split` names the dimension cut into tp_size equal shares,
        of which this rank keeps share tp_rank: rows (output features) of the
        column-parallel q/k/v/gate/up, columns (input features) of the
        row-parallel o/down. Whole heads stay together because a projection's
        rows are laid out head by head.
        """

        def fill(dst: torch.Tensor, name: str, split: int | None = None) -> None:
            src = tensor(name)
            full = list(dst.shape)
            if split is not None:
                full[split] *= self.tp_size
            if list(src.shape) != full:
                raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(full)}")
            if split is not None and self.tp_size > 1:
                share = dst.shape[split]
                src = src.narrow(split, self.tp_rank * share, share)
            dst.copy_(src)

        fill(self.embed_tokens, "model.embed_tokens.weight")
        fill(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            fill(self.lm_head, "lm_head.weight")
        elif self.embed_tokens.device.type == "cpu":
            self._tied_head = self.embed_tokens.t().contiguous().t()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            fill(layer.input_norm, p + "input_layernorm.weight")
            fill(layer.post_norm, p + "post_attention_layernorm.weight")
            for name, (parts, split) in LINEAR_PARTS.items():
                rows = getattr(layer, f"{name}_weight").split(layer.part_rows(name))
                for part, dst in zip(parts, rows):
                    fill(dst, f"{p}{part}.weight", split)
            if layer.qkv_bias is not None:
                for part, dst in zip(LINEAR_PARTS["qkv"][0], layer.qkv_bias.split(layer.part_rows("qkv"))):
                    fill(dst, f"{p}{part}.bias", split=0)
