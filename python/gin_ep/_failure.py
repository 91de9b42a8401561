"""One rank's error in a collective Buffer call, shared with its peers.

A rank that raises in `get_dispatch_layout`, `dispatch` or `combine` (bad input found before
the collective, or an error during it) first leaves its error in the gin-ep group's store. A
peer waiting for that rank in the store (the shape agreement, the per-rank count exchange)
raises that error at once, named ("rank 0 failed in `get_dispatch_layout`: ..."), instead of
waiting out `timeout_s`. The rank's next call withdraws it (the rank went on).
"""

import functools


def shared_failure(method):
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        runtime = getattr(self, "runtime", None)
        outermost = runtime is not None and not getattr(self, "_in_call", False)
        if not outermost:
            return method(self, *args, **kwargs)
        runtime.begin_call()
        self._in_call = True
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            _share(runtime, self.rank, name, e)
            raise
        finally:
            self._in_call = False

    return call


def _share(runtime, rank: int, name: str, e: Exception) -> None:
    """Leaves this rank's error for its peers; the store being unreachable leaves `e` as it
    is (the peers then learn of it from their own waits)."""
    try:
        runtime.report_failure(f"rank {rank} failed in `{name}`: {type(e).__name__}: {e}")
    except Exception:
        pass
