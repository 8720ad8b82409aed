"""Requests waiting for admission, ordered by (priority, arrival), preempted ones first."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from scheduler_svc.request import Request


class WaitingQueue:
    """Requests waiting for admission, lowest priority value first.

    Within a priority: pushed-to-front requests (preempted ones; the most
    recently pushed first), then arrivals in arrival order.
    """

    def __init__(self) -> None:
        # (priority, 0 = front / 1 = arrival, order within that, tie-break, request)
        self._heap: list[tuple[int, int, float, int, Request]] = []
        self._tie = itertools.count()
        self._front = itertools.count(1)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, 1, request.arrival_time, next(self._tie), request))

    def push_front(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, 0, -next(self._front), next(self._tie), request))

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        """O(n); for aborts, and for preempted requests that their last in-flight sample finished."""
        index = next(i for i, entry in enumerate(self._heap) if entry[-1] is request)
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)
