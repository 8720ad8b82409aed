"""An optional OpenAI-compatible HTTP gateway in front of the PagedServe scheduler.

    python -m openai_gateway --listen 127.0.0.1:8000 --scheduler 127.0.0.1:50051

A thin translation layer (OpenAI JSON <-> `pagedserve.v1.Generation` over gRPC);
all scheduling stays in the scheduler.
"""
