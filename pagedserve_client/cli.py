"""`pagedserve`: the command line.

    pagedserve serve [MODEL] [--port 50051] [--openai-port 8000 | --no-openai] ...   # start a server
    pagedserve generate "Write a haiku about paging"        # streams text
    pagedserve generate --chat "What is a KV cache?"        # applies the chat template
    pagedserve status | model | tokenize TEXT | health
    pagedserve --version

Everything but `serve` is a client and needs no torch; `serve` imports the
server side (shared/launch.py) only when asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import grpc

from pagedserve_client.client import Client


def _health(client: Client, target: str, service: str, timeout: float) -> int:
    from grpc_health.v1 import health_pb2

    try:
        code = client.health(service, timeout=timeout)
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}", file=sys.stderr)
        return 1
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(code)}")
    return 0 if code == health_pb2.HealthCheckResponse.SERVING else 1


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("pagedserve")
    except PackageNotFoundError:
        return "unknown (not installed as a package)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # its flags pass through to the services: the launcher parses them
        from shared.launch import main as serve

        return serve(argv[1:])
    p = argparse.ArgumentParser(prog="pagedserve", description="PagedServe: serve a model, or talk to a server.")
    p.add_argument("--version", action="version", version=f"pagedserve {version()}")
    p.add_argument(
        "--target",
        default=os.environ.get("PAGEDSERVE_TARGET", "127.0.0.1:50051"),
        help="Scheduler address [env PAGEDSERVE_TARGET].",
    )
    p.add_argument("--token", default=os.environ.get("PAGEDSERVE_TOKEN"), help="Bearer token [env PAGEDSERVE_TOKEN].")
    p.add_argument("--tls-ca", default=None, help="CA bundle to verify a TLS server.")
    p.add_argument("--tls-cert", default=None, help="Client certificate (PEM) for mutual TLS; needs --tls-key.")
    p.add_argument("--tls-key", default=None, help="Client private key (PEM) for mutual TLS.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "serve", help="Start executor, scheduler and OpenAI gateway (pagedserve serve --help).", add_help=False
    )
    g = sub.add_parser("generate", help="Stream a completion.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="Send the prompt as one user message through the chat template.")
    g.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy; unset = the server's default.")
    g.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass.")
    g.add_argument("--top-k", type=int, default=None, help="Sample among the k most likely tokens.")
    g.add_argument("--seed", type=int, default=None, help="Reproducible sampling.")
    g.add_argument("--stop", action="append", default=[], help="A stop string (repeatable).")
    g.add_argument("--json", action="store_true", help="Print each response message as JSON.")
    sub.add_parser("status", help="Server status (KV blocks, queue).")
    sub.add_parser("model", help="Model info.")
    t = sub.add_parser("tokenize", help="Tokenize text.")
    t.add_argument("text")
    h = sub.add_parser("health", help="gRPC health check; exit 0 when SERVING.")
    h.add_argument("--service", default="")
    h.add_argument("--timeout", type=float, default=3.0)
    a = p.parse_args(argv)

    from google.protobuf.json_format import MessageToDict

    with Client(a.target, token=a.token, tls_ca=a.tls_ca, tls_cert=a.tls_cert, tls_key=a.tls_key) as c:
        if a.cmd == "health":
            return _health(c, a.target, a.service, a.timeout)
        try:
            if a.cmd == "generate":
                prompt = dict(messages=[{"role": "user", "content": a.prompt}]) if a.chat else dict(prompt=a.prompt)
                usage = None
                for msg in c.generate(
                    **prompt,
                    max_tokens=a.max_tokens,
                    temperature=a.temperature,
                    top_p=a.top_p,
                    top_k=a.top_k,
                    seed=a.seed,
                    stop=a.stop,
                ):
                    if a.json:
                        print(json.dumps(dataclasses.asdict(msg)))
                    else:
                        print(msg.text, end="", flush=True)
                    if msg.usage is not None:
                        usage = msg.usage
                if not a.json and usage is not None:
                    print(
                        f"\n[{usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} cached), "
                        f"{usage.completion_tokens} generated]",
                        file=sys.stderr,
                    )
            elif a.cmd == "status":
                print(json.dumps(MessageToDict(c.server_status(), always_print_fields_with_no_presence=True), indent=2))
            elif a.cmd == "model":
                print(json.dumps(MessageToDict(c.model_info()), indent=2))
            elif a.cmd == "tokenize":
                print(json.dumps(c.tokenize(a.text)))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except ValueError as e:  # a value the request cannot carry, caught before sending
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # leaving the stream cancels the request on the server
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
