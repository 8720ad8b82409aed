"""Shared by the attention backend tests (tests/test_attention_*.py): batches
checked against a dense float64 reference.

Every batch comes from `make_batch`: fresh random K/V/queries, shuffled block
tables, and NaN in every cache slot no request owns and in the new tokens'
slots until write_kv fills them, so a stray read or a missing write turns the
output NaN. `run_step` writes outputs into NaN-filled buffers, so an output
element a backend forgets to write fails too.

The Triton kernels run compiled on CUDA tensors where a GPU exists, and
otherwise in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is first imported).
"""

from __future__ import annotations

import dataclasses
import random

import torch

ON_GPU = torch.cuda.is_available()


from executor_svc.attention import get_backend  # noqa: E402
from executor_svc.attention.reference import make_batch  # noqa: E402
from executor_svc.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def triton_backend(block_q: int = 4, block_n: int = 16) -> TritonAttentionBackend:
    """Tiny tiles in the interpreter; the defaults (tl.dot needs >= 16) on a GPU."""
    return TritonAttentionBackend() if ON_GPU else TritonAttentionBackend(block_q=block_q, block_n=block_n)


def backend_named(name: str):
    return get_backend("torch") if name == "torch" else triton_backend()


def to_device(batch):
    if DEVICE == "cpu":
        return batch
    m = batch.meta
    meta = dataclasses.replace(
        m,
        slot_mapping=m.slot_mapping.to(DEVICE),
        query_start_loc=m.query_start_loc.to(DEVICE),
        seq_lens=m.seq_lens.to(DEVICE),
        block_tables=m.block_tables.to(DEVICE),
        extra={},
    )
    moved = {f: getattr(batch, f).to(DEVICE) for f in ("query", "new_key", "new_value", "k_cache", "v_cache")}
    return dataclasses.replace(batch, meta=meta, **moved)


# (cached, new) per request, decodes and prefills interleaved. With block
# size b the cached lengths cover: empty, < b, == b, multiples and
# non-multiples of b, and chunks that start and end mid-block.
def mixed_shapes(b: int) -> list[tuple[int, int]]:
    return [
        (0, 5),  # fresh prefill inside one block
        (2 * b + 3, 1),  # decode, mid-block
        (b - 1, 1),  # decode filling the first block exactly
        (b + 3, 2 * b),  # chunked prefill starting and ending mid-block
        (0, 1),  # one-token prompt
        (b, 1),  # decode opening a new block
        (2 * b, b + 1),  # chunked prefill starting on a block boundary
        (3 * b - 2, 1),  # decode, near the end of a block
        (0, 2 * b),  # fresh prefill of exactly two blocks
    ]


def run_step(backend, batch):
    """prepare, write_kv, forward into a NaN-filled output, as the model runner would."""
    backend.prepare(batch.meta)
    backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
    out = torch.full_like(batch.query, float("nan"))
    result = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, out=out)
    assert result is out
    return out


TOLERANCE = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


def assert_matches_reference(out, batch):
    expected = batch.expected()
    torch.testing.assert_close(out.cpu().to(torch.float64), expected, **TOLERANCE[batch.query.dtype])


def check_mixed_batch(backend, block_size: int, *, on_device: bool = False, **shape) -> None:
    """One step of mixed_shapes(block_size) through `backend`, checked against the float64 reference."""
    batch = make_batch(mixed_shapes(block_size), block_size=block_size, **shape)
    assert_matches_reference(run_step(backend, to_device(batch) if on_device else batch), batch)


def random_shapes(rng: random.Random, max_requests: int, max_cached: int, max_new: int):
    shapes = []
    for _ in range(rng.randint(1, max_requests)):
        if rng.random() < 0.6:
            shapes.append((rng.randint(0, max_cached), 1))
        else:
            shapes.append((rng.randint(0, max_cached), rng.randint(2, max_new)))
    return shapes


def as_fused_qkv_views(batch):
    """The model runner slices q, k, v out of one fused projection: strided views, not contiguous tensors."""
    q, k, v = batch.query, batch.new_key, batch.new_value
    fused = torch.cat([q, k, v], dim=1)
    nq, nk = q.shape[1], k.shape[1]
    views = dict(query=fused[:, :nq], new_key=fused[:, nq : nq + nk], new_value=fused[:, nq + nk :])
    assert not views["query"].is_contiguous() and not views["new_key"].is_contiguous()
    return dataclasses.replace(batch, **views)
