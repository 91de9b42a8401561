//! Captured CUDA graphs ([`Graph`]): what a closure queues on the rank's stream, captured
//! and instantiated once, then replayed.
//!
//! Owns: the graph and its instantiation, destroyed on drop. Never: decides what is
//! captured, or keeps the memory a graph's kernels use alive: its owner does, while replays
//! run (hence `Queue::replay` is unsafe).

use cudarc::driver::sys;

/// A captured CUDA graph, instantiated; destroyed on drop.
pub struct Graph {
    pub(super) exec: sys::CUgraphExec,
    pub(super) graph: sys::CUgraph,
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
