//! vLLM v1's block hash, byte for byte, for the blocks the native loop fills while decoding.
//!
//! vLLM hashes a full block as `hash_fn((parent, tuple(block_tokens), extra_keys))`
//! (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`), where `hash_fn` is one of
//! `vllm.utils.hashing`'s `sha256` (SHA-256 of the pickle, protocol 5), `sha256_cbor`
//! (SHA-256 of canonical CBOR), `xxhash` and `xxhash_cbor` (xxh3-128 digest, big-endian, of
//! the same encodings). Here `extra_keys` is `None`: a block with a parent of a request
//! without LoRA, multimodal inputs or prompt embeddings (a cache salt only keys the first
//! block); or, with vLLM 0.33's lookahead block hashes (`num_hash_lookahead_tokens` L > 0),
//! `(None, t_1, .., t_L)`, the request's (absent) extra keys over the block and its lookahead
//! followed by the L tokens after the block. The caller checks those conditions; this module
//! only encodes and digests.
//!
//! The encodings are written out for exactly that value shape, as CPython's C pickler and
//! `cbor2` write it: a 3-tuple of bytes, a tuple of ints and `None` (or a tuple of `None` and
//! ints). A token outside
//! `i32` (pickle) or `i64` (CBOR) or a parent over 255 bytes gets `None` back: the caller
//! asks vLLM's own hasher. Cost: O(tokens) bytes encoded, one digest; no allocation beyond
//! the returned digest when the scratch buffer is reused.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

/// `vllm.utils.hashing`'s block hash functions (`prefix_caching_hash_algo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashFn {
    Sha256,
    Sha256Cbor,
    Xxhash,
    XxhashCbor,
}

impl HashFn {
    /// vLLM's name for it (`get_hash_fn_by_name`).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(HashFn::Sha256),
            "sha256_cbor" => Some(HashFn::Sha256Cbor),
            "xxhash" => Some(HashFn::Xxhash),
            "xxhash_cbor" => Some(HashFn::XxhashCbor),
            _ => None,
        }
    }

    fn cbor(self) -> bool {
        matches!(self, HashFn::Sha256Cbor | HashFn::XxhashCbor)
    }
}

/// The hash of a full block with a parent and no extra keys, `ahead` its lookahead tokens
/// (empty: no lookahead, extra keys `None`); `scratch` is reused between calls. `None`: a
/// value this module does not encode (see the module's notes).
pub fn block_hash(
    f: HashFn,
    parent: &[u8],
    tokens: &[i64],
    ahead: &[i64],
    scratch: &mut Vec<u8>,
) -> Option<Vec<u8>> {
    scratch.clear();
    if f.cbor() {
        encode_cbor(parent, tokens, ahead, scratch)?;
    } else {
        encode_pickle(parent, tokens, ahead, scratch)?;
    }
    Some(match f {
        HashFn::Sha256 | HashFn::Sha256Cbor => Sha256::digest(&scratch[..]).to_vec(),
        HashFn::Xxhash | HashFn::XxhashCbor => xxh3_128(scratch).to_be_bytes().to_vec(),
    })
}

// Pickle opcodes (protocol 5) that this value shape uses.
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const TUPLE: u8 = b't';
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NONE: u8 = b'N';
const STOP: u8 = b'.';

/// `pickle.dumps((parent, tuple(tokens), extra), protocol=5)` as CPython's C pickler writes
/// it, `extra` being `None` (`ahead` empty) or `(None, *ahead)`: one frame (the value is far
/// below the 64 KiB frame target), each bytes and tuple memoized once, ints in the shortest
/// of BININT1/BININT2/BININT, tuples of 1-3 items as TUPLE1-3 (no MARK).
pub fn encode_pickle(
    parent: &[u8],
    tokens: &[i64],
    ahead: &[i64],
    out: &mut Vec<u8>,
) -> Option<()> {
    let parent_len = u8::try_from(parent.len()).ok()?;
    let mut body = Vec::with_capacity(parent.len() + 5 * (tokens.len() + ahead.len()) + 20);
    body.extend_from_slice(&[SHORT_BINBYTES, parent_len]);
    body.extend_from_slice(parent);
    body.push(MEMOIZE);
    // A block has more tokens than 3 unless its size is 1-3, which the loop does not hand here.
    if tokens.len() <= 3 {
        return None;
    }
    body.push(MARK);
    for &t in tokens {
        pickle_int(&mut body, t)?;
    }
    body.extend_from_slice(&[TUPLE, MEMOIZE]);
    match ahead.len() {
        0 => body.push(NONE),
        n => {
            if n >= 3 {
                body.push(MARK);
            }
            body.push(NONE);
            for &t in ahead {
                pickle_int(&mut body, t)?;
            }
            body.push(match n {
                1 => TUPLE2,
                2 => TUPLE3,
                _ => TUPLE,
            });
            body.push(MEMOIZE);
        }
    }
    body.extend_from_slice(&[TUPLE3, MEMOIZE, STOP]);
    out.extend_from_slice(&[PROTO, 5, FRAME]);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    Some(())
}

/// An int as the C pickler writes it (`None`: outside `i32`, which it writes otherwise).
fn pickle_int(body: &mut Vec<u8>, t: i64) -> Option<()> {
    let le = i32::try_from(t).ok()?.to_le_bytes();
    if le[2] != 0 || le[3] != 0 {
        body.push(BININT);
        body.extend_from_slice(&le);
    } else if le[1] != 0 {
        body.extend_from_slice(&[BININT2, le[0], le[1]]);
    } else {
        body.extend_from_slice(&[BININT1, le[0]]);
    }
    Some(())
}

/// `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)`, `extra` as in
/// [`encode_pickle`]: tuples are arrays, `None` is null.
pub fn encode_cbor(parent: &[u8], tokens: &[i64], ahead: &[i64], out: &mut Vec<u8>) -> Option<()> {
    cbor_head(out, 4, 3);
    cbor_head(out, 2, parent.len() as u64);
    out.extend_from_slice(parent);
    cbor_head(out, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_int(out, t);
    }
    if !ahead.is_empty() {
        cbor_head(out, 4, 1 + ahead.len() as u64);
    }
    out.push(0xf6);
    for &t in ahead {
        cbor_int(out, t);
    }
    Some(())
}

fn cbor_int(out: &mut Vec<u8>, t: i64) {
    if t >= 0 {
        cbor_head(out, 0, t as u64);
    } else {
        cbor_head(out, 1, (-1 - t) as u64);
    }
}

/// A CBOR item head: major type and argument in the shortest form.
fn cbor_head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        out.push(m | arg as u8);
    } else if arg <= 0xff {
        out.extend_from_slice(&[m | 24, arg as u8]);
    } else if arg <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(arg as u16).to_be_bytes());
    } else if arg <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pickle_matches_cpython_for_a_small_block() {
        // pickle.dumps((b"\x01\x02", (1, 300, 70000, -1), None), protocol=5)
        let mut out = Vec::new();
        encode_pickle(&[1, 2], &[1, 300, 70000, -1], &[], &mut out).unwrap();
        let want: &[u8] = b"\x80\x05\x95\x1b\x00\x00\x00\x00\x00\x00\x00C\x02\x01\x02\x94(K\x01M,\x01J\x70\x11\x01\x00J\xff\xff\xff\xfft\x94N\x87\x94.";
        assert_eq!(out, want);
    }

    #[test]
    fn cbor_matches_cbor2_for_a_small_block() {
        // cbor2.dumps((b"\x01\x02", (1, 300, 70000, -1), None), canonical=True)
        let mut out = Vec::new();
        encode_cbor(&[1, 2], &[1, 300, 70000, -1], &[], &mut out).unwrap();
        let want: &[u8] = b"\x83B\x01\x02\x84\x01\x19\x01,\x1a\x00\x01\x11p \xf6";
        assert_eq!(out, want);
    }

    #[test]
    fn lookahead_pickles_match_cpython() {
        // pickle.dumps((b"\x01\x02", (1, 300, 70000, -1), (None, *ahead)), protocol=5)
        let head: &[u8] = b"C\x02\x01\x02\x94(K\x01M,\x01Jp\x11\x01\x00J\xff\xff\xff\xfft\x94";
        let cases: [(&[i64], &[u8], u8); 3] = [
            (&[5], b"NK\x05\x86\x94", 0x1f),
            (&[5, 6], b"NK\x05K\x06\x87\x94", 0x21),
            (&[5, 6, 7], b"(NK\x05K\x06K\x07t\x94", 0x24),
        ];
        for (ahead, extra, len) in cases {
            let mut out = Vec::new();
            encode_pickle(&[1, 2], &[1, 300, 70000, -1], ahead, &mut out).unwrap();
            let mut want = vec![0x80, 5, 0x95, len, 0, 0, 0, 0, 0, 0, 0];
            want.extend_from_slice(head);
            want.extend_from_slice(extra);
            want.extend_from_slice(b"\x87\x94.");
            assert_eq!(out, want, "{ahead:?}");
        }
    }

    #[test]
    fn lookahead_cbor_matches_cbor2() {
        // cbor2.dumps((b"\x01\x02", (1, 300, 70000, -1), (None, 5)), canonical=True)
        let mut out = Vec::new();
        encode_cbor(&[1, 2], &[1, 300, 70000, -1], &[5], &mut out).unwrap();
        let want: &[u8] = b"\x83B\x01\x02\x84\x01\x19\x01,\x1a\x00\x01\x11p \x82\xf6\x05";
        assert_eq!(out, want);
    }

    #[test]
    fn values_outside_the_encoded_shape_are_refused() {
        let mut s = Vec::new();
        assert!(block_hash(HashFn::Sha256, &[0; 256], &[1, 2, 3, 4], &[], &mut s).is_none());
        assert!(block_hash(HashFn::Sha256, &[0; 32], &[1 << 31, 2, 3, 4], &[], &mut s).is_none());
        assert!(block_hash(HashFn::Sha256, &[0; 32], &[1, 2, 3], &[], &mut s).is_none());
        assert!(block_hash(HashFn::Sha256, &[0; 32], &[1, 2, 3, 4], &[1 << 31], &mut s).is_none());
        assert_eq!(
            block_hash(
                HashFn::Sha256Cbor,
                &[0; 32],
                &[1 << 40, 2, 3, 4],
                &[],
                &mut s
            )
            .map(|h| h.len()),
            Some(32)
        );
        assert_eq!(
            block_hash(HashFn::Xxhash, &[0; 16], &[1, 2, 3, 4], &[9], &mut s).map(|h| h.len()),
            Some(16)
        );
    }
}
