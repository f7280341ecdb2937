//! vLLM v1's block hash, byte for byte, for the blocks the native loop fills while decoding.
//!
//! vLLM hashes a full block as `hash_fn((parent, tuple(block_tokens), extra_keys))`
//! (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`), where `hash_fn` is one of
//! `vllm.utils.hashing`'s `sha256` (SHA-256 of the pickle, protocol 5), `sha256_cbor`
//! (SHA-256 of canonical CBOR), `xxhash` and `xxhash_cbor` (xxh3-128 digest, big-endian, of
//! the same encodings). Here a block has a parent (a cache salt only keys the first block)
//! and the request's own extra keys `E` ([`RequestKeys`]) are `None` (no LoRA, multimodal
//! inputs or prompt embeddings) or a LoRA adapter's `(("lora", name, path),)` (vLLM
//! 0.32/0.33's `_gen_lora_extra_hash_keys`, nothing else keying the request). The block's
//! `extra_keys` are `E`; or, with vLLM 0.33's lookahead block hashes
//! (`num_hash_lookahead_tokens` L > 0), `(E, t_1, .., t_L)`, the L tokens after the block.
//! The caller checks those conditions; this module only encodes and digests.
//!
//! The encodings are written out for exactly that value shape, as CPython's C pickler and
//! `cbor2` write it: a 3-tuple of bytes, a tuple of ints and `E` (or a tuple of `E` and
//! ints). A token outside `i32` (pickle) or `i64` (CBOR), a parent over 255 bytes, or a LoRA
//! string over 255 bytes or equal to `"lora"` gets `None` back: the caller asks vLLM's own
//! hasher. (The pickler memoizes each string by identity: `"lora"` as a name may be the very
//! object vLLM's tag is, and then it is pickled as a memo reference; the caller also checks
//! that name and path are distinct objects.) Cost: O(tokens) bytes encoded, one digest; no
//! allocation beyond the returned digest when the scratch buffer is reused.

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

/// A request's own extra hash keys past its first block, of the shapes this module encodes
/// (vLLM's `generate_block_hash_extra_keys` for a block past the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RequestKeys {
    /// No LoRA adapter, multimodal inputs or prompt embeddings: `None`.
    #[default]
    Plain,
    /// A LoRA adapter and nothing else: `(("lora", name, path),)`.
    Lora { name: String, path: String },
}

impl RequestKeys {
    /// The LoRA strings, if they are within the encoding (see the module's notes).
    fn lora(&self) -> Option<Option<(&str, &str)>> {
        match self {
            RequestKeys::Plain => Some(None),
            RequestKeys::Lora { name, path } => {
                let fits = |s: &str| s.len() <= 255 && s != LORA_TAG;
                (fits(name) && fits(path)).then_some(Some((name.as_str(), path.as_str())))
            }
        }
    }
}

/// The tag of vLLM's LoRA extra key.
const LORA_TAG: &str = "lora";

/// The hash of a full block with a parent, the request's extra keys `keys`, `ahead` its
/// lookahead tokens (empty: no lookahead, extra keys `E`); `scratch` is reused between
/// calls. `None`: a value this module does not encode (see the module's notes).
pub fn block_hash(
    f: HashFn,
    parent: &[u8],
    tokens: &[i64],
    keys: &RequestKeys,
    ahead: &[i64],
    scratch: &mut Vec<u8>,
) -> Option<Vec<u8>> {
    scratch.clear();
    let lora = keys.lora()?;
    if f.cbor() {
        encode_cbor(parent, tokens, lora, ahead, scratch)?;
    } else {
        encode_pickle(parent, tokens, lora, ahead, scratch)?;
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
const TUPLE1: u8 = 0x85;
const SHORT_BINUNICODE: u8 = 0x8c;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NONE: u8 = b'N';
const STOP: u8 = b'.';

/// `pickle.dumps((parent, tuple(tokens), extra), protocol=5)` as CPython's C pickler writes
/// it, `extra` being `E` (`ahead` empty) or `(E, *ahead)`, `E` being `None` (`lora` `None`)
/// or `(("lora", name, path),)`: one frame (the value is far below the 64 KiB frame target),
/// each bytes, str and tuple memoized once, ints in the shortest of BININT1/BININT2/BININT,
/// tuples of 1-3 items as TUPLE1-3 (no MARK).
pub fn encode_pickle(
    parent: &[u8],
    tokens: &[i64],
    lora: Option<(&str, &str)>,
    ahead: &[i64],
    out: &mut Vec<u8>,
) -> Option<()> {
    let parent_len = u8::try_from(parent.len()).ok()?;
    let mut body = Vec::with_capacity(parent.len() + 5 * (tokens.len() + ahead.len()) + 600);
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
        0 => pickle_request_keys(&mut body, lora)?,
        n => {
            if n >= 3 {
                body.push(MARK);
            }
            pickle_request_keys(&mut body, lora)?;
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

/// `E` pickled: `None`, or `(("lora", name, path),)` (three distinct short strings).
fn pickle_request_keys(body: &mut Vec<u8>, lora: Option<(&str, &str)>) -> Option<()> {
    let Some((name, path)) = lora else {
        body.push(NONE);
        return Some(());
    };
    for s in [LORA_TAG, name, path] {
        body.extend_from_slice(&[SHORT_BINUNICODE, u8::try_from(s.len()).ok()?]);
        body.extend_from_slice(s.as_bytes());
        body.push(MEMOIZE);
    }
    body.extend_from_slice(&[TUPLE3, MEMOIZE, TUPLE1, MEMOIZE]);
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
/// [`encode_pickle`]: tuples are arrays, `None` is null, strings are text strings.
pub fn encode_cbor(
    parent: &[u8],
    tokens: &[i64],
    lora: Option<(&str, &str)>,
    ahead: &[i64],
    out: &mut Vec<u8>,
) -> Option<()> {
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
    match lora {
        None => out.push(0xf6),
        Some((name, path)) => {
            cbor_head(out, 4, 1);
            cbor_head(out, 4, 3);
            for s in [LORA_TAG, name, path] {
                cbor_head(out, 3, s.len() as u64);
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
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
        encode_pickle(&[1, 2], &[1, 300, 70000, -1], None, &[], &mut out).unwrap();
        let want: &[u8] = b"\x80\x05\x95\x1b\x00\x00\x00\x00\x00\x00\x00C\x02\x01\x02\x94(K\x01M,\x01J\x70\x11\x01\x00J\xff\xff\xff\xfft\x94N\x87\x94.";
        assert_eq!(out, want);
    }

    #[test]
    fn cbor_matches_cbor2_for_a_small_block() {
        // cbor2.dumps((b"\x01\x02", (1, 300, 70000, -1), None), canonical=True)
        let mut out = Vec::new();
        encode_cbor(&[1, 2], &[1, 300, 70000, -1], None, &[], &mut out).unwrap();
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
            encode_pickle(&[1, 2], &[1, 300, 70000, -1], None, ahead, &mut out).unwrap();
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
        encode_cbor(&[1, 2], &[1, 300, 70000, -1], None, &[5], &mut out).unwrap();
        let want: &[u8] = b"\x83B\x01\x02\x84\x01\x19\x01,\x1a\x00\x01\x11p \x82\xf6\x05";
        assert_eq!(out, want);
    }

    #[test]
    fn values_outside_the_encoded_shape_are_refused() {
        const P: RequestKeys = RequestKeys::Plain;
        let mut s = Vec::new();
        assert!(block_hash(HashFn::Sha256, &[0; 256], &[1, 2, 3, 4], &P, &[], &mut s).is_none());
        assert!(block_hash(
            HashFn::Sha256,
            &[0; 32],
            &[1 << 31, 2, 3, 4],
            &P,
            &[],
            &mut s
        )
        .is_none());
        assert!(block_hash(HashFn::Sha256, &[0; 32], &[1, 2, 3], &P, &[], &mut s).is_none());
        assert!(block_hash(
            HashFn::Sha256,
            &[0; 32],
            &[1, 2, 3, 4],
            &P,
            &[1 << 31],
            &mut s
        )
        .is_none());
        assert_eq!(
            block_hash(
                HashFn::Sha256Cbor,
                &[0; 32],
                &[1 << 40, 2, 3, 4],
                &P,
                &[],
                &mut s
            )
            .map(|h| h.len()),
            Some(32)
        );
        assert_eq!(
            block_hash(HashFn::Xxhash, &[0; 16], &[1, 2, 3, 4], &P, &[9], &mut s).map(|h| h.len()),
            Some(16)
        );
    }

    fn lora(name: &str, path: &str) -> RequestKeys {
        RequestKeys::Lora {
            name: name.into(),
            path: path.into(),
        }
    }

    #[test]
    fn lora_keys_pickle_as_cpython_pickles_them() {
        // pickle.dumps((b"\x01\x02", (1, 300, 70000, -1), E), protocol=5), E the LoRA key
        // (("lora", "sql-adapter", "/ad/sql"),); then with lookahead (E, 5) and (E, 5, 6, 7).
        let head: &[u8] = b"C\x02\x01\x02\x94(K\x01M,\x01Jp\x11\x01\x00J\xff\xff\xff\xfft\x94";
        let e: &[u8] =
            b"\x8c\x04lora\x94\x8c\x0bsql-adapter\x94\x8c\x07/ad/sql\x94\x87\x94\x85\x94";
        // (lookahead tokens, the MARK before E, what follows E, the frame's length)
        type Case<'a> = (&'a [i64], &'a [u8], &'a [u8], u8);
        let cases: [Case; 3] = [
            (&[], b"", b"", 0x3d),
            (&[5], b"", b"K\x05\x86\x94", 0x41),
            (&[5, 6, 7], b"(", b"K\x05K\x06K\x07t\x94", 0x46),
        ];
        let keys = lora("sql-adapter", "/ad/sql");
        for (ahead, mark, tail, len) in cases {
            let mut out = Vec::new();
            let lora = keys.lora().unwrap();
            encode_pickle(&[1, 2], &[1, 300, 70000, -1], lora, ahead, &mut out).unwrap();
            let mut want = vec![0x80, 5, 0x95, len, 0, 0, 0, 0, 0, 0, 0];
            for part in [head, mark, e, tail, b"\x87\x94."] {
                want.extend_from_slice(part);
            }
            assert_eq!(out, want, "{ahead:?}");
        }
    }

    #[test]
    fn lora_keys_encode_as_cbor2_encodes_them() {
        // cbor2.dumps((b"\x01\x02", (1, 300, 70000, -1), E), canonical=True), then (E, 5, 6, 7)
        let head: &[u8] = b"\x83B\x01\x02\x84\x01\x19\x01,\x1a\x00\x01\x11p ";
        let e: &[u8] = b"\x81\x83dloraksql-adapterg/ad/sql";
        let cases: [(&[i64], &[u8], &[u8]); 2] =
            [(&[], b"", b""), (&[5, 6, 7], b"\x84", b"\x05\x06\x07")];
        for (ahead, array, tail) in cases {
            let mut out = Vec::new();
            let lora = Some(("sql-adapter", "/ad/sql"));
            encode_cbor(&[1, 2], &[1, 300, 70000, -1], lora, ahead, &mut out).unwrap();
            assert_eq!(out, [head, array, e, tail].concat(), "{ahead:?}");
        }
    }

    #[test]
    fn lora_strings_outside_the_encoding_are_refused() {
        let mut s = Vec::new();
        let long = "x".repeat(256);
        for keys in [
            lora("lora", "/p"),
            lora("a", "lora"),
            lora(&long, "/p"),
            lora("a", &long),
        ] {
            for f in [HashFn::Sha256, HashFn::XxhashCbor] {
                assert!(block_hash(f, &[0; 32], &[1, 2, 3, 4], &keys, &[], &mut s).is_none());
            }
        }
        let fits = lora(&"y".repeat(255), "");
        assert!(block_hash(HashFn::Sha256, &[0; 32], &[1, 2, 3, 4], &fits, &[], &mut s).is_some());
    }
}
