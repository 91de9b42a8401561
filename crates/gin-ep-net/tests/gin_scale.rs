//! Many ranks on one host: every registration's fd exchange is all-to-all over abstract Unix
//! datagram sockets, whose receive queues hold only `net.unix.max_dgram_qlen` messages
//! (10 by default), far fewer than the peers that send to one rank at once.

mod common;

use common::*;

const RANKS: usize = 40;

#[test]
fn registrations_at_40_ranks_on_one_host() {
    // Set before any init in this test binary (its own process): a stalled exchange fails
    // within this bound instead of the default minute.
    std::env::set_var("GIN_EP_NET_TIMEOUT_S", "20");
    let ranks = mesh(RANKS);
    let bufs: Vec<Buf> = (0..RANKS).map(|_| Buf::new(4096)).collect();
    let refs: Vec<&Buf> = bufs.iter().collect();
    // Several registrations back to back: a rank that finished one exchange sends the next
    // one's messages to peers still receiving the previous one's.
    let handles: Vec<Vec<P>> = (0..3).map(|_| register(&ranks, &refs)).collect();
    for h in &handles {
        assert_eq!(h.len(), RANKS);
    }
    close_all(ranks);
}
