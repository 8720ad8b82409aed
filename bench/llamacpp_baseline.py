"""Optional peer: the same throughput workload through llama.cpp's `llama-server`.

llama.cpp is what most people run a GGUF file with on a CPU, so it is the
peer for the embedded model as shipped: it reads the file's Q4_1/Q8_0 blocks
itself, with its own defaults (int8 activations against those blocks, an
f16 KV cache), where PagedServe's default dequantizes to float32. The two
therefore do the same work at different precisions; the ratio says what a
user switching from one to the other would see.

`run()` starts `llama-server` with one slot per request (continuous
batching across all of them, as PagedServe runs them), a context that
holds every request at once, and the executor's thread count; it sends all
requests at once to `/completion` as token ids (greedy, ignore_eos, no
prompt cache), and times them until the last finishes, after a warm-up
request. Only the standard library is used: llama.cpp is a binary, built
as docs/benchmarks.md describes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while loading")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"llama-server not healthy after {timeout_s} s")


def run(server: str, requests, model: str, num_threads: int = 0, timeout_s: float = 3600) -> dict:
    """Runs the requests through `server` (the llama-server binary) over the
    GGUF file `model`; the result dict, or {"error": ...} if it failed."""
    try:
        version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return dict(error=f"{type(e).__name__}: {e}", server=server)
    # It prints e.g. "version: 1 (0c1e570)" and the compiler, on stderr.
    version = next((ln for ln in (version.stderr + version.stdout).splitlines() if ln.startswith("version")), "?")
    threads = num_threads or len(os.sched_getaffinity(0))
    slots = len(requests)
    per_slot = max(r.prompt_len + r.max_tokens for r in requests) + 16
    port = _free_port()
    # -np: a slot per request; -c: the context of all slots together; -b/-ub:
    # llama.cpp's logical and physical batch (its defaults, written out).
    cmd = [server, "-m", model, "-np", str(slots), "-c", str(per_slot * slots), "-t", str(threads)]
    cmd += ["-tb", str(threads), "-b", "2048", "-ub", "512", "--host", "127.0.0.1", "--port", str(port)]
    print(f"[throughput] running llama.cpp: {' '.join(cmd)}", file=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        except OSError as e:
            return dict(error=f"{type(e).__name__}: {e}", server=server)
        try:
            _wait_healthy(base, proc, 300)
            ask = dict(temperature=0.0, ignore_eos=True, cache_prompt=False, stream=False)
            _post(base + "/completion", dict(ask, prompt=[200, 300, 400, 500], n_predict=4), timeout_s)  # warm-up

            def one(r) -> dict:
                return _post(
                    base + "/completion", dict(ask, prompt=r.prompt_token_ids, n_predict=r.max_tokens), timeout_s
                )

            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(slots) as pool:
                answers = list(pool.map(one, requests))
            elapsed = time.perf_counter() - start
            out_tokens = sum(a["tokens_predicted"] for a in answers)
        except (OSError, RuntimeError, TimeoutError, ValueError, KeyError) as e:
            log.seek(0)
            tail = "\n".join(log.read().splitlines()[-20:])
            return dict(error=f"{type(e).__name__}: {e}\n{tail}"[-2000:], server=server)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    prompt_tokens = sum(r.prompt_len for r in requests)
    want = sum(r.max_tokens for r in requests)
    if out_tokens != want:
        return dict(error=f"llama.cpp produced {out_tokens} tokens, the requests asked for {want}", server=server)
    return dict(
        duration_s=elapsed,
        requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=out_tokens / elapsed,
        total_tokens_per_s=(out_tokens + prompt_tokens) / elapsed,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        server=server,
        version=version,
        model=model,
    )
