"""Structured-output back ends compared on the embedded SmolLM2 tokenizer.

    python -m bench.grammar_backends            # llguidance, xgrammar, outlines-core (those installed)

For three real-world JSON schemas, per back end: the time to compile the
schema against the 49,152-token vocabulary, the mean and p99 time to compute
one next-token mask while walking a valid instance token by token, and the
resident memory the compiled grammars added. The packed allowed-token mask is
ceil(V / 32) * 4 bytes for all of them. Also reports whether importing the
back end pulls in torch (the scheduler must stay torch-free). Each back end
runs in its own subprocess so memory and imports are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench.grammar_schemas import SCHEMAS

BACKENDS = ("llguidance", "xgrammar", "outlines_core")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _tokenizer():
    """(tokenizer JSON, eos id, hf tokenizer) of the embedded GGUF, as the executor ships it."""
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import GGUF_NAME, embedded_model_dir

    hf = PreTrainedTokenizerFast.from_pretrained(embedded_model_dir(), gguf_file=GGUF_NAME)
    return hf.backend_tokenizer.to_str(), hf.eos_token_id, hf


class _LLGuidance:
    def __init__(self, tok_json, eos, hf):
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tok_json, eos_token=eos)

    def compile(self, schema):
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def mask(self, m):
        return m.compute_bitmask()

    def advance(self, m, token):
        assert m.consume_token(token), m.get_error()


class _XGrammar:
    def __init__(self, tok_json, eos, hf):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bitmask)

    def advance(self, m, token):
        assert m.accept_token(token)


class _OutlinesCore:
    def __init__(self, tok_json, eos, hf):
        import outlines_core

        self.oc = outlines_core
        # outlines-core wants each token's bytes; undo byte-level BPE's character mapping.
        bs = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        byte_of = {chr(c): b for b, c in zip(bs, cs)}
        vocab: dict[bytes, list[int]] = {}
        for token, i in json.loads(tok_json)["model"]["vocab"].items():
            if i != eos and all(ch in byte_of for ch in token):
                vocab.setdefault(bytes(byte_of[ch] for ch in token), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        import numpy as np

        self.bitmask = np.zeros((len(json.loads(tok_json)["model"]["vocab"]) + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, m):
        m.write_mask_into(self.bitmask.ctypes.data, self.bitmask.size, 4)

    def advance(self, m, token):
        m.advance(token)


def measure(backend: str) -> dict:
    impl = {"llguidance": _LLGuidance, "xgrammar": _XGrammar, "outlines_core": _OutlinesCore}[backend]
    tok_json, eos, hf = _tokenizer()
    # In a clean interpreter: the tokenizer above came through transformers, which imports torch.
    probe = f"import sys, {backend}; print('torch' in sys.modules)"  # ImportError (no torch): "" -> True
    pulls_torch = (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() != "False"
    )
    setup_start = time.perf_counter()
    b = impl(tok_json, eos, hf)
    setup_s = time.perf_counter() - setup_start
    rss0 = _rss_mib()
    out = {"backend": backend, "imports_torch": pulls_torch, "tokenizer_setup_s": round(setup_s, 3), "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            compiled = b.compile(schema)
        except Exception as e:  # a back end that cannot compile a schema is a result, not a crash
            out["schemas"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            continue
        compile_ms = (time.perf_counter() - t0) * 1e3
        tokens = hf.encode(json.dumps(instance), add_special_tokens=False)
        times, first = [], []
        for _ in range(3):
            m = b.matcher(compiled)
            for t in tokens:
                t1 = time.perf_counter()
                b.mask(m)
                times.append(time.perf_counter() - t1)
                b.advance(m, t)
            first.append(times[-len(tokens)])
        times.sort()
        out["schemas"][name] = {
            "compile_ms": round(compile_ms, 1),
            "tokens": len(tokens),
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p99": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1),
            "first_mask_us": round(first[0] * 1e6, 1),
        }
    out["rss_added_mib"] = round(_rss_mib() - rss0, 1)
    out["packed_mask_bytes"] = (hf.backend_tokenizer.get_vocab_size() + 31) // 32 * 4
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # run in a child process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one)))
        return
    for backend in a.backends.split(","):
        r = subprocess.run(
            [sys.executable, "-m", "bench.grammar_backends", "--one", backend],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        print(r.stdout.strip() if r.returncode == 0 else json.dumps({"backend": backend, "error": r.stderr[-400:]}))


if __name__ == "__main__":
    main()
