#!/usr/bin/env bash
# The one prepared run on a lent CUDA machine (an H200 with nothing reachable
# from it): every GPU check of the project in one call, each bounded in time
# so that the whole ends inside ten minutes, logs written to $OUT.
#
# Here, once (generated stubs and the wheels the GPU image lacks, Python 3.12):
#   make protos
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#     grpcio==1.85.3 protobuf==7.36.2 grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-status==1.85.3 googleapis-common-protos==1.76.0 structlog==26.1.0 gguf==0.19.0 llguidance==1.9.1
# Then through the device tool: run `bash tools/device_check.sh`, carry [".whl", "pagedserve"].
#
# 1. bench/cuda_check.py: real scheduler + executor processes on the GPU
#    against transformers (float32, bfloat16, with and without CUDA graphs),
#    throughput, --deterministic.
# 2. bench/cuda_decode_steps.py: in-process decode and mixed steps, graphs vs eager.
# 3. bench/gpu_check.py --quick: the --deterministic Triton kernels against
#    float64, their batch invariance in bits, their cost beside cuBLAS.
# 4. The Triton attention, sampler, invariant-kernel and CUDA-graph tests,
#    which run compiled on a GPU (in Triton's interpreter everywhere else).
# The first such run (2026-12-04) took 4 minutes, the second 5.3; docs/optimization_log.md
# ("The first run on a GPU", "Prefill and mixed steps from CUDA graphs") has what they found.
set -u
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  lscpu | grep -E 'Model name'
} 2>&1 | tee "$OUT/env.log"

section() { echo "=== $1 ($(date -u +%T))"; }
section cuda_check
timeout 270 python3 -m bench.cuda_check --out-dir "$OUT" 2>&1 | grep -v -E 'Loading weights|Writing model' | tee "$OUT/cuda_check.log"
section cuda_decode_steps
timeout 120 python3 -m bench.cuda_decode_steps 2>&1 | grep -v -E 'Loading weights|Writing model' | tee "$OUT/cuda_decode_steps.log"
section gpu_check
timeout 90 python3 -m bench.gpu_check --quick --rounds 10 2>&1 | tee "$OUT/gpu_check.log"
section pytest
timeout 180 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfEs \
  tests/test_attention_triton.py tests/test_attention_contract.py tests/test_attention_prefill_groups.py \
  tests/test_deterministic_kernels.py tests/test_triton_invariant.py tests/test_cuda_graphs.py \
  "tests/test_sampler.py::test_cuda_matches_cpu_for_seeded_and_greedy_rows" 2>&1 | tee "$OUT/pytest.log"
section done
