"""Optional third system: the same throughput workload in vLLM's CPU build.

vLLM lives in its own venv (its torch differs from ours), so this file has two
halves. `run()` is called from bench's venv: it writes the requests to a
temporary JSON file and starts this same file as a script under the vLLM
interpreter, which times `LLM.generate` on them and prints a JSON line back.
Nothing here imports beyond the standard library at module level, so the
script half runs in a venv that has vLLM and none of PagedServe.

vLLM reads GGUF models only with a separate Hugging Face tokenizer, and not
every GGUF quantization on CPU, so by default the embedded GGUF is turned once
into a Hugging Face folder (transformers dequantizes it on load, the same
weights PagedServe dequantizes) and vLLM loads that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HF_FOLDER = os.path.join(tempfile.gettempdir(), "smollm2-hf")
RESULT_MARK = "VLLM_RESULT "


def prepare_hf_folder(path: str = HF_FOLDER) -> str:
    """Saves the embedded GGUF as a float32 HF folder (config, safetensors, tokenizer) once."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.hf_baseline import GGUF_FILE, embedded_model_dir

    d = embedded_model_dir()
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF ("quantized, not
    # serializable") although its weights are already dequantized: copy them
    # into a plain model built from the same config and save that.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(path)
    AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE).save_pretrained(path)
    return path


def run(
    vllm_python: str, requests, dtype: str, model: str | None = None, num_threads: int = 0, timeout_s: float = 3600
) -> dict:
    """Runs the requests in vLLM under vllm_python; the result dict, or {"error": ...} if vLLM failed."""
    model = model or prepare_hf_folder()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        req_file = os.path.join(tmp, "requests.json")
        with open(req_file, "w") as f:
            json.dump([[r.prompt_token_ids, r.max_tokens, r.temperature, r.top_p, r.top_k] for r in requests], f)
        threads = num_threads or len(os.sched_getaffinity(0))
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        cmd = [vllm_python, os.path.abspath(__file__), req_file, model, dtype]
        print(f"[throughput] running vLLM: {' '.join(cmd)}", file=sys.stderr)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return dict(error=f"{type(e).__name__}: {e}", model=model)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :]) | dict(model=model)
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-30:])
    print(f"[throughput] vLLM failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return dict(error=f"exit {proc.returncode}: {tail[-2000:]}", model=model)


def _script(req_file: str, model: str, dtype: str) -> None:
    """Runs inside the vLLM venv."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(req_file) as f:
        reqs = json.load(f)
    max_len = max(len(ids) + n for ids, n, *_ in reqs)
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max(1024, max_len), seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, *_ in reqs]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=n, ignore_eos=True) for _, n, t, p, k in reqs]
    llm.generate(
        prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False
    )  # warm-up, not timed
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(ids) for ids, *_ in reqs)
    want = sum(n for _, n, *_ in reqs)
    assert out_tokens == want, f"vLLM produced {out_tokens} tokens, the requests asked for {want}"
    import vllm

    print(
        RESULT_MARK
        + json.dumps(
            dict(
                version=vllm.__version__,
                dtype=dtype,
                duration_s=elapsed,
                requests_per_s=len(reqs) / elapsed,
                output_tokens_per_s=out_tokens / elapsed,
                total_tokens_per_s=(out_tokens + prompt_tokens) / elapsed,
                output_tokens=out_tokens,
                prompt_tokens=prompt_tokens,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    _script(*sys.argv[1:4])
