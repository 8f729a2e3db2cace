"""A process dying mid-run, for the resume tests: an exception nothing in the run may catch, and a
FakeGrid interceptor that raises it at a chosen message. A module of its own, not the folder's
conftest, so that importing it never depends on which conftest pytest loaded last."""

from collections.abc import Callable

from flwr.app import Message

from training import protocol


class Killed(BaseException):
    """Stands in for a process dying: nothing in the run may catch it."""


def kill_in_round(round_: int, message_type: str | None = None, at: int = 1,
                  before: Callable[[], None] | None = None) -> Callable[[Message, Message], Message]:
    """A FakeGrid interceptor that raises Killed at the `at`-th message of round `round_` (of
    `message_type`, when given) its node receives, after calling `before` (a dying client process
    loses what it held in memory)."""
    seen = []

    def intercept(message: Message, reply: Message) -> Message:
        if message.content.config_records[protocol.CONFIG]["round"] == round_ and message_type in (
                None, message.metadata.message_type):
            seen.append(message)
            if len(seen) == at:
                if before is not None:
                    before()
                raise Killed
        return reply

    return intercept
