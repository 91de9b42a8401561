"""One rank's error in a collective Buffer call, shared with its peers.

A rank that raises in a collective Buffer call (`get_dispatch_layout`, `dispatch`,
`combine`, `low_latency_dispatch`, `low_latency_combine`, `low_latency_clean_mask_buffer`,
the constructor's setup once gin-ep's group is joined) first posts its error to the gin-ep
group's failure log (through the group's store). Every wait of a peer in a call (the store
exchanges, the host backend's protocol) follows that log and raises the earliest standing
error at once, named ("rank 0 failed in phase `get_dispatch_layout`: ..."), instead of
waiting out `timeout_s`; a rank whose process exits is reported the same way (its store
connection closes). The rank's next call withdraws its error (the rank went on).
"""

import functools

import torch


def shared_failure(method):
    """Wraps a collective Buffer method: its error is posted for the peers before it is
    raised (the outermost call only; nothing under torch.compile's tracing)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        runtime = self.runtime
        if runtime is None or self._in_call or torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        if self._failure_posted:
            self._failure_posted = False
            # Withdrawing is advice to the peers: a store that is gone (rank 0's group
            # closed after its last call) must not fail this call, which reports its own
            # errors.
            try:
                runtime.begin_call()
            except Exception:
                pass
        self._in_call = True
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            post(self, name, e)
            raise
        finally:
            self._in_call = False

    return call


def post(buffer, call: str, e: Exception) -> None:
    """Posts `e`, raised by this rank in `call`, for the peers; a store that cannot be
    reached leaves `e` as it is (the peers then learn of this rank from their own waits)."""
    try:
        buffer.runtime.report_failure(call, f"{type(e).__name__}: {e}")
        buffer._failure_posted = True
    except Exception:
        pass
