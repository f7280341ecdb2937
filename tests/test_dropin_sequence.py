"""Drop-in fidelity of pagedkv.sequence with vLLM's vllm/sequence.py (issue 8): fork copies the
logprob containers, every public name of vLLM 0.4.2's module (and 0.5's where they do not
conflict) exists, bad arguments raise pagedkv's typed errors, and a negative computed-token
chunk (which vLLM 0.4.2's chunked-prefill scheduler can produce) is stored as vLLM stores it."""

from __future__ import annotations

import ast
import enum

import pytest

import pagedkv.sequence as ps
from pagedkv import vllm_release
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.sequence import (
    Logprob,
    SequenceData,
    SequenceGroup,
    SequenceStage,
    SequenceStatus,
)
from pagedkv.types import SamplingParams


def sequence(seq_id=1, tokens=(1, 2, 3), bs=4, **kw):
    return ps.Sequence(seq_id, "", list(tokens), bs, **kw)


# ---- item 4: fork copies the logprob containers --------------------------------------------


def test_fork_does_not_share_logprob_dicts_with_the_parent():
    parent = sequence()
    parent.append_token_id(7, {7: Logprob(-0.5), 8: Logprob(-1.5)})
    child = parent.fork(2)
    child.output_logprobs[0][9] = Logprob(-3.0)
    child.output_logprobs[0][7].decoded_token = "seven"  # what a detokenizer does
    assert set(parent.output_logprobs[0]) == {7, 8}
    assert parent.output_logprobs[0][7].decoded_token is None
    assert child.output_logprobs[0][8] == parent.output_logprobs[0][8]
    # the token lists are copied too; the child appends independently
    child.append_token_id(4, {4: Logprob(0.0)})
    assert parent.get_output_len() == 1 and child.get_output_len() == 2
    assert len(parent.output_logprobs) == 1


# ---- item 6: names and typed errors --------------------------------------------------------


def _public_names(version):
    """(module-level names, {class: [methods]}) of vLLM ``version``'s sequence.py."""
    source = (vllm_release.fetch(version) / "vllm" / "sequence.py").read_text()
    names, methods = [], {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names.append(node.name)
            methods[node.name] = [
                f.name
                for f in node.body
                if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
            ]
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")], methods


# Attributes that vLLM 0.5 makes properties and pagedkv (0.4.2's API) sets per instance.
_INSTANCE_ATTRIBUTES = {("Sequence", "prompt"), ("SequenceGroup", "multi_modal_data")}


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
def test_every_public_name_of_vllms_sequence_module_exists(version):
    names, methods = _public_names(version)
    missing = [n for n in names if not hasattr(ps, n)]
    missing += [
        f"{cls}.{m}"
        for cls, ms in methods.items()
        if hasattr(ps, cls)
        for m in ms
        if not hasattr(getattr(ps, cls), m) and (cls, m) not in _INSTANCE_ATTRIBUTES
    ]
    assert missing == []
    group = SequenceGroup("r", [sequence()], SamplingParams(), 0.0)
    assert group.multi_modal_data is None and group.get_seqs()[0].prompt == ""


def test_output_containers_behave_like_vllms():
    lp = {5: Logprob(-0.1)}
    out = ps.SequenceOutput(1, 5, lp)
    assert out == ps.SequenceOutput(1, 5, {5: Logprob(-0.1)}) and out != ps.SequenceOutput(1, 6, lp)
    group_out = ps.CompletionSequenceGroupOutput([out], None)
    assert isinstance(group_out, ps.SequenceGroupOutput)
    assert group_out == ps.SequenceGroupOutput([out], None)
    sampler = ps.SamplerOutput([group_out])
    assert len(sampler) == 1 and sampler[0] is group_out
    sampler[0] = ps.SequenceGroupOutput([], None)
    assert sampler != ps.SamplerOutput([group_out]) and "SamplerOutput" in repr(sampler)
    emb = ps.EmbeddingSequenceGroupOutput([0.5, 0.25])
    assert emb == ps.EmbeddingSequenceGroupOutput([0.5, 0.25]) and emb != group_out
    assert ps.PoolerOutput([emb])[0] is emb
    data = SequenceData([1, 2, 3], [4, 5])
    assert data.get_prompt_token_ids() == [1, 2, 3]
    assert data.get_prefix_token_ids(2) == ((1, 2), None)
    assert data.get_prefix_token_ids(4) == ((1, 2, 3), (4,))
    seq = sequence(tokens=[1, 2])
    assert seq.get_prompt_token_ids() == seq.prompt_token_ids == [1, 2]


def test_bad_arguments_raise_pagedkv_errors():
    with pytest.raises(ArgumentTypeError):
        SequenceGroup("r", [1, 2], SamplingParams(), 0.0)
    seq = sequence()
    with pytest.raises(InvalidArgumentError):
        seq.append_token_id(7, {8: Logprob(0.0)})
    with pytest.raises(ArgumentTypeError):
        seq.append_token_id(7, None)
    with pytest.raises(ArgumentTypeError):
        seq.append_token_id(7, {7: -0.5})  # a float, not a Logprob
    assert seq.get_output_len() == 0 and seq.output_logprobs == []


# ---- item 9: a negative chunk is stored as vLLM stores it ----------------------------------


def test_negative_chunk_is_stored_like_vllm_and_refused_only_when_strict():
    data = SequenceData(list(range(10)))
    data.update_num_computed_tokens(-3)  # vLLM 0.4.2's scheduler can hand this out
    assert data.get_num_computed_tokens() == -3
    assert data.get_num_uncomputed_tokens() == 13 and data.stage == SequenceStage.PREFILL
    data.update_num_computed_tokens(13)
    assert data.stage == SequenceStage.DECODE
    with pytest.raises(InvalidArgumentError):  # over the length: vLLM asserts
        data.update_num_computed_tokens(1)
    strict = sequence(tokens=range(10), strict=True)
    with pytest.raises(InvalidArgumentError):
        strict.data.update_num_computed_tokens(-3)
    assert strict.data.get_num_computed_tokens() == 0
    assert strict.fork(9).data.get_num_computed_tokens() == 0
    group = SequenceGroup("g", [sequence(2, range(5))], SamplingParams(), 0.0)
    group.update_num_computed_tokens(-2)
    assert group.get_num_uncomputed_tokens() == 7


def _progress(data):
    return data.get_num_computed_tokens(), data.stage


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("chunks", [[4, 6, 0], [10], [-3, 13], [3, 8], [10, 1], [-1]])
def test_group_update_matches_sequence_data_update(chunks, strict):
    # SequenceGroup.update_num_computed_tokens inlines SequenceData's accepted case: each
    # chunk must leave both in the same state, and raise (changing nothing) alike.
    group = SequenceGroup("g", [sequence(3, range(10), strict=strict)], SamplingParams(), 0.0)
    oracle = SequenceData(list(range(10)), strict=strict)
    data = group.get_seqs()[0].data
    for n in chunks:
        try:
            oracle.update_num_computed_tokens(n)
        except InvalidArgumentError:
            with pytest.raises(InvalidArgumentError):
                group.update_num_computed_tokens(n)
        else:
            group.update_num_computed_tokens(n)
        assert _progress(data) == _progress(oracle)


# ---- item 5: enums -------------------------------------------------------------------------


def test_enum_members_equal_foreign_members_and_hash_alike():
    class SequenceStatusForeign(enum.Enum):
        RUNNING = 2

    SequenceStatusForeign.__name__ = "SequenceStatus"
    foreign = SequenceStatusForeign.RUNNING
    assert SequenceStatus.RUNNING == foreign and foreign == SequenceStatus.RUNNING
    assert SequenceStatus.WAITING != foreign and not SequenceStatus.RUNNING != foreign
    assert hash(SequenceStatus.RUNNING) == hash(foreign) and foreign in {SequenceStatus.RUNNING}
    assert SequenceStatus.RUNNING != SequenceStatus.WAITING
    assert SequenceStatus.RUNNING != 2 and SequenceStatus.RUNNING.value == 2
    assert SequenceStage.PREFILL != SequenceStatus.RUNNING
    assert isinstance(SequenceStatus.RUNNING, enum.Enum)
    assert repr(SequenceStatus.RUNNING) == "<SequenceStatus.RUNNING: 2>"
    with pytest.raises(TypeError):
        _ = SequenceStatus.RUNNING < SequenceStatus.WAITING
