"""`deep_ep`, provided by gin-ep: DeepEP V1's module name over `gin_ep`, so frameworks that
`import deep_ep` (vLLM gates its DeepEP backends on `importlib.util.find_spec("deep_ep")`,
SGLang, Megatron, NeMo) run on gin-ep unmodified. Everything here is gin_ep's own object;
python/README.md lists what still differs from DeepEP. Installing gin-ep beside DeepEP
makes `deep_ep` ambiguous: install one of them."""

from gin_ep import Buffer, Config, EventHandle, EventOverlap, topk_idx_t
from gin_ep import __version__ as gin_ep_version

from . import utils

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils"]
