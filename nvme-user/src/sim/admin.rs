//! Admin commands of the model (§5): Identify (CNS 00h/01h/02h), Create/Delete I/O SQ and CQ,
//! Set/Get Features (Number of Queues), Abort.

use super::io::transfer;
use super::{Cq, Dma, Model, Outcome, Shared, Sq, MAX_QUEUES};
use crate::spec::identify::{ctrl_off, ns_off};
use crate::spec::{admin, Command, LbaFormat, Status};

impl Model {
    pub(crate) fn admin(&mut self, shared: &Shared, cmd: &Command) -> Outcome {
        let (s, dw0) = match cmd.opc() {
            admin::IDENTIFY => self.identify(shared, cmd),
            admin::CREATE_IO_CQ => (self.create_cq(cmd), 0),
            admin::CREATE_IO_SQ => (self.create_sq(cmd), 0),
            admin::DELETE_IO_SQ => (self.delete_sq(shared, cmd), 0),
            admin::DELETE_IO_CQ => (self.delete_cq(cmd), 0),
            admin::SET_FEATURES | admin::GET_FEATURES => self.features(cmd),
            admin::ABORT => self.abort(shared, cmd),
            _ => (Status::INVALID_OPCODE, 0),
        };
        Outcome::Complete(s, dw0)
    }

    fn identify(&mut self, shared: &Shared, cmd: &Command) -> (Status, u32) {
        let mut page = vec![0u8; 4096];
        match (cmd.cdw10 & 0xFF) as u8 {
            admin::CNS_CONTROLLER => {
                let put = |p: &mut [u8], off: usize, s: &str, n: usize| {
                    p[off..off + n].copy_from_slice(format!("{s:<n$}").as_bytes());
                };
                page[ctrl_off::VID..ctrl_off::VID + 2].copy_from_slice(&0x1d1du16.to_le_bytes());
                put(&mut page, ctrl_off::SN, "PICCHIO-SIM-0001", 20);
                put(&mut page, ctrl_off::MN, "Picchio NVMe sim", 40);
                put(&mut page, ctrl_off::FR, "1.0", 8);
                page[ctrl_off::MDTS] = self.mdts;
                page[ctrl_off::CNTLID..ctrl_off::CNTLID + 2].copy_from_slice(&1u16.to_le_bytes());
                page[ctrl_off::VER..ctrl_off::VER + 4].copy_from_slice(&0x0001_0400u32.to_le_bytes());
                page[ctrl_off::SQES] = 0x66;
                page[ctrl_off::CQES] = 0x44;
                page[ctrl_off::NN..ctrl_off::NN + 4].copy_from_slice(&(self.ns.len() as u32).to_le_bytes());
            }
            admin::CNS_NAMESPACE => {
                let Some(ns) = cmd.nsid.checked_sub(1).and_then(|i| self.ns.get(i as usize)) else {
                    return (Status::INVALID_NAMESPACE, 0);
                };
                for off in [ns_off::NSZE, ns_off::NCAP, ns_off::NUSE] {
                    page[off..off + 8].copy_from_slice(&ns.blocks.to_le_bytes());
                }
                page[ns_off::NLBAF] = 0;
                page[ns_off::FLBAS] = 0;
                let f = LbaFormat { ms: 0, lbads: ns.lba_size.trailing_zeros() as u8, rp: 0 };
                page[ns_off::LBAF0..ns_off::LBAF0 + 4].copy_from_slice(&f.raw().to_le_bytes());
            }
            admin::CNS_ACTIVE_NS_LIST => {
                let after = cmd.nsid;
                for (k, nsid) in (1..=self.ns.len() as u32).filter(|&n| n > after).enumerate() {
                    page[k * 4..k * 4 + 4].copy_from_slice(&nsid.to_le_bytes());
                }
            }
            _ => return (Status::INVALID_FIELD, 0),
        }
        (transfer(self, shared, cmd, 4096, Dma::ToHost(&page)), 0)
    }

    /// Abort (§5.1): CDW10 SQID 15:0, CID 31:16. A held command completes with Command Abort
    /// Requested and DW0 bit 0 = 0 ("aborted"); any other command (completed, lost, unknown) is not
    /// aborted: DW0 bit 0 = 1.
    fn abort(&mut self, shared: &Shared, cmd: &Command) -> (Status, u32) {
        let (sqid, cid) = (cmd.cdw10 as u16, (cmd.cdw10 >> 16) as u16);
        let Some(i) = self.held.iter().position(|&h| h == (sqid, cid)) else {
            return (Status::SUCCESS, 1);
        };
        self.held.remove(i);
        let Some(sq) = self.sqs.get(usize::from(sqid)).and_then(Option::as_ref) else {
            return (Status::SUCCESS, 1);
        };
        let (cqid, sqhd) = (usize::from(sq.cqid), sq.head);
        if self.cqs[cqid].is_some() {
            let cqe = crate::spec::Completion { dw0: 0, dw1: 0, sqhd, sqid, cid, status: 0 };
            self.post(shared, cqid, cqe, Status::ABORT_REQUESTED);
        }
        self.stats.aborted += 1;
        (Status::SUCCESS, 0)
    }

    fn create_cq(&mut self, cmd: &Command) -> Status {
        let qid = usize::from(cmd.cdw10 as u16);
        let entries = (cmd.cdw10 >> 16) + 1;
        if qid == 0 || qid >= MAX_QUEUES || self.cqs[qid].is_some() {
            return Status::INVALID_QID;
        }
        if entries < 2 || entries > u32::from(self.cap.mqes()) + 1 {
            return Status::INVALID_QUEUE_SIZE;
        }
        if cmd.cdw11 & 1 == 0 || !cmd.prp1.is_multiple_of(self.page as u64) {
            return Status::INVALID_FIELD; // CAP.CQR = 1: physically contiguous, page-aligned queues only
        }
        self.cqs[qid] = Some(Cq { base: cmd.prp1, entries: entries as u16, tail: 0, phase: true });
        Status::SUCCESS
    }

    fn create_sq(&mut self, cmd: &Command) -> Status {
        let qid = usize::from(cmd.cdw10 as u16);
        let entries = (cmd.cdw10 >> 16) + 1;
        let cqid = (cmd.cdw11 >> 16) as u16;
        if qid == 0 || qid >= MAX_QUEUES || self.sqs[qid].is_some() {
            return Status::INVALID_QID;
        }
        if cqid == 0 || self.cqs.get(usize::from(cqid)).is_none_or(Option::is_none) {
            return Status::CQ_INVALID;
        }
        if entries < 2 || entries > u32::from(self.cap.mqes()) + 1 {
            return Status::INVALID_QUEUE_SIZE;
        }
        if cmd.cdw11 & 1 == 0 || !cmd.prp1.is_multiple_of(self.page as u64) {
            return Status::INVALID_FIELD;
        }
        self.sqs[qid] = Some(Sq { base: cmd.prp1, entries: entries as u16, head: 0, cqid });
        Status::SUCCESS
    }

    fn delete_sq(&mut self, shared: &Shared, cmd: &Command) -> Status {
        let qid = usize::from(cmd.cdw10 as u16);
        if qid == 0 || qid >= MAX_QUEUES || self.sqs[qid].is_none() {
            return Status::INVALID_QID;
        }
        // Commands still outstanding on the SQ complete with Command Aborted due to SQ Deletion.
        let (cqid, sqhd) = self.sqs[qid].as_ref().map(|s| (usize::from(s.cqid), s.head)).expect("checked");
        let held: Vec<u16> = self.held.iter().filter(|h| usize::from(h.0) == qid).map(|h| h.1).collect();
        self.held.retain(|h| usize::from(h.0) != qid);
        for cid in held {
            if self.cqs[cqid].is_some() {
                let cqe = crate::spec::Completion { dw0: 0, dw1: 0, sqhd, sqid: qid as u16, cid, status: 0 };
                self.post(shared, cqid, cqe, Status::ABORTED_SQ_DELETION);
            }
        }
        self.sqs[qid] = None;
        Status::SUCCESS
    }

    fn delete_cq(&mut self, cmd: &Command) -> Status {
        let qid = cmd.cdw10 as u16;
        let q = usize::from(qid);
        if q == 0 || q >= MAX_QUEUES || self.cqs[q].is_none() {
            return Status::INVALID_QID;
        }
        if self.sqs.iter().flatten().any(|s| s.cqid == qid) {
            return Status::INVALID_QUEUE_DELETION;
        }
        self.cqs[q] = None;
        Status::SUCCESS
    }

    fn features(&mut self, cmd: &Command) -> (Status, u32) {
        if (cmd.cdw10 & 0xFF) as u8 != admin::FID_NUMBER_OF_QUEUES {
            return (Status::INVALID_FIELD, 0);
        }
        if cmd.opc() == admin::SET_FEATURES && (cmd.cdw11 & 0xFFFF == 0xFFFF || cmd.cdw11 >> 16 == 0xFFFF) {
            return (Status::INVALID_FIELD, 0);
        }
        let n = u32::from(self.queues_granted - 1);
        (Status::SUCCESS, n | (n << 16))
    }
}
