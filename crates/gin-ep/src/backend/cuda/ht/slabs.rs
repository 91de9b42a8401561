//! The receive slabs an HT window lends to callers ([`SlabPool`]): no device work, so it is
//! tested without a GPU.
//!
//! Slab 0 is the copy slab: a dispatch into it leaves its rows until the next dispatch into
//! it, so a caller copies out what it keeps. Slabs `1..=lendable` are lent: a dispatch takes
//! a free one ([`SlabPool::take`]) and its outputs stay in it for as long as the caller
//! holds the [`SlabLease`]; dropping the last clone returns the slab. When every slab is
//! held the dispatch falls back to the copy slab.
//!
//! Reuse is stream-ordered: the next dispatch into a returned slab is queued on the stream
//! it is given, after whatever the caller queued there with the outputs; work on another
//! stream must be waited for before the lease is dropped (as with `Tensor.record_stream`).
//! Peers write a slab only after its receiver entered that next dispatch (the receiver names
//! the slab in the count exchange), so the stream order covers their writes too.
//!
//! A lease may be dropped on any thread (Python frees a tensor where it likes), also while
//! an operation of the engine runs: the free set is one atomic word, never behind the
//! engine's lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::layout::MAX_RECV_SLABS;

/// What [`SlabPool::warn_held`] returns the first time a dispatch asked for a slab and every
/// slab was held (the embedding shows it once).
pub const SLABS_HELD: &str = "gin_ep: every HT receive slab is held by earlier dispatch outputs, so \
     this dispatch copies its rows out (≈ 0.1 ms per 200 MB); Buffer(ht_recv_slabs=) sets how \
     many dispatches can hold their rows at once";

/// The lendable receive slabs of one HT window.
#[derive(Debug)]
pub struct SlabPool {
    /// Bit s set: slab s is free (bit 0, the copy slab, never set).
    free: AtomicU64,
    lendable: usize,
    /// The caller was told once that every slab was held.
    warned: AtomicBool,
}

impl SlabPool {
    /// The pool of a window with `slabs` receive slabs (1..=[`MAX_RECV_SLABS`]): slab 0
    /// copies, the others are lent.
    pub fn new(slabs: usize) -> Arc<SlabPool> {
        let lendable = slabs.clamp(1, MAX_RECV_SLABS) - 1;
        // Slabs 1..=lendable; lendable < 64, so the shift never overflows.
        let mask = ((1u64 << lendable) - 1) << 1;
        Arc::new(SlabPool {
            free: AtomicU64::new(mask),
            lendable,
            warned: AtomicBool::new(false),
        })
    }

    /// Slabs this pool lends (the window's slabs less the copy slab).
    pub fn lendable(&self) -> usize {
        self.lendable
    }

    /// The lowest free slab, lent until the last clone of the lease drops; None when every
    /// slab is held (or none is lendable).
    pub fn take(self: &Arc<Self>) -> Option<SlabLease> {
        let taken = self
            .free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                (m != 0).then(|| m & (m - 1))
            })
            .ok()?;
        Some(SlabLease {
            inner: Arc::new(Held {
                slab: taken.trailing_zeros() as usize,
                pool: self.clone(),
            }),
        })
    }

    /// The free lendable slabs, in increasing order.
    pub fn free_slabs(&self) -> Vec<usize> {
        let m = self.free.load(Ordering::Acquire);
        (1..=self.lendable).filter(|s| m & (1 << s) != 0).collect()
    }

    /// After a dispatch that asked for a slab and found none: [`SLABS_HELD`] the first time
    /// on this pool (only when it lends at all: a pool of none was asked to copy), else None.
    pub fn warn_held(&self) -> Option<&'static str> {
        (self.lendable > 0 && !self.warned.swap(true, Ordering::Relaxed)).then_some(SLABS_HELD)
    }
}

#[derive(Debug)]
struct Held {
    slab: usize,
    pool: Arc<SlabPool>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.pool.free.fetch_or(1 << self.slab, Ordering::AcqRel);
    }
}

/// A lent receive slab: cheap to clone; the slab returns to its pool when the last clone
/// drops.
#[derive(Clone, Debug)]
pub struct SlabLease {
    inner: Arc<Held>,
}

impl SlabLease {
    pub fn slab(&self) -> usize {
        self.inner.slab
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lends_the_lowest_free_slab_and_takes_it_back_when_the_last_clone_drops() {
        let pool = SlabPool::new(3);
        assert_eq!(pool.lendable(), 2);
        assert_eq!(pool.free_slabs(), vec![1, 2]);
        let a = pool.take().unwrap();
        assert_eq!(a.slab(), 1);
        let b = pool.take().unwrap();
        assert_eq!(b.slab(), 2);
        assert_eq!(pool.free_slabs(), Vec::<usize>::new());
        let a2 = a.clone();
        drop(a);
        assert_eq!(
            pool.free_slabs(),
            Vec::<usize>::new(),
            "a clone still holds slab 1"
        );
        drop(a2);
        assert_eq!(pool.free_slabs(), vec![1]);
        assert_eq!(pool.take().unwrap().slab(), 1, "a returned slab is lent again");
        drop(b);
        assert_eq!(pool.free_slabs(), vec![1, 2]);
    }

    #[test]
    fn exhaustion_falls_back_to_copying_and_warns_once() {
        let pool = SlabPool::new(2);
        let held = pool.take().unwrap();
        assert!(pool.take().is_none(), "every slab held: the dispatch copies");
        assert_eq!(pool.warn_held(), Some(SLABS_HELD));
        assert!(pool.take().is_none());
        assert_eq!(pool.warn_held(), None, "told once");
        drop(held);
        assert_eq!(pool.take().unwrap().slab(), 1);
    }

    #[test]
    fn a_pool_of_no_lendable_slabs_copies_without_a_warning() {
        let pool = SlabPool::new(1);
        assert_eq!(pool.lendable(), 0);
        assert!(pool.take().is_none());
        assert_eq!(pool.warn_held(), None);
    }

    #[test]
    fn every_slab_of_the_largest_window_is_lendable() {
        let pool = SlabPool::new(MAX_RECV_SLABS);
        let leases: Vec<_> = std::iter::from_fn(|| pool.take()).collect();
        assert_eq!(leases.len(), MAX_RECV_SLABS - 1);
        assert_eq!(leases.last().unwrap().slab(), MAX_RECV_SLABS - 1);
        assert!(
            leases.iter().all(|l| l.slab() != 0),
            "the copy slab is never lent"
        );
        drop(leases);
        assert_eq!(pool.free_slabs().len(), MAX_RECV_SLABS - 1);
    }

    #[test]
    fn leases_dropped_on_other_threads_return_their_slabs() {
        let pool = SlabPool::new(MAX_RECV_SLABS);
        let leases: Vec<_> = std::iter::from_fn(|| pool.take()).collect();
        std::thread::scope(|s| {
            for l in leases {
                s.spawn(move || drop(l));
            }
        });
        assert_eq!(pool.free_slabs(), (1..MAX_RECV_SLABS).collect::<Vec<_>>());
    }
}
