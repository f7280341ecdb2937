"""``pagedkv.vllm_v1.KVCacheManager(...)`` takes exactly the installed vLLM's constructor
arguments, by position and by name, and refuses what vLLM's own constructor refuses with a
``TypeError``: on 0.32, which has no ``num_hash_lookahead_tokens`` (0.33 added it), passing it
raises. Runs on both releases, against ``inspect.signature`` of vLLM's ``KVCacheManager``."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List

import pytest
from manager_driver import kv_cache_config
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

from pagedkv.errors import ArgumentTypeError
from pagedkv.vllm_v1 import KVCacheManager as PagedManager
from pagedkv.vllm_v1._manager import param_names
from pagedkv.vllm_v1._version import require_supported_vllm

REQUIRED = dict(max_model_len=256, scheduler_block_size=16, hash_block_size=16)


def vllm_params() -> Dict[str, inspect.Parameter]:
    """vLLM's constructor parameters after ``self`` and ``kv_cache_config``, in order."""
    params = list(inspect.signature(VLLMManager.__init__).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "kv_cache_config"]
    return {p.name: p for p in params[2:]}


def build(cls: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return cls(kv_cache_config(16, 16), *args, **kwargs)


def both_refuse(*args: Any, **kwargs: Any) -> None:
    """vLLM's constructor and pagedkv's raise ``TypeError`` (pagedkv's an
    :class:`ArgumentTypeError`)."""
    with pytest.raises(TypeError):
        build(VLLMManager, *args, **kwargs)
    with pytest.raises(ArgumentTypeError):
        build(PagedManager, *args, **kwargs)


def test_the_parameters_are_vllms_in_its_order() -> None:
    assert list(param_names()) == list(vllm_params())
    lookahead = "num_hash_lookahead_tokens" in vllm_params()
    assert lookahead == (require_supported_vllm() != "0.32.0")


def test_every_parameter_is_taken_by_name_and_by_position() -> None:
    """Each of vLLM's parameters at its default (the required ones set), by name, then all of
    them by position: both constructors take them, and pagedkv's reads them as vLLM's."""
    values: Dict[str, Any] = {}
    for name, p in vllm_params().items():
        values[name] = REQUIRED[name] if p.default is inspect.Parameter.empty else p.default
    for name, value in values.items():
        kwargs = dict(REQUIRED, **{name: value})
        build(VLLMManager, **kwargs)
        build(PagedManager, **kwargs)
    positional: List[Any] = list(values.values())
    theirs, ours = build(VLLMManager, *positional), build(PagedManager, *positional)
    read = ("max_model_len", "enable_caching", "enable_kv_cache_events", "use_eagle")
    for name in read + ("log_stats", "metrics_collector", "watermark_blocks"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert getattr(ours.block_pool, "num_hash_lookahead_tokens", 0) == getattr(
        theirs.block_pool, "num_hash_lookahead_tokens", 0
    )


@pytest.mark.parametrize("name", ["num_hash_lookahead_tokens", "not_a_parameter"])
def test_a_keyword_vllm_lacks_is_a_type_error(name: str) -> None:
    """``num_hash_lookahead_tokens`` is taken where vLLM has it (0.33) and refused as vLLM
    refuses it where it has none (0.32); an unknown keyword is refused on both."""
    if name in vllm_params():
        build(VLLMManager, **REQUIRED, **{name: 0})
        build(PagedManager, **REQUIRED, **{name: 0})
    else:
        both_refuse(**REQUIRED, **{name: 0})


def test_what_vllms_signature_refuses_is_a_type_error() -> None:
    n = len(vllm_params())
    both_refuse(*([256, 16, 16] + [None] * (n - 3) + [0]))  # one positional too many
    both_refuse(max_model_len=256, scheduler_block_size=16)  # hash_block_size missing
    both_refuse(256, 16, 16, max_model_len=256)  # max_model_len twice
