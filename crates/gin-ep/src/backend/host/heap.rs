//! The symmetric heap of the host backend: every rank owns one segment of `len` bytes
//! (8-byte aligned, zero-initialised) and can write into every peer's segment, as CUDA
//! kernels do into an NCCL symmetric window.
//!
//! Owns: the memory of every segment (heap allocations when ranks are threads; POSIX
//! shared memory mappings when ranks are processes) and all the unsafe code of the host
//! backend.
//! Must never: touch memory outside a segment (every offset is checked before a pointer
//! is formed), access segment memory non-atomically, or wait without a deadline.
//!
//! # Memory-ordering contract (the same one the GPU fabric follows)
//!
//! * A writer issues any number of [`SymmetricHeap::put`]s to a peer, then one
//!   [`SymmetricHeap::signal`] (or [`SymmetricHeap::signal_add`]) to that peer. The signal
//!   is a Release store: every put this thread issued before it, to any peer, is visible
//!   to whoever observes the signal.
//! * A reader calls [`SymmetricHeap::wait_signal`] (an Acquire load) and only then
//!   [`SymmetricHeap::get`]s the data the signal covers.
//! * Nothing else is ordered: two puts without a signal between them may be seen in any
//!   order, and a put racing with a get of the same bytes yields torn bytes.
//! * Signals count up: a waiter asks for "at least `n`", so a sequence number per
//!   operation makes buffers reusable without resetting flags. `u64::MAX` is reserved:
//!   [`SymmetricHeap::poison`] stores it to tell waiters that a rank gave up, and every
//!   wait on a poisoned signal ends in [`Error::PeerFailed`].
//!
//! Data is copied with relaxed atomic loads and stores (8 bytes at a time where
//! aligned) rather than `memcpy`: segments are written by other threads and processes
//! at any time, and a protocol bug (what this backend exists to find) must show up as
//! wrong bytes that the oracle reports, never as undefined behaviour. Racing accesses of
//! different widths to the same bytes (a byte put over a signal word) are outside
//! this contract.

use std::any::Any;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::{Group, PeerWatch};

/// Signal value announcing that a rank gave up; see [`SymmetricHeap::poison`].
pub const POISON: u64 = u64::MAX;

/// Alignment of every segment base, and of every signal.
const WORD: usize = 8;

/// Busy-polls before a waiter starts yielding: a peer that is about to signal usually
/// does so within microseconds.
const SPIN_POLLS: u32 = 1 << 10;
/// Yields before a waiter starts sleeping: with more ranks than cores, the peer needs
/// this core to make progress.
const YIELD_POLLS: u32 = 1 << 10;
/// Longest sleep between polls once sleeping: bounds the extra latency of a slow wait.
const MAX_NAP: Duration = Duration::from_millis(1);

/// One rank's view of the symmetric heap: its own segment and every peer's.
pub struct SymmetricHeap {
    rank: usize,
    world: usize,
    len: usize,
    /// Base of every rank's segment, by rank. Each is 8-byte aligned and valid for reads
    /// and writes of `len` bytes for as long as `_memory` lives.
    bases: Vec<NonNull<u8>>,
    /// Keeps the segments alive (and unmaps them on drop).
    _memory: Box<dyn Any + Send + Sync>,
    /// The group's peer watch (heaps of processes whose group follows its failure log): a
    /// signal wait ends at once when a peer posted an error or left.
    watch: Option<PeerWatch>,
}

// SAFETY: the pointers in `bases` refer to memory owned by `_memory` (which is Send +
// Sync) and all access through them is atomic, so the heap may move to, and be shared
// with, other threads.
unsafe impl Send for SymmetricHeap {}
// SAFETY: as above; `&self` methods only perform atomic accesses.
unsafe impl Sync for SymmetricHeap {}

impl std::fmt::Debug for SymmetricHeap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricHeap")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("len", &self.len)
            .finish()
    }
}

fn check_shape(world: usize, len: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::input("symmetric heap world", "must be at least 1"));
    }
    if len == 0 || len > isize::MAX as usize - WORD {
        return Err(Error::input(
            "symmetric heap length",
            format!("{len} bytes: must be in 1..={}", isize::MAX as usize - WORD),
        ));
    }
    Ok(())
}

impl SymmetricHeap {
    /// A heap for `world` ranks that are threads of this process: one handle per rank,
    /// indexed by rank, all sharing the same segments.
    pub fn threads(world: usize, len: usize) -> Result<Vec<SymmetricHeap>> {
        check_shape(world, len)?;
        let words = len.div_ceil(WORD);
        let mut segments: Vec<Box<[AtomicU64]>> = Vec::with_capacity(world);
        for rank in 0..world {
            let mut seg: Vec<AtomicU64> = Vec::new();
            // An absurd length must be an error, not an allocation-failure abort.
            seg.try_reserve_exact(words).map_err(|e| {
                Error::input(
                    "symmetric heap length",
                    format!("{len} bytes for rank {rank}: {e}"),
                )
            })?;
            seg.extend((0..words).map(|_| AtomicU64::new(0)));
            segments.push(seg.into_boxed_slice());
        }
        let bases: Vec<NonNull<u8>> = segments
            .iter()
            // AtomicU64 is an UnsafeCell, so writing through a pointer derived from a
            // shared reference to it is allowed.
            .map(|s| NonNull::from(&s[0]).cast::<u8>())
            .collect();
        let shared = Arc::new(segments);
        Ok((0..world)
            .map(|rank| SymmetricHeap {
                rank,
                world,
                len,
                bases: bases.clone(),
                _memory: Box::new(Arc::clone(&shared)),
                watch: None,
            })
            .collect())
    }

    /// A heap for ranks that are processes of one host: each rank creates a POSIX
    /// shared-memory segment, publishes its name through the group's store, and maps
    /// every peer's. A collective: every rank of `group` calls it, with the same `len`,
    /// in the same order relative to other heaps.
    ///
    /// The names are removed (`shm_unlink`) as soon as every rank has mapped every
    /// segment, so nothing is left in `/dev/shm` even if a rank crashes later; the
    /// mappings go away when the last process unmaps them. A rank killed before that
    /// leaves its name behind; every process holds a lock on each segment it maps, and
    /// the first heap of a later process removes the unlocked leftovers of this user
    /// (`sweep_stale_segments`), saying so on stderr.
    pub fn processes(group: &Group, len: usize) -> Result<SymmetricHeap> {
        check_shape(group.world(), len)?;
        sweep_stale_segments_once();
        let (rank, world) = (group.rank(), group.world());
        let heap_id = group.next_heap_id();
        let name_of = |r: usize| format!("/{SHM_PREFIX}{}-{heap_id}-{r}", group.session());
        let key_of = |r: usize| group.key(&format!("heap/{heap_id}/rank/{r}"));

        let own_name = c_name(&name_of(rank))?;
        let mut own = ShmMapping::create(&own_name, len)?;
        group.store().set(&key_of(rank), format!("{len}").as_bytes())?;

        let mut peers: Vec<Option<ShmMapping>> = Vec::with_capacity(world);
        for peer in 0..world {
            if peer == rank {
                peers.push(None);
                continue;
            }
            // The key appears once the peer created its segment, so the open below
            // cannot race the creation.
            let published = group.wait_peer(&key_of(peer), peer, &format!("symmetric heap #{heap_id}"))?;
            let peer_len = std::str::from_utf8(&published)
                .ok()
                .and_then(|s| s.parse::<usize>().ok());
            if peer_len != Some(len) {
                return Err(Error::Bootstrap(format!(
                    "symmetric heap #{heap_id}: rank {peer} allocated {} bytes, rank {rank} {len}",
                    String::from_utf8_lossy(&published)
                )));
            }
            peers.push(Some(ShmMapping::open(&c_name(&name_of(peer))?, len)?));
        }
        group.barrier(&format!("heap/{heap_id}/mapped"))?;
        own.unlink()?;

        let bases = peers
            .iter()
            .map(|m| m.as_ref().map_or(own.ptr, |m| m.ptr))
            .collect();
        let mut mappings: Vec<ShmMapping> = peers.into_iter().flatten().collect();
        mappings.push(own);
        Ok(SymmetricHeap {
            rank,
            world,
            len,
            bases,
            _memory: Box::new(mappings),
            watch: group.peer_watch(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks (segments).
    pub fn world(&self) -> usize {
        self.world
    }

    /// Bytes in each rank's segment.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a heap has at least one byte per segment.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into `peer`'s segment at `offset`. Not ordered with respect to other
    /// puts until a later [`signal`](Self::signal) by this thread.
    pub fn put(&self, peer: usize, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.range(peer, offset, src.len(), "put")?;
        // SAFETY: `range` checked that `dst..dst+src.len()` lies inside `peer`'s segment,
        // which `_memory` keeps alive while `self` is borrowed; all access is atomic.
        unsafe { store_bytes(dst, src) };
        Ok(())
    }

    /// Copies `dst.len()` bytes out of `peer`'s segment (usually this rank's own) at
    /// `offset`. See the contract above: wait for the covering signal first.
    pub fn get(&self, peer: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.range(peer, offset, dst.len(), "get")?;
        // SAFETY: as in `put`.
        unsafe { load_bytes(src, dst) };
        Ok(())
    }

    /// Stores `value` into the signal at `offset` (8-aligned) of `peer`'s segment, with
    /// Release ordering: every earlier put by this thread is visible to a rank that
    /// observes it. `u64::MAX` is reserved for [`poison`](Self::poison).
    pub fn signal(&self, peer: usize, offset: usize, value: u64) -> Result<()> {
        if value == POISON {
            return Err(Error::input("signal value", "u64::MAX is reserved for poison"));
        }
        self.word(peer, offset, "signal")?.store(value, Ordering::Release);
        Ok(())
    }

    /// Adds `delta` to the signal at `offset` of `peer`'s segment (Release, as
    /// [`signal`](Self::signal)), so several ranks can count into one signal, as a GIN
    /// signal-add does. A poisoned signal stays poisoned; reaching `u64::MAX` is an error.
    pub fn signal_add(&self, peer: usize, offset: usize, delta: u64) -> Result<()> {
        let word = self.word(peer, offset, "signal_add")?;
        let updated = word.fetch_update(Ordering::Release, Ordering::Relaxed, |cur| {
            if cur == POISON {
                None
            } else {
                cur.checked_add(delta).filter(|v| *v != POISON)
            }
        });
        match updated {
            Ok(_) => Ok(()),
            Err(POISON) => Ok(()),
            Err(cur) => Err(Error::input(
                format!("signal_add at offset {offset} of rank {peer}"),
                format!("{cur} + {delta} overflows"),
            )),
        }
    }

    /// The signal at `offset` of this rank's own segment (Acquire).
    pub fn read_signal(&self, offset: usize) -> Result<u64> {
        Ok(self
            .word(self.rank, offset, "read_signal")?
            .load(Ordering::Acquire))
    }

    /// Waits until the signal at `offset` of this rank's own segment is at least
    /// `at_least` and returns its value (Acquire: the data it covers may be read now).
    /// `phase`, `peer` (the rank expected to signal) and `seq` (the operation number)
    /// only name the wait in errors: past `deadline` this returns [`Error::Timeout`], and
    /// on a poisoned signal [`Error::PeerFailed`].
    pub fn wait_signal(
        &self,
        offset: usize,
        at_least: u64,
        deadline: Instant,
        phase: &'static str,
        peer: usize,
        seq: u64,
    ) -> Result<u64> {
        let word = self.word(self.rank, offset, "wait_signal")?;
        if at_least == POISON {
            return Err(Error::input(
                "wait_signal target",
                "u64::MAX is reserved for poison",
            ));
        }
        let start = Instant::now();
        let mut polls: u32 = 0;
        let mut nap = Duration::from_micros(10);
        loop {
            let value = word.load(Ordering::Acquire);
            if value == POISON {
                return Err(Error::PeerFailed {
                    peer,
                    phase: phase.to_string(),
                    reason: format!(
                        "signal at offset {offset} was poisoned (a rank gave up) while rank {} \
                         waited for operation #{seq}",
                        self.rank
                    ),
                });
            }
            if value >= at_least {
                return Ok(value);
            }
            // Checked on every poll, and after the first load, so a ready signal is
            // returned even when the deadline has already passed.
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    phase,
                    rank: self.rank,
                    peer,
                    peer_node: None,
                    seq,
                    waited: now - start,
                });
            }
            if polls < SPIN_POLLS {
                std::hint::spin_loop();
            } else if polls < SPIN_POLLS + YIELD_POLLS {
                std::thread::yield_now();
            } else {
                if let Some(w) = &self.watch {
                    w.check(phase)?;
                }
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(MAX_NAP);
            }
            polls = polls.saturating_add(1);
        }
    }

    /// Stores `u64::MAX` into the signal at `offset` of `peer`'s segment: a rank that
    /// gives up poisons the signals its peers may be waiting on, so they fail at once
    /// with [`Error::PeerFailed`] instead of at their deadline.
    pub fn poison(&self, peer: usize, offset: usize) -> Result<()> {
        self.word(peer, offset, "poison")?
            .store(POISON, Ordering::Release);
        Ok(())
    }

    /// Pointer to `n` bytes at `offset` of `peer`'s segment, after checking they are
    /// inside it.
    fn range(&self, peer: usize, offset: usize, n: usize, op: &str) -> Result<*mut u8> {
        let base = self.base(peer, op)?;
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(base.as_ptr().wrapping_add(offset)),
            _ => Err(Error::input(
                format!("{op} of {n} bytes at offset {offset} of rank {peer}"),
                format!("outside the {}-byte segment", self.len),
            )),
        }
    }

    /// The signal word at `offset` of `peer`'s segment, after checking alignment and
    /// bounds.
    fn word(&self, peer: usize, offset: usize, op: &str) -> Result<&AtomicU64> {
        // A mask rather than `is_multiple_of`, which is newer than the workspace's MSRV.
        if offset & (WORD - 1) != 0 {
            return Err(Error::input(
                format!("{op} at offset {offset} of rank {peer}"),
                "signal offsets must be multiples of 8",
            ));
        }
        let ptr = self.range(peer, offset, WORD, op)?;
        // SAFETY: `ptr` is inside the segment (checked by `range`) and 8-aligned (segment
        // bases are 8-aligned and `offset` is a multiple of 8); the segment lives as long
        // as `self`, to which the returned reference is tied; and every access to segment
        // memory is atomic.
        Ok(unsafe { AtomicU64::from_ptr(ptr.cast::<u64>()) })
    }

    fn base(&self, peer: usize, op: &str) -> Result<NonNull<u8>> {
        self.bases.get(peer).copied().ok_or_else(|| {
            Error::input(
                format!("{op} to rank {peer}"),
                format!("out of range for a world of {}", self.world),
            )
        })
    }
}

/// Copies `src` to `dst` with relaxed atomic stores.
///
/// # Safety
/// `dst..dst + src.len()` must be valid for writes for the duration of the call, and
/// only ever accessed atomically.
unsafe fn store_bytes(dst: *mut u8, src: &[u8]) {
    let head = ((WORD - dst as usize % WORD) % WORD).min(src.len());
    let (head_bytes, rest) = src.split_at(head);
    let words = rest.chunks_exact(WORD);
    let tail_bytes = words.remainder();
    let mut p = dst;
    for &b in head_bytes {
        AtomicU8::from_ptr(p).store(b, Ordering::Relaxed);
        p = p.add(1);
    }
    for w in words {
        let mut bytes = [0u8; WORD];
        bytes.copy_from_slice(w);
        // `p` is 8-aligned here: the head brought it to a word boundary.
        AtomicU64::from_ptr(p.cast::<u64>()).store(u64::from_ne_bytes(bytes), Ordering::Relaxed);
        p = p.add(WORD);
    }
    for &b in tail_bytes {
        AtomicU8::from_ptr(p).store(b, Ordering::Relaxed);
        p = p.add(1);
    }
}

/// Copies `dst.len()` bytes from `src` into `dst` with relaxed atomic loads.
///
/// # Safety
/// `src..src + dst.len()` must be valid for reads for the duration of the call, and
/// only ever accessed atomically.
unsafe fn load_bytes(src: *const u8, dst: &mut [u8]) {
    let head = ((WORD - src as usize % WORD) % WORD).min(dst.len());
    let (head_bytes, rest) = dst.split_at_mut(head);
    let mut words = rest.chunks_exact_mut(WORD);
    let mut p = src.cast_mut();
    for b in head_bytes {
        *b = AtomicU8::from_ptr(p).load(Ordering::Relaxed);
        p = p.add(1);
    }
    for w in &mut words {
        let v = AtomicU64::from_ptr(p.cast::<u64>()).load(Ordering::Relaxed);
        w.copy_from_slice(&v.to_ne_bytes());
        p = p.add(WORD);
    }
    for b in words.into_remainder() {
        *b = AtomicU8::from_ptr(p).load(Ordering::Relaxed);
        p = p.add(1);
    }
}

fn c_name(name: &str) -> Result<CString> {
    // POSIX: one leading slash, no other; Linux limits names to NAME_MAX (255) bytes.
    let valid = name
        .strip_prefix('/')
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'));
    if !valid || name.len() > 255 {
        return Err(Error::Bootstrap(format!("invalid shared-memory name {name:?}")));
    }
    CString::new(name).map_err(|_| Error::Bootstrap(format!("shared-memory name {name:?} contains NUL")))
}

/// One shared-memory segment mapped into this process. Unmaps on drop; also removes the
/// name on drop while it still owns it (so a failed bootstrap leaves nothing behind).
struct ShmMapping {
    ptr: NonNull<u8>,
    len: usize,
    /// The segment's descriptor, holding a shared `flock` for as long as it is mapped:
    /// what tells [`sweep_stale_segments`] that a live process still uses the name.
    _lock: File,
    /// The name to `shm_unlink` on drop, while this process created it and has not yet
    /// removed it.
    owned_name: Option<CString>,
}

// SAFETY: the mapping is plain shared memory, valid until `munmap` in Drop; it is only
// accessed through `SymmetricHeap`, atomically.
unsafe impl Send for ShmMapping {}
// SAFETY: as above.
unsafe impl Sync for ShmMapping {}

impl ShmMapping {
    /// Creates the segment `name` of `len` zero bytes and maps it.
    fn create(name: &CStr, len: usize) -> Result<ShmMapping> {
        let fd = shm_open(name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR)?;
        // From here on the name exists: remove it again on every early return.
        let guard = UnlinkOnDrop(Some(name.to_owned()));
        let file = File::from(fd);
        lock_shared(&file, name)?;
        // ftruncate: a new segment reads as zeros.
        file.set_len(len as u64)
            .map_err(|e| Error::io(format!("ftruncate {name:?} to {len} bytes"), e))?;
        let ptr = map(&file, len, name)?;
        Ok(ShmMapping {
            ptr,
            len,
            _lock: file,
            owned_name: guard.disarm(),
        })
    }

    /// Maps the existing segment `name`, which must hold at least `len` bytes.
    fn open(name: &CStr, len: usize) -> Result<ShmMapping> {
        let file = File::from(shm_open(name, libc::O_RDWR)?);
        lock_shared(&file, name)?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format!("fstat {name:?}"), e))?
            .len();
        if size < len as u64 {
            return Err(Error::Bootstrap(format!(
                "shared-memory segment {name:?} holds {size} bytes, expected {len}"
            )));
        }
        let ptr = map(&file, len, name)?;
        Ok(ShmMapping {
            ptr,
            len,
            _lock: file,
            owned_name: None,
        })
    }

    /// Removes the name; the mapping stays valid.
    fn unlink(&mut self) -> Result<()> {
        match self.owned_name.take() {
            Some(name) => shm_unlink(&name),
            None => Ok(()),
        }
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        if let Some(name) = self.owned_name.take() {
            let _ = shm_unlink(&name);
        }
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and this is their only
        // owner; `SymmetricHeap` drops its mappings only after its last use.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Unlinks a shared-memory name on drop unless disarmed.
struct UnlinkOnDrop(Option<CString>);

impl UnlinkOnDrop {
    fn disarm(mut self) -> Option<CString> {
        self.0.take()
    }
}

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        if let Some(name) = self.0.take() {
            let _ = shm_unlink(&name);
        }
    }
}

/// Where Linux keeps POSIX shared-memory names.
const SHM_DIR: &str = "/dev/shm";
/// Start of every segment name gin-ep creates (then `{session}-{heap}-{rank}`).
const SHM_PREFIX: &str = "gin-ep-";
/// Age past which an unlocked segment counts as left behind: the creator locks it
/// microseconds after creating it, so a younger one may still be on its way.
const STALE_AFTER: Duration = Duration::from_secs(5);
/// How long taking a segment's shared lock may take (only a sweeper's brief exclusive
/// lock can stand in the way).
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Takes a shared `flock` on a segment, within [`LOCK_WAIT`].
fn lock_shared(file: &File, name: &CStr) -> Result<()> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor this function borrows; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) || Instant::now() >= deadline {
            return Err(Error::io(format!("flock {name:?} (shared)"), err));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Removes, once per process, the segments that killed jobs of this user left in
/// `/dev/shm` ([`sweep_stale_segments`]), and says so on stderr. Called by the first
/// process heap, and by the CLI's launcher before it starts ranks (whose stderr it shows
/// only when they fail).
pub(crate) fn sweep_stale_segments_once() {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        let removed = sweep_stale_segments(Path::new(SHM_DIR), STALE_AFTER);
        if !removed.is_empty() {
            eprintln!(
                "gin-ep: removed {} shared-memory segment(s) that a killed job left in {SHM_DIR}: {}",
                removed.len(),
                removed.join(", ")
            );
        }
    });
}

/// Whether `file_name` has the shape of a gin-ep segment: `gin-ep-{16 hex}-{n}-{n}`.
fn is_segment_name(file_name: &str) -> bool {
    let Some(rest) = file_name.strip_prefix(SHM_PREFIX) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('-').collect();
    matches!(parts.as_slice(), [session, heap, rank]
        if session.len() == 16
            && session.bytes().all(|b| b.is_ascii_hexdigit())
            && !heap.is_empty() && heap.bytes().all(|b| b.is_ascii_digit())
            && !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the gin-ep segments in `dir` that belong to this user, are older than
/// `min_age` and that no live process holds locked (their ranks were killed before
/// they unlinked them); returns the paths removed. Best effort: an entry that cannot
/// be examined is left alone.
fn sweep_stale_segments(dir: &Path, min_age: Duration) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_segment_name(&name) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let old_enough = meta
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age >= min_age);
        if !meta.file_type().is_file() || meta.uid() != me || !old_enough {
            continue;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        // SAFETY: flock on a descriptor owned by `file`; no memory is involved.
        let unlocked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if unlocked && std::fs::remove_file(&path).is_ok() {
            removed.push(path.display().to_string());
        }
    }
    removed
}

fn shm_open(name: &CStr, flags: libc::c_int) -> Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string; shm_open has no other
    // preconditions. FD_CLOEXEC is set by shm_open itself.
    let fd = unsafe { libc::shm_open(name.as_ptr(), flags, 0o600 as libc::mode_t) };
    if fd < 0 {
        return Err(Error::io(
            format!("shm_open {name:?}"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` was just returned by shm_open and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn shm_unlink(name: &CStr) -> Result<()> {
    // SAFETY: `name` is a valid NUL-terminated string.
    if unsafe { libc::shm_unlink(name.as_ptr()) } != 0 {
        return Err(Error::io(
            format!("shm_unlink {name:?}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn map(file: &File, len: usize, name: &CStr) -> Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the address,
    // so no existing memory is affected. The fd may be closed afterwards.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::io(
            format!("mmap {name:?} ({len} bytes)"),
            std::io::Error::last_os_error(),
        ));
    }
    // mmap returns page-aligned addresses, so the 8-byte alignment contract holds.
    NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| Error::Bootstrap(format!("mmap {name:?} returned a null mapping")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::StoreServer;

    const T: Duration = Duration::from_secs(20);

    /// Byte `i` of what rank `src` sends rank `dst` in round `round`.
    fn pattern(src: usize, dst: usize, round: u64, i: usize) -> u8 {
        (src * 31 + dst * 7 + round as usize * 13 + i) as u8
    }

    const DATA_LEN: usize = 251; // odd, so puts have unaligned heads and tails
    fn data_offset(src: usize) -> usize {
        256 + src * 300 + 3
    }
    fn data_flag(src: usize) -> usize {
        8 * src
    }
    fn ack_flag(src: usize) -> usize {
        64 + 8 * src
    }

    /// Every rank puts a distinct pattern into every rank (itself included), signals,
    /// waits for all, verifies, and acknowledges before the next round overwrites.
    fn exchange_rounds(heap: &SymmetricHeap, rounds: u64) {
        let (me, world) = (heap.rank(), heap.world());
        for round in 1..=rounds {
            let deadline = Instant::now() + T;
            for dst in 0..world {
                let data: Vec<u8> = (0..DATA_LEN).map(|i| pattern(me, dst, round, i)).collect();
                heap.put(dst, data_offset(me), &data).unwrap();
                heap.signal(dst, data_flag(me), round).unwrap();
            }
            for src in 0..world {
                heap.wait_signal(data_flag(src), round, deadline, "data", src, round)
                    .unwrap();
                let mut got = vec![0u8; DATA_LEN];
                heap.get(me, data_offset(src), &mut got).unwrap();
                let want: Vec<u8> = (0..DATA_LEN).map(|i| pattern(src, me, round, i)).collect();
                if let Some(i) = (0..DATA_LEN).find(|&i| got[i] != want[i]) {
                    panic!(
                        "rank {me} round {round}: data from rank {src} differs at byte {i}: \
                         got {} want {}",
                        got[i], want[i]
                    );
                }
            }
            for src in 0..world {
                heap.signal(src, ack_flag(me), round).unwrap();
            }
            for dst in 0..world {
                heap.wait_signal(ack_flag(dst), round, deadline, "ack", dst, round)
                    .unwrap();
            }
        }
    }

    #[test]
    fn thread_ranks_see_every_peers_puts_after_its_signal() {
        let heaps = SymmetricHeap::threads(4, 4096).unwrap();
        let threads: Vec<_> = heaps
            .into_iter()
            .map(|h| std::thread::spawn(move || exchange_rounds(&h, 200)))
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn segments_start_zeroed_and_signals_are_per_rank() {
        let heaps = SymmetricHeap::threads(2, 100).unwrap();
        let mut buf = vec![1u8; 100];
        heaps[1].get(1, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        heaps[0].signal(1, 16, 5).unwrap();
        assert_eq!(heaps[1].read_signal(16).unwrap(), 5);
        assert_eq!(heaps[0].read_signal(16).unwrap(), 0);
        heaps[0].signal_add(1, 16, 3).unwrap();
        assert_eq!(heaps[1].read_signal(16).unwrap(), 8);
        // The last full word of a 100-byte segment is at 88.
        heaps[0].signal(1, 88, 1).unwrap();
        assert!(heaps[0].signal(1, 96, 1).is_err());
    }

    #[test]
    fn out_of_range_accesses_are_errors_not_undefined_behaviour() {
        let heaps = SymmetricHeap::threads(2, 64).unwrap();
        let h = &heaps[0];
        let mut buf = [0u8; 8];
        let bad: Vec<(&str, Result<()>)> = vec![
            ("peer == world", h.put(2, 0, &[1])),
            ("end past len", h.put(1, 60, &[0; 5])),
            ("offset overflow", h.put(1, usize::MAX, &[0; 2])),
            ("get past len", h.get(0, 57, &mut buf)),
            ("get from bad peer", h.get(9, 0, &mut buf)),
            ("unaligned signal", h.signal(1, 4, 1)),
            ("signal past len", h.signal(1, 64, 1)),
            ("signal poison value", h.signal(1, 0, POISON)),
            ("poison bad peer", h.poison(3, 0)),
            ("read_signal unaligned", h.read_signal(9).map(|_| ())),
        ];
        for (what, r) in bad {
            match r {
                Err(e) => assert!(e.is_usage(), "{what}: not an input error: {e}"),
                Ok(()) => panic!("{what}: accepted"),
            }
        }
        // Empty accesses at the very end are fine.
        h.put(1, 64, &[]).unwrap();
        assert!(SymmetricHeap::threads(0, 64).is_err());
        assert!(SymmetricHeap::threads(2, 0).is_err());
        assert!(SymmetricHeap::threads(1, usize::MAX).is_err());
    }

    #[test]
    fn wait_signal_times_out_near_the_deadline_naming_phase_and_peer() {
        let heaps = SymmetricHeap::threads(3, 64).unwrap();
        let t0 = Instant::now();
        let err = heaps[1]
            .wait_signal(8, 1, t0 + Duration::from_millis(150), "dispatch-recv", 2, 7)
            .unwrap_err();
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_millis(1500),
            "took {took:?}"
        );
        match err {
            Error::Timeout {
                phase,
                rank,
                peer,
                seq,
                waited,
                ..
            } => {
                assert_eq!((phase, rank, peer, seq), ("dispatch-recv", 1, 2, 7));
                assert!(waited >= Duration::from_millis(140), "{waited:?}");
            }
            other => panic!("expected Timeout, got {other}"),
        }
        // A value already there is returned even past the deadline.
        heaps[0].signal(1, 8, 3).unwrap();
        assert_eq!(heaps[1].wait_signal(8, 2, t0, "x", 0, 0).unwrap(), 3);
    }

    #[test]
    fn poison_wakes_a_waiter_with_peer_failed() {
        let heaps = SymmetricHeap::threads(2, 64).unwrap();
        let mut it = heaps.into_iter();
        let (h0, h1) = (it.next().unwrap(), it.next().unwrap());
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = h0.wait_signal(16, 1, t0 + T, "combine-recv", 1, 42);
            (r, t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        h1.poison(0, 16).unwrap();
        let (r, took) = waiter.join().unwrap();
        assert!(took < Duration::from_secs(5), "waited {took:?} despite poison");
        match r {
            Err(Error::PeerFailed { peer, phase, .. }) => {
                assert_eq!((peer, phase.as_str()), (1, "combine-recv"))
            }
            other => panic!("expected PeerFailed, got {other:?}"),
        }
        // A poisoned signal stays poisoned.
        h1.signal_add(0, 16, 1).unwrap();
    }

    fn shm_names_of(session: &str) -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(session))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn process_heap_over_real_shared_memory_is_visible_across_ranks_and_leaves_no_names() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let sec = server.secret().clone();
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let group = Group::join(r, 2, &addr, &sec, T).unwrap();
                    // Two heaps per group: names must not collide.
                    let heap = SymmetricHeap::processes(&group, (1 << 20) + 5).unwrap();
                    let small = SymmetricHeap::processes(&group, 4096).unwrap();
                    assert_eq!((heap.rank(), heap.world(), heap.len()), (r, 2, (1 << 20) + 5));
                    let mut tail = [9u8; 5];
                    heap.get(r, 1 << 20, &mut tail).unwrap();
                    assert_eq!(tail, [0; 5], "segment not zeroed");
                    exchange_rounds(&heap, 50);
                    exchange_rounds(&small, 5);
                    let session = group.session().to_string();
                    group.barrier("done").unwrap();
                    (session, heap, group)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let session = results[0].0.clone();
        assert_eq!(
            shm_names_of(&session),
            Vec::<String>::new(),
            "names left in /dev/shm while heaps are alive"
        );
        drop(results);
    }

    #[test]
    fn process_heap_with_mismatched_lengths_fails_on_every_rank_and_leaks_nothing() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let sec = server.secret().clone();
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let group = Group::join(r, 2, &addr, &sec, Duration::from_secs(5)).unwrap();
                    let err = SymmetricHeap::processes(&group, 4096 * (r + 1)).unwrap_err();
                    (group.session().to_string(), err.to_string())
                })
            })
            .collect();
        // Join every rank before looking: a rank still unwinding holds its name.
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (session, msg) in results {
            assert!(msg.contains("allocated"), "{msg}");
            assert_eq!(shm_names_of(&session), Vec::<String>::new());
        }
    }

    /// Strangers forging the join counter, the session id and a heap key on the store
    /// (as a request, or after a wrong hello) change nothing: the ranks join, agree and
    /// move data bit-exactly, and the segments' names are gone once every rank mapped them.
    #[test]
    fn forged_store_requests_from_strangers_do_not_reach_the_job() {
        use std::io::Write;
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let sec = server.secret().clone();
        let forge = |op: u8, key: &str, body: &[u8]| {
            let mut req = vec![op];
            req.extend_from_slice(&(key.len() as u32).to_le_bytes());
            req.extend_from_slice(key.as_bytes());
            req.extend_from_slice(body);
            req.resize(req.len().max(64), 0);
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            let _ = s.write_all(&req);
            s
        };
        let len_body = |v: &[u8]| [&(v.len() as u32).to_le_bytes()[..], v].concat();
        let _strangers = [
            forge(3, "gin-ep/groups/joined", &1i64.to_le_bytes()),
            forge(3, "gin-ep/g0/join/0/count", &1i64.to_le_bytes()),
            forge(1, "gin-ep/g0/session", &len_body(b"deadbeefdeadbeef")),
            forge(1, "gin-ep/g0/heap/0/rank/1", &len_body(b"1")),
        ];
        let threads: Vec<_> = (0..2)
            .map(|r| {
                let (addr, sec) = (addr.clone(), sec.clone());
                std::thread::spawn(move || {
                    let group = Group::join(r, 2, &addr, &sec, T).unwrap();
                    let heap = SymmetricHeap::processes(&group, 1 << 16).unwrap();
                    exchange_rounds(&heap, 20);
                    let session = group.session().to_string();
                    group.barrier("done").unwrap();
                    (session, heap, group)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(results[0].0, results[1].0);
        assert_ne!(results[0].0, "deadbeefdeadbeef");
        assert_eq!(shm_names_of(&results[0].0), Vec::<String>::new());
    }

    /// A segment left by a killed rank (no process holds its lock) is removed by the
    /// sweep; one a live process holds, one too young, and other files are kept.
    #[test]
    fn the_sweep_removes_only_unlocked_gin_ep_segments() {
        let dir = std::env::temp_dir().join(format!("gin-ep-sweep-{}", rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        let stale = dir.join("gin-ep-0123456789abcdef-0-1");
        let live = dir.join("gin-ep-0123456789abcdef-0-0");
        let other = dir.join("gin-ep-probe-0123");
        for p in [&stale, &live, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let held = File::open(&live).unwrap();
        lock_shared(&held, c"held").unwrap();
        // Too young for a sweep that waits an hour.
        assert!(sweep_stale_segments(&dir, Duration::from_secs(3600)).is_empty());
        let removed = sweep_stale_segments(&dir, Duration::ZERO);
        assert_eq!(removed, vec![stale.display().to_string()]);
        assert!(!stale.exists() && live.exists() && other.exists());
        drop(held);
        assert_eq!(sweep_stale_segments(&dir, Duration::ZERO).len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn segment_names_are_recognised_strictly() {
        assert!(is_segment_name("gin-ep-0123456789abcdef-12-3"));
        for n in [
            "gin-ep-probe-0123456789abcdef",
            "gin-ep-0123456789abcde-1-2",
            "gin-ep-0123456789abcdef-1",
            "gin-ep-0123456789abcdef-1-2-3",
            "gin-ep-0123456789abcdef-x-2",
            "other-0123456789abcdef-1-2",
        ] {
            assert!(!is_segment_name(n), "{n}");
        }
    }
}
