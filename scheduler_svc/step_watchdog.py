"""The step watchdog: interrupts a wait on the executor that lasts too long.

A hung executor (stopped, deadlocked, wedged on a device) breaks no stream, so
nothing else would ever end the step loop's wait for its answer. The step loop
arms the watchdog around each send and receive; a checker task wakes a few
times per timeout and, when the armed wait is older than the timeout, cancels
the step loop's task, which turns that cancellation into ExecutorHung.

Why not `asyncio.timeout` around each call: it creates and cancels a timer per
call, measured at 30-50 us each on the dev box (uvloop and asyncio alike),
twice per step; arming here is two clock reads. The price is detection up to
a quarter of the timeout late (at most 1 s).
"""

from __future__ import annotations

import asyncio
import time


class StepWatchdog:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._armed_at: float | None = None
        self._fired = False
        self._checker: asyncio.Task | None = None

    def start(self) -> None:
        """Starts watching the calling task (the step loop)."""
        self._checker = asyncio.ensure_future(self._check(asyncio.current_task()))

    def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None

    def arm(self) -> None:
        self._armed_at = time.monotonic()

    def disarm(self) -> None:
        self._armed_at = None

    def claim(self) -> bool:
        """True if a CancelledError the step loop just caught was this watchdog's (and un-cancels it)."""
        if not self._fired:
            return False
        self._fired = False
        asyncio.current_task().uncancel()
        return True

    async def _check(self, task: asyncio.Task) -> None:
        period = min(self.timeout_s / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            # The step loop is suspended now; armed means it waits inside send or receive,
            # so the cancellation lands there.
            armed_at = self._armed_at
            if armed_at is not None and not self._fired and time.monotonic() - armed_at > self.timeout_s:
                self._fired = True
                task.cancel("step watchdog")
