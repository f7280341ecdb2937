"""Small value types (pagedkv.types) and token blocks (pagedkv.block)."""

from __future__ import annotations

import pytest

from pagedkv.block import (
    DEFAULT_LAST_ACCESSED_TIME,
    BlockTable,
    Device,
    LogicalTokenBlock,
    PhysicalTokenBlock,
)
from pagedkv.types import Logprob, LoRARequest, MultiModalData, SamplingParams, SamplingType


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert (sp.n, sp.best_of, sp.temperature, sp.top_p, sp.top_k) == (1, 1, 1.0, 1.0, -1)
    assert (sp.max_tokens, sp.min_tokens, sp.stop, sp.stop_token_ids) == (16, 0, [], [])
    assert not sp.use_beam_search and not sp.ignore_eos
    assert sp.length_penalty == 1.0 and sp.early_stopping is False
    assert sp.logprobs is None and sp.prompt_logprobs is None and sp.seed is None
    assert sp.sampling_type == SamplingType.RANDOM


def test_sampling_params_best_of_defaults_to_n():
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(n=2, best_of=5).best_of == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be at least 1"),
        ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["a", ""]}, "stop"),
        ({"temperature": 0.0, "best_of": 2}, "greedy"),
        ({"use_beam_search": True, "best_of": 1, "temperature": 0.0}, "beam search"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.5}, "temperature"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_k": 5}, "top_k"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "early_stopping": 3}, "early"),
        ({"early_stopping": True}, "early_stopping"),
        ({"length_penalty": 2.0}, "length_penalty"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalisation():
    sp = SamplingParams(stop="###", stop_token_ids=(2, 3), temperature=0.0, top_p=0.5, top_k=3)
    assert sp.stop == ["###"] and sp.stop_token_ids == [2, 3]
    assert (sp.top_p, sp.top_k) == (1.0, -1)  # greedy resets them
    assert sp.sampling_type == SamplingType.GREEDY
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0.0, length_penalty=0.5)
    assert beam.best_of == 2 and beam.sampling_type == SamplingType.BEAM
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(n=2) == SamplingParams(n=2) != SamplingParams(n=3)
    assert "n=2" in repr(SamplingParams(n=2))


def test_logprob_defaults():
    lp = Logprob(-0.5)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.5, None, None)
    assert Logprob(-1.0, 2, "a") == Logprob(logprob=-1.0, rank=2, decoded_token="a")


def test_lora_request():
    a = LoRARequest("a", 1, "/a")
    assert (a.lora_name, a.lora_int_id, a.lora_local_path) == ("a", 1, "/a")
    assert a == LoRARequest("other-name", 1, "/b") and hash(a) == 1
    assert a != LoRARequest("a", 2, "/a")
    with pytest.raises(ValueError, match="> 0"):
        LoRARequest("z", 0, "/z")
    with pytest.raises(TypeError):
        LoRARequest("z", "1", "/z")


def test_multi_modal_data():
    payload = object()
    mm = MultiModalData(MultiModalData.Type.IMAGE, payload)
    assert mm.type is MultiModalData.Type.IMAGE and mm.data is payload
    assert "IMAGE" in repr(mm)


def test_logical_token_block():
    block = LogicalTokenBlock(block_number=2, block_size=4)
    assert block.token_ids == [-1] * 4 and block.num_tokens == 0 and block.is_empty()
    block.append_tokens([7, 8])
    assert block.token_ids == [7, 8, -1, -1] and block.get_num_empty_slots() == 2
    assert block.get_token_ids() == [7, 8] and block.get_last_token_id() == 8
    assert not block.is_full()
    with pytest.raises(ValueError, match="cannot append 3 tokens"):
        block.append_tokens([1, 2, 3])
    block.append_tokens([9, 10])
    assert block.is_full() and block.token_ids == [7, 8, 9, 10]
    with pytest.raises(ValueError):
        LogicalTokenBlock(0, 4).get_last_token_id()


def test_physical_token_block_defaults():
    block = PhysicalTokenBlock(Device.GPU, 3, 16, 12345, 32)
    assert (block.device, block.block_number, block.block_size) == (Device.GPU, 3, 16)
    assert (block.block_hash, block.num_hashed_tokens) == (12345, 32)
    assert block.ref_count == 0 and block.computed is False
    assert block.last_accessed == DEFAULT_LAST_ACCESSED_TIME == -1
    assert "block_number=3" in repr(block) and "ref_count=0" in repr(block)
    table: BlockTable = [block]
    assert table[0] is block
    assert {d.name for d in Device} == {"GPU", "CPU"}
