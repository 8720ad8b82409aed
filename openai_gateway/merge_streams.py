"""Several Generate streams as one: a completions request with a list of prompts streams them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagedserve_client import Completion


async def merge_streams(
    streams: list[tuple[Completion, AsyncIterator[Completion]]],
) -> AsyncIterator[tuple[int, Completion]]:
    """(stream index, message) from several Generate streams as they arrive; each stream's
    first message is already read. Leaving early closes (cancels) every stream."""
    if len(streams) == 1:  # the common case, without tasks
        first, gen = streams[0]
        try:
            yield 0, first
            async for msg in gen:
                yield 0, msg
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, first: Completion, gen) -> None:
        try:
            await queue.put((p, first, None))
            async for msg in gen:
                await queue.put((p, msg, None))
            await queue.put((p, None, None))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((p, None, e))

    tasks = [asyncio.ensure_future(pump(p, first, gen)) for p, (first, gen) in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            p, msg, error = await queue.get()
            if error is not None:
                raise error
            if msg is None:
                live -= 1
                continue
            yield p, msg
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(gen.aclose() for _, gen in streams), return_exceptions=True)
