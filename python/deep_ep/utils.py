"""`deep_ep.utils` (Megatron and NeMo: `from deep_ep.utils import EventHandle, EventOverlap`)."""

from gin_ep.utils import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
