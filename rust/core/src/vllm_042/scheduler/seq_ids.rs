//! [`SeqIds`]: a group's running sequence ids, without a heap allocation for the usual
//! single sequence. `build_meta` makes one per scheduled group per step; with thousands of
//! groups, one small `Vec` each was a measurable share of a step (the allocator's free
//! lists, consolidated by the step's large buffers, were walked for every one of them).

use crate::vllm_042::manager::SeqId;
use std::ops::Deref;

/// Sequence ids, read as a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SeqIds {
    One([SeqId; 1]),
    Many(Vec<SeqId>),
}

impl Default for SeqIds {
    fn default() -> Self {
        SeqIds::Many(Vec::new())
    }
}

impl FromIterator<SeqId> for SeqIds {
    fn from_iter<I: IntoIterator<Item = SeqId>>(iter: I) -> Self {
        let mut it = iter.into_iter();
        let Some(first) = it.next() else {
            return SeqIds::default();
        };
        match it.next() {
            None => SeqIds::One([first]),
            Some(second) => {
                let mut v = vec![first, second];
                v.extend(it);
                SeqIds::Many(v)
            }
        }
    }
}

impl Deref for SeqIds {
    type Target = [SeqId];
    fn deref(&self) -> &[SeqId] {
        match self {
            SeqIds::One(a) => a,
            SeqIds::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a SeqIds {
    type Item = &'a SeqId;
    type IntoIter = std::slice::Iter<'a, SeqId>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq<Vec<SeqId>> for SeqIds {
    fn eq(&self, other: &Vec<SeqId>) -> bool {
        **self == other[..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_as_the_ids_collected() {
        for ids in [vec![], vec![7], vec![7, 3], vec![1, 2, 3, 4]] {
            let s: SeqIds = ids.iter().copied().collect();
            assert_eq!(s, ids);
            assert_eq!(s.len(), ids.len());
            assert_eq!((&s).into_iter().copied().collect::<Vec<_>>(), ids);
            assert_eq!(matches!(s, SeqIds::One(_)), ids.len() == 1);
        }
    }
}
