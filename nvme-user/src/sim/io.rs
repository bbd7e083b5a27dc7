//! NVM I/O commands of the model (NVM command set §3): Read, Write, Flush, with PRP walking (§4.1.1)
//! including chained PRP lists.

use std::os::unix::fs::FileExt;

use super::{dma_copy, Dma, Model, Shared};
use crate::spec::{nvm, Command, Status};

/// The host segments `(iova, len)` that `cmd`'s PRP1/PRP2 describe for `len` bytes, walked like a
/// controller walks them (§4.1.1): PRP1 at any dword offset; PRP2 the second page (offset 0) or a PRP
/// list pointer (qword aligned); list entries page aligned; when more entries remain than the rest of
/// a list page holds, its last entry is the pointer to the next list page, which must be page aligned.
/// Every list page read counts in `prp_list_pages`.
pub(crate) fn prp_segments(
    shared: &Shared,
    page: usize,
    cmd: &Command,
    len: usize,
    prp_list_pages: &mut u64,
) -> Result<Vec<(u64, usize)>, Status> {
    let pg = page as u64;
    if !cmd.prp1.is_multiple_of(4) {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let first = len.min(page - (cmd.prp1 % pg) as usize);
    let mut segs = vec![(cmd.prp1, first)];
    let mut rem = len - first;
    if rem == 0 {
        return Ok(segs);
    }
    if rem <= page {
        if !cmd.prp2.is_multiple_of(pg) {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        segs.push((cmd.prp2, rem));
        return Ok(segs);
    }
    let mut list = cmd.prp2;
    if !list.is_multiple_of(8) {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let mut raw = Vec::new();
    while rem > 0 {
        let in_page = ((pg - list % pg) / 8) as usize;
        let needed = rem.div_ceil(page);
        let read = needed.min(in_page);
        raw.clear();
        raw.resize(read * 8, 0u8);
        if !dma_copy(&shared.registry, list, Dma::FromHost(&mut raw)) {
            return Err(Status::DATA_TRANSFER_ERROR);
        }
        *prp_list_pages += 1;
        let entry = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().expect("8"));
        let (data, next) = if needed > in_page { (read - 1, Some(entry(read - 1))) } else { (read, None) };
        for i in 0..data {
            let e = entry(i);
            if e % pg != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            let n = rem.min(page);
            segs.push((e, n));
            rem -= n;
        }
        match next {
            Some(n) if n % pg != 0 => return Err(Status::PRP_OFFSET_INVALID),
            Some(n) => list = n,
            None => break,
        }
    }
    Ok(segs)
}

/// Moves `len` bytes between `data` and the host memory `cmd`'s PRPs describe.
pub(crate) fn transfer(m: &mut Model, shared: &Shared, cmd: &Command, len: usize, data: Dma<'_>) -> Status {
    let segs = match prp_segments(shared, m.page, cmd, len, &mut m.stats.prp_list_pages) {
        Ok(s) => s,
        Err(s) => return s,
    };
    let mut off = 0;
    let ok = match data {
        Dma::ToHost(d) => segs.iter().all(|&(iova, n)| {
            let ok = dma_copy(&shared.registry, iova, Dma::ToHost(&d[off..off + n]));
            off += n;
            ok
        }),
        Dma::FromHost(d) => segs.iter().all(|&(iova, n)| {
            let ok = dma_copy(&shared.registry, iova, Dma::FromHost(&mut d[off..off + n]));
            off += n;
            ok
        }),
    };
    if ok {
        Status::SUCCESS
    } else {
        m.stats.dma_faults += 1;
        Status::DATA_TRANSFER_ERROR
    }
}

impl Model {
    pub(crate) fn io(&mut self, shared: &Shared, cmd: &Command) -> (Status, u32) {
        match cmd.opc() {
            nvm::READ | nvm::WRITE => (self.rw(shared, cmd), 0),
            nvm::FLUSH => (Status::SUCCESS, 0),
            _ => (Status::INVALID_OPCODE, 0),
        }
    }

    fn rw(&mut self, shared: &Shared, cmd: &Command) -> Status {
        let Some(ns) = cmd.nsid.checked_sub(1).and_then(|i| self.ns.get(i as usize)) else {
            return Status::INVALID_NAMESPACE;
        };
        let (slba, nlb) = (cmd.slba().0, u64::from(cmd.nlb()));
        if slba.checked_add(nlb).is_none_or(|end| end > ns.blocks) {
            return Status::LBA_OUT_OF_RANGE;
        }
        let len = (nlb * u64::from(ns.lba_size)) as usize;
        if self.mdts != 0 && len > 4096usize << self.mdts {
            return Status::INVALID_FIELD;
        }
        let pos = slba * u64::from(ns.lba_size);
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.resize(len, 0);
        let status = if cmd.opc() == nvm::READ {
            match ns.file.read_exact_at(&mut buf, pos) {
                Ok(()) => transfer(self, shared, cmd, len, Dma::ToHost(&buf)),
                Err(_) => Status::UNRECOVERED_READ_ERROR,
            }
        } else if !ns.writable {
            Status::new(crate::spec::StatusCodeType::Generic, 0x20) // Namespace is Write Protected
        } else {
            match transfer(self, shared, cmd, len, Dma::FromHost(&mut buf)) {
                s if s.is_success() => {
                    let ns = &self.ns[cmd.nsid as usize - 1];
                    match ns.file.write_all_at(&buf, pos) {
                        Ok(()) => Status::SUCCESS,
                        Err(_) => Status::new(crate::spec::StatusCodeType::MediaDataIntegrity, 0x80),
                    }
                }
                s => s,
            }
        };
        self.scratch = buf;
        status
    }
}
