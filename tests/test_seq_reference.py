"""The plain-Python reference Sequence: its own hashing, and parity with the native one."""

from __future__ import annotations

import copy
import random

import pytest

from pagedkv.reference.hashing import hash_blocks
from pagedkv.reference.sequence import Sequence as RefSequence
from pagedkv.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedkv.types import Logprob, LoRARequest, SamplingParams


def lp(token_id, logprob=-1.0):
    return {token_id: Logprob(logprob)}


def ref_hashes(seq):
    return [seq.hash_of_block(i) for i in range(seq.get_len() // seq.block_size)]


@pytest.mark.parametrize("lora_id, salt", [(0, None), (3, None), (0, "tenant"), (2, b"x")])
def test_reference_hashes_equal_hash_blocks(lora_id, salt):
    lora = LoRARequest("l", lora_id, "/l") if lora_id else None
    seq = RefSequence(0, "p", list(range(11)), 4, lora_request=lora, cache_salt=salt)
    for t in range(40, 53):
        seq.append_token_id(t, lp(t))
    expected = hash_blocks(seq.get_token_ids(), 4, lora_id, salt)
    assert ref_hashes(seq) == expected and len(expected) == 6
    with pytest.raises(ValueError, match="not full"):
        seq.hash_of_block(6)


def test_reference_fork_is_a_deep_copy():
    seq = RefSequence(0, "p", [1, 2, 3], 2)
    seq.append_token_id(4, lp(4))
    child = seq.fork(5)
    child.append_token_id(6, lp(6))
    assert child.seq_id == 5 and seq.get_token_ids() == [1, 2, 3, 4]
    assert child.get_token_ids() == [1, 2, 3, 4, 6] and seq.n_blocks == 2
    assert child.output_logprobs[0] is not seq.output_logprobs[0]


def test_reference_sequence_works_in_groups():
    seqs = [RefSequence(i, "p", [1, 2, 3], 2) for i in range(2)]
    group = SequenceGroup("r", seqs, SamplingParams(n=2), 0.0)
    group.update_num_computed_tokens(3)
    assert not group.is_prefill() and group.get_max_num_running_seqs() == 2
    assert group.prompt_token_ids == [1, 2, 3]


def observe(seq):
    """Everything observable about a sequence that does not depend on the hash function."""
    blocks = seq.logical_token_blocks
    hash_present = []
    for i in range(seq.n_blocks + 1):
        try:
            seq.hash_of_block(i)
            hash_present.append(True)
        except ValueError:
            hash_present.append(False)
    return (
        seq.seq_id,
        seq.get_token_ids(),
        seq.get_len(),
        seq.get_prompt_len(),
        seq.get_output_len(),
        list(seq.get_output_token_ids()),
        seq.get_last_token_id() if seq.get_len() else None,
        round(seq.get_cumulative_logprob(), 9),
        seq.n_blocks,
        [(b.block_number, b.num_tokens, list(b.token_ids)) for b in blocks],
        [seq.block_token_ids(i) for i in range(seq.n_blocks)],
        hash_present,
        seq.data.get_num_computed_tokens(),
        seq.data.stage,
        seq.get_num_new_tokens(),
        seq.is_prefill(),
        seq.is_finished(),
        seq.status,
        len(seq.output_logprobs),
        seq.lora_int_id,
        [seq.num_hashed_tokens_of_block(i) for i in range(seq.n_blocks)],
        repr(seq),
    )


@pytest.mark.parametrize("seed", range(12))
def test_reference_and_native_behave_identically(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 16])
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
    lora = LoRARequest("l", rng.randrange(1, 4), "/l") if rng.random() < 0.5 else None
    kinds = (Sequence, RefSequence)
    seqs = {k: [k(0, "p", prompt, bs, 7, lora)] for k in kinds}
    next_id = 1
    for _ in range(150):
        op = rng.random()
        idx = rng.randrange(len(seqs[Sequence]))
        if op < 0.55:
            tok = rng.randrange(1000)
            logprob = -rng.random()
            for k in kinds:
                seqs[k][idx].append_token_id(tok, {tok: Logprob(logprob), tok + 1: Logprob(-9.0)})
        elif op < 0.65:
            for k in kinds:
                seqs[k].append(seqs[k][idx].fork(next_id))
            next_id += 1
        elif op < 0.8:
            n = rng.randrange(0, 6)
            outcomes = []
            for k in kinds:
                try:
                    seqs[k][idx].data.update_num_computed_tokens(n)
                    outcomes.append(None)
                except ValueError:
                    outcomes.append(ValueError)
            assert outcomes[0] is outcomes[1]
        elif op < 0.85:
            for k in kinds:
                seqs[k][idx].reset_state_for_recompute()
        elif op < 0.9:
            status = rng.choice(list(SequenceStatus))
            for k in kinds:
                seqs[k][idx].status = status
        else:
            for k in kinds:
                seqs[k][idx] = copy.deepcopy(seqs[k][idx])
        for native, ref in zip(seqs[Sequence], seqs[RefSequence]):
            assert observe(native) == observe(ref)
            assert native.data._store.tokens() == ref.get_token_ids()
            # Equal prefixes <=> equal hashes, in both implementations (the hash functions
            # differ, so compare each sequence with the first one rather than across kinds).
            for i in range(native.get_len() // bs):
                if i < seqs[Sequence][0].get_len() // bs:
                    same_native = native.hash_of_block(i) == seqs[Sequence][0].hash_of_block(i)
                    same_ref = ref.hash_of_block(i) == seqs[RefSequence][0].hash_of_block(i)
                    assert same_native == same_ref
