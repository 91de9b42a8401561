"""Events of the host backend: every operation has finished when it returns, so an
event is always complete and waiting on it does nothing."""

from typing import Any, Optional, Tuple


class CompletedEvent:
    """Stands in for DeepEP's `EventHandle` on CPU: already complete."""

    def current_stream_wait(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class EventOverlap:
    """DeepEP's `EventOverlap`: an event plus tensors to keep alive until it completes.

    On the host backend the event (when there is one) is already complete, so
    `current_stream_wait` returns at once and `with` blocks add nothing.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
