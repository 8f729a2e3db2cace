"""The server awaits each reply by pulling soon and then less often, never past the timeout."""

import time

from strategies.base import REPLY_POLL_MAX_S, send_and_await


class SlowGrid:
    """A grid whose reply lands `ready_after` seconds after the push (never, for None)."""

    def __init__(self, ready_after: float | None) -> None:
        self.ready_after, self.pulls, self.pushed_at = ready_after, 0, None

    def push_messages(self, messages):
        self.pushed_at = time.monotonic()
        self.message = list(messages)[0]
        return ["id-1"]

    def pull_messages(self, message_ids):
        self.pulls += 1
        assert set(message_ids) == {"id-1"}
        landed = self.ready_after is not None and time.monotonic() - self.pushed_at >= self.ready_after
        return ["the reply"] if landed else []


def query() -> object:
    return object()  # the grid only passes it on


def test_a_reply_is_picked_up_within_the_longest_pause_of_landing():
    grid = SlowGrid(ready_after=0.15)
    started = time.monotonic()
    reply = send_and_await(grid, query(), timeout=5)
    waited = time.monotonic() - started
    assert reply == "the reply"
    # Flower's own loop would wait for its next 0.1 s (simulation) or 3 s (HTTP) pull.
    assert 0.15 <= waited < 0.15 + REPLY_POLL_MAX_S + 0.05
    assert grid.pulls > 3


def test_no_reply_gives_none_at_the_timeout():
    grid = SlowGrid(ready_after=None)
    started = time.monotonic()
    assert send_and_await(grid, query(), timeout=0.2) is None
    assert 0.2 <= time.monotonic() - started < 0.2 + REPLY_POLL_MAX_S + 0.05
