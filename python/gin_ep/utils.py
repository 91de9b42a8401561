"""Events: DeepEP's `EventHandle` and `EventOverlap`. On the host backend every operation
has finished when it returns, so its events are complete and waiting on them does nothing;
on the GPU path they are CUDA events on the current stream."""

from typing import Any, Optional, Tuple

import torch


class CompletedEvent:
    """Stands in for DeepEP's `EventHandle` on CPU: already complete."""

    def current_stream_wait(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class EventHandle:
    """DeepEP's `EventHandle()`: an event recorded on the current CUDA stream when PyTorch's
    CUDA is in use, else one that is already complete (CPU)."""

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


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
