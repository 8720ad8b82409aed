"""CPU attention bench: the torch backend against the alternatives it replaced.

    .venv/bin/python bench/attention_cpu.py [--threads 1] [--rounds 7] [--scenarios decode64,decode256,mixed256]

SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, block size 16).
Each scenario is one step: decodes with contexts uniform in [32, 800] and, in
"mixed", a few chunked prefills. Reports one layer's forward (the model runs
30), as median and min over rounds; the variants run interleaved round by
round so that load from other processes on this shared machine hits them all
alike: compare ratios, not absolute times. "ratio" divides medians by the
shipped backend's, "min ratio" divides minima (the steadier of the two when
other processes steal time). The cache is one layer's, so small batches may
sit in the last-level cache more than they would in a 30-layer model.

Variants:
  torch            the backend as shipped (length-grouped decodes, workspace)
  torch[...]       the same code with other grouping settings
  padded-fresh     all decodes in one padded batch, gathered into freshly
                   allocated tensors (the obvious implementation)
  per-request      one SDPA call per request, no batching
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
import torch.nn.functional as F

from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, LAYERS = 3, 3, 64, 16, 30


def scenario(name: str, rng: random.Random) -> list[tuple[int, int]]:
    def decodes(n):
        return [(rng.randint(32, 800), 1) for _ in range(n)]

    if name == "decode64":
        return decodes(64)
    if name == "decode256":
        return decodes(256)
    if name == "mixed256":
        shapes = decodes(252) + [(0, 256), (256, 256), (512, 128), (0, 64)]
        rng.shuffle(shapes)
        return shapes
    raise ValueError(f"unknown scenario {name!r}")


def padded_fresh(query, k_cache, v_cache, meta, scale):
    """Every decode padded to the longest, gathered into new tensors; prefills one by one."""
    num_tokens, num_heads, head_dim = query.shape
    kv, bs = k_cache.shape[2], meta.block_size
    out = query.new_empty(num_tokens, num_heads, head_dim)
    starts = meta.query_start_loc.tolist()
    dec = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    idx = torch.tensor(dec)
    lengths = meta.seq_lens[idx].to(torch.int64)
    width = int(lengths.max())
    pos = torch.arange(width)
    slots = meta.block_tables[idx].to(torch.int64)[:, pos // bs] * bs + pos % bs
    valid = pos[None, :] < lengths[:, None]
    slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
    k = k_cache.view(-1, kv, head_dim)[slots].view(len(dec), width, kv, head_dim).transpose(1, 2)
    v = v_cache.view(-1, kv, head_dim)[slots].view(len(dec), width, kv, head_dim).transpose(1, 2)
    tokens = torch.tensor([starts[i] for i in dec])
    q = query[tokens].view(len(dec), kv, num_heads // kv, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    out[tokens] = o.reshape(len(dec), num_heads, head_dim)
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            out[starts[i] : starts[i + 1]] = _one_request(query, k_cache, v_cache, meta, scale, i)
    return out


def per_request(query, k_cache, v_cache, meta, scale):
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        out[starts[i] : starts[i + 1]] = _one_request(query, k_cache, v_cache, meta, scale, i)
    return out


def _one_request(query, k_cache, v_cache, meta, scale, i):
    kv, head_dim, bs = k_cache.shape[2], k_cache.shape[3], meta.block_size
    start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
    seq_len = meta.seq_lens_cpu[i]
    pos = torch.arange(seq_len)
    slots = meta.block_tables[i].to(torch.int64)[pos // bs] * bs + pos % bs
    k = k_cache.view(-1, kv, head_dim)[slots].transpose(0, 1)[None]
    v = v_cache.view(-1, kv, head_dim)[slots].transpose(0, 1)[None]
    mask = pos[None, :] <= torch.arange(seq_len - (end - start), seq_len)[:, None]
    q = query[start:end].transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


class BackendVariant:
    """The torch backend with some tuning, prepared on its own copy of the metadata."""

    def __init__(self, meta, **tuning):
        self.backend = TorchAttentionBackend(**tuning)
        self.meta = dataclasses.replace(meta, extra={})  # prepare() stores its plan under the backend's name
        t0 = time.perf_counter()
        self.backend.prepare(self.meta)
        self.prepare_s = time.perf_counter() - t0
        self.groups = len(self.meta.extra[self.backend.name].decode_groups)

    def __call__(self, query, k_cache, v_cache, meta, scale):
        return self.backend.forward(query, k_cache, v_cache, self.meta, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared 2-core box)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scenarios", default="decode64,decode256,mixed256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    variants = {
        "torch": lambda meta: BackendVariant(meta),
        "torch[tol=0.3]": lambda meta: BackendVariant(meta, pad_tolerance=0.3),
        "torch[tol=0.05]": lambda meta: BackendVariant(meta, pad_tolerance=0.05),
        "torch[cap=2k]": lambda meta: BackendVariant(meta, max_group_tokens=2048),
        "torch[cap=32k]": lambda meta: BackendVariant(meta, max_group_tokens=32768),
        "torch[one group]": lambda meta: BackendVariant(meta, pad_tolerance=1.0, max_group_tokens=10**9),
        "padded-fresh": lambda meta: padded_fresh,
        "per-request": lambda meta: per_request,
    }
    print(f"threads={torch.get_num_threads()} rounds={args.rounds}; ms per layer forward; step = x{LAYERS} layers")
    print(
        f"{'scenario':10} {'dtype':9} {'variant':18} {'median':>8} {'min':>8} {'ratio':>6} {'min ratio':>9} "
        f"{'step ms':>8} {'groups':>6}"
    )
    for name in args.scenarios.split(","):
        shapes = scenario(name, random.Random(0))
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            batch = make_batch(
                shapes,
                block_size=BLOCK_SIZE,
                num_kv_heads=NUM_KV_HEADS,
                group=GROUP,
                head_dim=HEAD_DIM,
                dtype=dtype,
                spare_blocks=0,
                poison=0.0,
            )
            batch.keys.clear()  # dense copies are for tests; free the memory
            batch.values.clear()
            runs = {label: make(batch.meta) for label, make in variants.items()}
            shipped = runs["torch"]
            t0 = time.perf_counter()
            shipped.backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, shipped.meta)
            write_ms = (time.perf_counter() - t0) * 1e3
            args_ = (batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
            reference = shipped(*args_).float()
            times = {label: [] for label in runs}
            for _ in range(args.rounds):
                for label, run in runs.items():
                    t0 = time.perf_counter()
                    out = run(*args_)
                    times[label].append(time.perf_counter() - t0)
                    err = (out.float() - reference).abs().max().item()
                    assert err < 5e-2, f"{label} disagrees with the backend by {err}"
            base, base_min = statistics.median(times["torch"]), min(times["torch"])
            for label, ts in times.items():
                med = statistics.median(ts)
                groups = getattr(runs[label], "groups", "")
                print(
                    f"{name:10} {dtype_name:9} {label:18} {med * 1e3:8.2f} {min(ts) * 1e3:8.2f} "
                    f"{med / base:6.2f} {min(ts) / base_min:9.2f} {med * 1e3 * LAYERS:8.0f} {groups!s:>6}"
                )
            print(
                f"{name:10} {dtype_name:9} torch prepare (once a step) {shipped.prepare_s * 1e3:.2f} ms, "
                f"write_kv (per layer) {write_ms:.2f} ms, {batch.meta.num_tokens} tokens, "
                f"{sum(batch.meta.seq_lens_cpu)} context tokens"
            )


if __name__ == "__main__":
    main()
