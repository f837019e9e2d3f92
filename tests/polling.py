"""Waiting in end-to-end tests: poll a condition until it holds or time runs out."""

import time


def wait_for(predicate, timeout: float, what: str, diagnose=None, poll: float = 0.25):
    """Poll `predicate` until it returns something true, and return that.

    A timeout fails naming `what`, with `diagnose()` (logs, job state) when given.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    details = f"\n{diagnose()}" if diagnose is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{details}")
