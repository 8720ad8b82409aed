"""What --gguf-blocks auto costs a bfloat16 model in quality (and, with
--int8-activations, what --gguf-activations int8 costs a float32 one): next-token
agreement and top-5 logprob differences on real English text.

    .venv/bin/python -m bench.bf16_quant_quality [--model PATH.gguf] [--max-tokens 256] [--chunk 32]
        [--gguf-dot] [--int8-activations] [--kv-int8]

Loads the GGUF three times through the executor's loader, as served on CPU
(packed GEMM, KV cache in the model's dtype): bfloat16 widened with the
file's Q4_1/Q8_0 blocks (--gguf-blocks auto), bfloat16 widened with its BF16
blocks only (off), and float32. Each reads the same texts teacher-forced in
steps of --chunk tokens (32 = BLOCKS_MAX_ROWS, so every GEMM of the first
model, the head's included, runs on the file's blocks, as decode batches of
1-32 do; prefills past 32 rows use the BF16 blocks in serving) and keeps
the logits of every position. Prints, for each pair: how often the argmax
agrees, and |logprob difference| over the reference's top 5 tokens (mean,
99th percentile, max).

--gguf-dot adds a load of the first model with every weight the file keeps
in Q4_1 on the route gguf_dot at every row count (activations rounded to
bfloat16, the Q4_1 blocks multiplied with VDPBF16PS or, without it, its
emulation: same arithmetic, slower), as start-up calibration routes decode
batches on a CPU with AVX512-BF16; the head's Q8_0 keeps the float32 loop.

--kv-int8 adds the first model over an int8 KV cache (--kv-cache-dtype int8,
kv_quant.py), compared with it over its bfloat16 cache and with float32;
--chunk 1 runs every position through the decode kernel, else the prefill
kernel reads the cached chunks.

--int8-activations adds another load: float32 with the file's blocks and
--gguf-activations int8 (every GGUF linear takes int8 activations at any
--chunk; a row's result does not depend on the others, so --chunk does not
change its figures), compared with float32 beside bf16 vs float32, the
rounding a bfloat16 default already accepts.

The texts are the docstrings of stdlib modules (real English every Python
ships, as tests/conftest.py english_prompts uses), each cut at --max-tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import torch
from tokenizers import Tokenizer

from executor_svc import packed_linear
from executor_svc.attention import get_backend
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.kv_cache import allocate_kv_caches
from executor_svc.model_loader import load_model

MODULES = (
    "json",
    "logging",
    "argparse",
    "textwrap",
    "threading",
    "collections",
    "subprocess",
    "unittest",
    "pickle",
    "socket",
    "email",
    "typing",
)
BLOCK_SIZE = 16


def texts() -> list[str]:
    docs = [importlib.import_module(m).__doc__ for m in MODULES]
    return [" ".join(d.split()) for d in docs if d]


@torch.inference_mode()
def logits_by_position(model, token_ids: list[int], chunk: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 [len - 1, vocab]: logits after each token but the last, one
    sequence fed `chunk` tokens a step into a paged KV cache."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    kv = allocate_kv_caches(model.config, num_blocks + 1, BLOCK_SIZE, kv_dtype, torch.device("cpu"))
    table = torch.arange(1, num_blocks + 1, dtype=torch.int32).unsqueeze(0)  # block 0 stays unused
    out = []
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        n = end - start
        meta = AttentionMetadata(
            num_tokens=n,
            slot_mapping=torch.arange(start, end, dtype=torch.int64) + BLOCK_SIZE,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table,
            max_query_len=n,
            max_seq_len=end,
            block_size=BLOCK_SIZE,
            query_lens_cpu=[n],
            seq_lens_cpu=[end],
        )
        model.attn_backend.prepare(meta)
        hidden = model(torch.tensor(token_ids[start:end]), torch.arange(start, end), kv, meta)
        out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Argmax agreement and |logprob difference| on `want`'s top 5 tokens."""
    got_lp, want_lp = got.log_softmax(-1), want.log_softmax(-1)
    top5 = want_lp.topk(5, dim=-1).indices
    diff = (got_lp.gather(-1, top5) - want_lp.gather(-1, top5)).abs().flatten()
    return {
        "agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "mean": diff.mean().item(),
        "p99": diff.quantile(0.99).item(),
        "max": diff.max().item(),
    }


def route_gguf_dot(model) -> None:
    """Every linear the file keeps in blocks onto route gguf_dot at every row
    count (packed_linear.route sends the Q8_0 ones to gguf)."""
    for layer in model.layers:
        layer.packed = {n: dataclasses.replace(p, bf16_routes=((1, "gguf_dot"),)) for n, p in layer.packed.items()}
    model._head_packed = dataclasses.replace(model._head_packed, bf16_routes=((1, "gguf_dot"),))
    assert packed_linear.route(1, model.layers[0].packed["gate_up"]) == "gguf_dot"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--gguf-dot", action="store_true", help="also bf16 with the Q4_1 blocks on route gguf_dot")
    p.add_argument("--int8-activations", action="store_true", help="also float32 with --gguf-activations int8")
    p.add_argument("--kv-int8", action="store_true", help="also bf16+gguf over an int8 KV cache")
    a = p.parse_args(argv)
    torch.set_num_threads(a.num_threads)
    variants = {  # name: (dtype, GGUF blocks, int8 activation rows, KV cache dtype)
        "bf16+gguf": (torch.bfloat16, True, 0, torch.bfloat16),
        "bf16": (torch.bfloat16, False, 0, torch.bfloat16),
        "float32": (torch.float32, True, 0, torch.float32),
    }
    pairs = [("bf16+gguf", "bf16"), ("bf16+gguf", "float32"), ("bf16", "float32")]
    if a.gguf_dot:
        variants["bf16+gguf_dot"] = (torch.bfloat16, True, 0, torch.bfloat16)
        pairs += [("bf16+gguf_dot", "bf16"), ("bf16+gguf_dot", "float32"), ("bf16+gguf_dot", "bf16+gguf")]
    if a.int8_activations:
        assert packed_linear.kernel().int8_native, "--int8-activations needs AVX512-VNNI"
        variants["float32+int8"] = (torch.float32, True, packed_linear.INT8_MAX_ROWS, torch.float32)
        pairs.append(("float32+int8", "float32"))
    if a.kv_int8:
        variants["bf16+gguf+kv8"] = (torch.bfloat16, True, 0, torch.int8)
        pairs += [("bf16+gguf+kv8", "bf16+gguf"), ("bf16+gguf+kv8", "float32")]
    logits, tokenizer = {}, None
    for name, (dtype, blocks, int8_rows, kv_dtype) in variants.items():
        loaded = load_model(
            a.model, dtype, "cpu", get_backend("cpu"), packed_gemm=True, gguf_blocks=blocks, int8_rows=int8_rows
        )
        if name == "bf16+gguf_dot":
            route_gguf_dot(loaded.model)
        if tokenizer is None:
            tokenizer = Tokenizer.from_str(loaded.tokenizer.tokenizer_json)
            docs = [tokenizer.encode(t, add_special_tokens=False).ids[: a.max_tokens] for t in texts()]
        logits[name] = [logits_by_position(loaded.model, ids, a.chunk, kv_dtype) for ids in docs]
        del loaded
    positions = sum(len(ids) - 1 for ids in docs)
    print(f"{len(docs)} stdlib docstrings, {positions} positions, teacher-forced {a.chunk} tokens a step")
    print(f"{'model vs reference':27} {'argmax agrees':>14} {'top-5 |dlogp| mean':>19} {'p99':>7} {'max':>7}")
    for got, want in pairs:
        r = compare(torch.cat(logits[got]), torch.cat(logits[want]))
        print(f"{got + ' vs ' + want:27} {100 * r['agree']:13.2f}% {r['mean']:19.4f} {r['p99']:7.3f} {r['max']:7.3f}")


if __name__ == "__main__":
    main()
