"""Batch-invariant Triton kernels for --deterministic on CUDA (docs/determinism.md):
the linear layers and LM head (matmul.py), RMSNorm with its residual add
(rms_norm.py) and the sampler's row reductions (rows.py). Each fixes the
order of every sum that makes one row's result before it knows how many
rows there are; hook.py installs them into a loaded model.
"""
