//! Captured CUDA graphs ([`Graph`]): what a closure queues on the rank's stream, captured
//! and instantiated once, then replayed.
//!
//! Owns: the graph and its instantiation, destroyed on drop. Never: decides what is
//! captured, or keeps the memory a graph's kernels use alive: its owner does, while replays
//! run (hence `CudaRank::replay` is unsafe).

use cudarc::driver::sys;

use super::result::cu_raw;
use super::CudaRank;
use crate::error::Result;

/// A captured CUDA graph, instantiated; destroyed on drop.
pub struct Graph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by capture() and are destroyed once; the owner
        // waits for replays before dropping (CudaLl users wait before teardown).
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

impl CudaRank {
    /// Captures what `f` queues on the rank's stream into a graph (nothing runs now). `f`
    /// must only launch (no waits, copies from pageable memory or memsets of other streams).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.wait("before graph capture")?;
        let stream = self.stream();
        // SAFETY: the stream is live and idle; thread-local mode restricts only this thread.
        cu_raw("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let queued = f();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (always, also when f failed).
        let ended = cu_raw("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream, &mut graph)
        });
        if let Err(e) = queued.and(ended) {
            if !graph.is_null() {
                // SAFETY: a graph returned by the capture, destroyed once.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
            return Err(e);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph is the captured graph; exec receives its instantiation.
        let inst = cu_raw("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        });
        if let Err(e) = inst {
            // SAFETY: as above.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            return Err(e);
        }
        Ok(Graph { exec, graph })
    }

    /// Queues one replay of `g` on the rank's stream.
    ///
    /// # Safety
    /// Every buffer the captured kernels use must stay alive until the replay has run.
    pub(crate) unsafe fn replay(&self, g: &Graph) -> Result<()> {
        // SAFETY: exec is live (g is borrowed); the caller's contract covers the memory the
        // graph's kernels use.
        cu_raw("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(g.exec, self.stream())
        })
    }
}
