//! The NVMe/TCP initiator's receive path (`picchio_nvme::tcp`): every byte a target sends — ICResp,
//! CapsuleResp, C2HData, R2T, C2HTermReq, with their HLEN, PDO, PLEN, CCCIDs, offsets, lengths and
//! digests, and the Connect, Property Get, Identify and Discovery Log Page answers in them — comes
//! from the input, played back by a loopback target (`picchio_nvme::tcp::replay`, 127.0.0.1, a
//! thread per connection) to the real initiator driven through its public API:
//! `NvmeTcpQueue::connect` (admin Connect, CC.EN/CSTS.RDY, Identify Controller and Namespace, I/O
//! queue Connects), reads (one alone, two in flight together), a write in the capsule, a write
//! after R2Ts, a Flush and the shutdown on drop; or `discover`.
//!
//! Input framing (`replay` module docs): byte 0 options (bit 0 HDGST, bit 1 DDGST, bit 2 the
//! discovery scenario; one I/O queue), then per TCP connection in the order the host opens them a 4-byte little-endian length and that many bytes the target sends on it. The target
//! writes a connection's bytes and closes it; connections past the last stream are closed at once.
//!
//! Only clear errors may come out: a panic, an allocation sized by the target's numbers, a hang, or
//! a step that waited for the initiator's timeout (every stream ends with the connection closed, so
//! the initiator must see `Closed` at once) is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_nvme::tcp::replay;

fuzz_target!(|data: &[u8]| {
    let out = replay::run(data);
    for s in &out.steps {
        if let Err(e) = &s.result {
            assert_ne!(
                e.kind,
                std::io::ErrorKind::TimedOut,
                "{}: waited for the timeout although every stream ends with the connection closed: {}",
                s.what,
                e.message
            );
        }
    }
});
