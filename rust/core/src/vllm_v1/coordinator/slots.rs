//! The coordinator's request slots: each request id the coordinator holds state for maps to a
//! [`ReqSlot`], the index every group keeps that request's table under. One hash lookup per
//! coordinator call then serves every group (an index each), rather than a lookup by id in
//! every group several times a call.
//!
//! Invariants: an id has at most one slot and a slot at most one id; a released slot is
//! reused by the next new id (lowest-cost reuse: the free list is a stack), so the slot count
//! stays at the most requests ever held at once; [`ReqSlot::UNKNOWN`] is never assigned.
//! A slot is released only once every group has forgotten its request (the coordinator's
//! `free` / `pop_blocks_for_free`).
//!
//! Costs: `get` / `get_or_insert` one hash of the id and one probe; `release` the same plus a
//! push. Memory: the id once, 4 B of slot per entry, the map's table and the free list.

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::vllm_v1::single_type::ReqSlot;

#[derive(Clone, Debug, Default)]
pub(super) struct ReqSlots {
    ids: HashMap<Box<str>, ReqSlot, RandomState>,
    /// Slots released, reused last-released first.
    free: Vec<ReqSlot>,
    /// Slots ever assigned (the next new one).
    next: u32,
}

impl ReqSlots {
    /// The request's slot, [`ReqSlot::UNKNOWN`] if it has none (reads then see an unknown
    /// request in every group).
    pub(super) fn get(&self, req: &str) -> ReqSlot {
        self.ids.get(req).copied().unwrap_or(ReqSlot::UNKNOWN)
    }

    /// The request's slot, assigned if it has none.
    pub(super) fn get_or_insert(&mut self, req: &str) -> ReqSlot {
        if let Some(&slot) = self.ids.get(req) {
            return slot;
        }
        let slot = self.free.pop().unwrap_or_else(|| {
            let s = ReqSlot(self.next);
            self.next += 1;
            s
        });
        self.ids.insert(req.into(), slot);
        slot
    }

    /// Forget the request (its groups have forgotten it); its slot, if it had one.
    pub(super) fn release(&mut self, req: &str) -> ReqSlot {
        match self.ids.remove(req) {
            Some(slot) => {
                self.free.push(slot);
                slot
            }
            None => ReqSlot::UNKNOWN,
        }
    }

    /// Every held id with its slot (tests and introspection).
    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, ReqSlot)> {
        self.ids.iter().map(|(k, &s)| (&**k, s))
    }

    /// Heap bytes held (memory accounting).
    pub(super) fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        let ids: usize = self.ids.keys().map(|k| k.len()).sum();
        let table = table_bytes(self.ids.capacity(), size_of::<(Box<str>, ReqSlot)>());
        ids + table + vec_bytes(&self.free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_keeps_its_slot_until_released_and_slots_are_reused() {
        let mut s = ReqSlots::default();
        assert_eq!(s.get("a"), ReqSlot::UNKNOWN);
        let a = s.get_or_insert("a");
        let b = s.get_or_insert("b");
        assert_ne!(a, b);
        assert_eq!(s.get_or_insert("a"), a);
        assert_eq!(s.get("b"), b);
        assert_eq!(s.release("a"), a);
        assert_eq!(s.get("a"), ReqSlot::UNKNOWN);
        assert_eq!(s.release("a"), ReqSlot::UNKNOWN);
        // The released slot serves the next new id; the count of slots does not grow.
        assert_eq!(s.get_or_insert("c"), a);
        assert_eq!(s.next, 2);
    }
}
