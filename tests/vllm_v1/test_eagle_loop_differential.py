"""vLLM's scheduler with EAGLE's KV cache rules (``use_eagle_block_drop``): vLLM's own loop
and manager against pagedkv's native loop and manager, lockstep (``v1_harness.Lockstep``),
one group and hybrid layouts, with preemption, aborts and prefix caching.

Scheduler-only EAGLE, as vLLM's own scheduler tests do it: the harness's n-gram speculative
configuration reports itself as an EAGLE method (``SpeculativeConfig.use_eagle``) while both
schedulers are built, so each builds its manager with ``use_eagle=True`` and reads a prefill
lookahead of 1 (``VllmConfig.num_prefill_lookahead_tokens``); on 0.33 its lookahead block
hashes are off here (as ``disable_lookahead_block_hashes`` turns them off), which is what
makes 0.33 drop blocks at all. Drafts stay the harness's.

The same engines with 0.33's default for EAGLE and prefix caching, lookahead block hashes
(``num_hash_lookahead_tokens`` 1: no drop, each hash covering the token after its block, the
requests' hasher vLLM's own), are compared in the ``lookahead`` tests, streaming sessions
included (their hashes recomputed at a lookup from nothing computed)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Iterator, Optional

import pytest
import v1_harness as h
from manager_driver import HYBRID_LAYOUTS, MAMBA_ALIGN_LAYOUTS, RETENTIONS, retention_interval
from test_differential import assert_native_loop
from vllm.config import SpeculativeConfig, VllmConfig

#: Layouts EAGLE runs natively on (a chunked local group stays vLLM's manager).
LAYOUTS = [""] + sorted(k for k in HYBRID_LAYOUTS if k != "llama4")


@pytest.fixture
def eagle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every speculative configuration built meanwhile is an EAGLE one to the scheduler."""
    monkeypatch.setattr(SpeculativeConfig, "use_eagle", lambda self: True)
    if hasattr(VllmConfig, "num_hash_lookahead_tokens"):
        monkeypatch.setattr(VllmConfig, "num_hash_lookahead_tokens", property(lambda self: 0))
    yield


#: vLLM 0.33's lookahead block hashes; 0.32 has none.
LOOKAHEAD = pytest.mark.lookahead_hashes  # deselected where vLLM has none (conftest.py)


@pytest.fixture
def eagle_lookahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every speculative configuration built meanwhile is an EAGLE one, and vLLM's own
    default stands: lookahead block hashes with prefix caching."""
    monkeypatch.setattr(SpeculativeConfig, "use_eagle", lambda self: True)
    yield


@pytest.fixture
def mtp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every speculative configuration built meanwhile is a multi-module MTP one to the
    scheduler (``use_multi_module_mtp``: a prefill lookahead of ``num_speculative_tokens``);
    on 0.33 lookahead block hashes off, as in :func:`eagle`."""
    monkeypatch.setattr(SpeculativeConfig, "use_eagle", lambda self: True)
    monkeypatch.setattr(SpeculativeConfig, "use_multi_module_mtp", lambda self: True)
    if hasattr(VllmConfig, "num_hash_lookahead_tokens"):
        monkeypatch.setattr(VllmConfig, "num_hash_lookahead_tokens", property(lambda self: 0))
    yield


@pytest.fixture
def mtp_lookahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Multi-module MTP with vLLM 0.33's default: lookahead block hashes as long as the
    prefill lookahead (no drop)."""
    monkeypatch.setattr(SpeculativeConfig, "use_eagle", lambda self: True)
    monkeypatch.setattr(SpeculativeConfig, "use_multi_module_mtp", lambda self: True)
    yield


def eagle_seed(seed: int) -> tuple:
    layout = LAYOUTS[seed % len(LAYOUTS)]
    mode = RETENTIONS[seed // len(LAYOUTS) % len(RETENTIONS)]
    return layout, mode


def run_eagle_seed(seed: int, model_dir: Path, manager_cls: type, caching_off: bool = True) -> dict:
    """``v1_harness.run_seed`` with drafts (2 or 4) and prefix caching on (off for one seed
    in seven when ``caching_off``), the layout and retention of :func:`eagle_seed`."""
    rng = random.Random(seed)
    layout, mode = eagle_seed(seed)
    cfg = h.random_config(rng)
    caching = not (caching_off and seed % 7 == 6)
    cfg = dataclasses.replace(cfg, num_spec_tokens=(2, 4)[seed % 2], enable_caching=caching)
    retention: Optional[int] = retention_interval(mode, layout, cfg.block_size) if layout else None
    cfg = h.with_layout(cfg, layout, retention)
    capped = dataclasses.replace(cfg, max_model_len=h.length_cap(cfg))
    specs = h.with_switch_requests(seed, h.random_workload(rng, capped))
    return h.Lockstep(cfg, specs, seed, model_dir, manager_cls).run()


@pytest.mark.parametrize("seed", range(24))
def test_eagle_lockstep(seed: int, tiny_model_dir: Path, manager_cls: type, eagle: None) -> None:
    stats = run_eagle_seed(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=True)


def test_the_eagle_scheduler_builds_an_eagle_manager(tiny_model_dir: Path, eagle: None) -> None:
    """The fixture's engine: vLLM's scheduler asks for the drop (``use_eagle_block_drop``),
    pagedkv's native manager drops and its native loop runs the engine."""
    from pagedkv.vllm_v1 import KVCacheManager
    from pagedkv.vllm_v1._scope import engine_out_of_scope

    cfg = dataclasses.replace(h.SchedConfig(), num_spec_tokens=2)
    sched = h.make_scheduler(cfg, tiny_model_dir, KVCacheManager)
    assert sched.use_eagle_block_drop and sched.num_prefill_lookahead == 1
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert sched.kv_cache_manager._native.drops_eagle_block
    assert engine_out_of_scope(sched) is None


def run_eagle_align_seed(seed: int, model_dir: Path, manager_cls: type) -> dict:
    """A Mamba "align" layout (:data:`manager_driver.MAMBA_ALIGN_LAYOUTS`) with drafts (2 or
    4), dense or sparse retention, the rest of the seed's draws :func:`v1_harness.run_seed`'s.
    ``with_layout`` turns drafts off for align layouts; they are turned back on here."""
    rng = random.Random(seed)
    layouts = sorted(MAMBA_ALIGN_LAYOUTS)
    cfg = h.with_layout(h.random_config(rng), layouts[seed % 4], (None, 0)[seed // 4 % 2])
    cfg = dataclasses.replace(cfg, num_spec_tokens=(2, 4)[seed % 2])
    capped = dataclasses.replace(cfg, max_model_len=h.length_cap(cfg))
    return h.Lockstep(cfg, h.random_workload(rng, capped), seed, model_dir, manager_cls).run()


@pytest.mark.parametrize("seed", range(24))
def test_eagle_mamba_align_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, eagle: None
) -> None:
    """Qwen3-Next-, Nemotron-H-, Granite-4-like hybrids and pure Mamba-2 with prefix caching
    ("align") under EAGLE: the prefills split with EAGLE's drop, the checkpoints one block
    below the replay boundary, hits and caching as vLLM's, every step compared and native
    (sync and async, preemption, aborts, drafts). EAGLE's drop keeps each checkpoint within
    the request's hashes, so vLLM's own manager runs these seeds to the end."""
    stats = run_eagle_align_seed(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0 and stats["drafts"] > 0
    assert_native_loop(stats, manager_cls)


@LOOKAHEAD
def test_eagle_lookahead_mamba_align_lockstep(
    tiny_model_dir: Path, manager_cls: type, eagle_lookahead: None
) -> None:
    """The same engines with 0.33's default for EAGLE (lookahead block hashes, no drop): the
    checkpoints read the lookahead. Here a checkpoint can land past the request's hashes when
    unverified drafts end a chunk, and vLLM's own block pool then asserts (the run cannot go
    on); every other seed matches at every step, natively. A seed counts as vLLM's own
    failure only when the assertion is raised in vLLM's ``block_pool.py`` under vLLM's
    scheduler, never on pagedkv's side or in the comparison."""
    completed, vllm_failed = 0, []
    for seed in range(24):
        try:
            stats = run_eagle_align_seed(seed, tiny_model_dir, manager_cls)
        except AssertionError as e:
            if not _raised_in_vllms_block_pool(e):
                raise
            vllm_failed.append(seed)
            continue
        assert_native_loop(stats, manager_cls)
        completed += 1
    assert completed >= 16, (completed, vllm_failed)


def _raised_in_vllms_block_pool(e: BaseException) -> bool:
    """``e`` was raised in vLLM's ``block_pool.py`` under a scheduler over vLLM's own manager
    (the reference side of the lockstep)."""
    import traceback

    frames = list(traceback.walk_tb(e.__traceback__))
    if not frames or not frames[-1][0].f_code.co_filename.endswith("vllm/v1/core/block_pool.py"):
        return False
    for frame, _ in frames:
        sched = frame.f_locals.get("self")
        manager = getattr(sched, "kv_cache_manager", None)
        if frame.f_code.co_name == "schedule" and manager is not None:
            return type(manager).__module__.startswith("vllm.")
    return False


@pytest.mark.parametrize("seed", range(24))
def test_multi_module_mtp_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, mtp: None
) -> None:
    """Multi-module MTP (a prefill lookahead of 2 or 4 drafts): no prefill chunk ends within
    the lookahead of the prompt's end (``_reserve_prefill_lookahead``, after the encoder caps,
    in both passes) and the last ``lookahead - 1`` computed tokens are never cached; one
    group and hybrid layouts, every step compared, native but while an out-of-scope request
    is held."""
    stats = run_eagle_seed(seed, tiny_model_dir, manager_cls)
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=True)


@LOOKAHEAD
@pytest.mark.parametrize("seed", range(12))
def test_multi_module_mtp_lookahead_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, mtp_lookahead: None
) -> None:
    """The same with 0.33's default, hashes as far ahead as the prefill lookahead."""
    stats = run_eagle_seed(seed, tiny_model_dir, manager_cls, caching_off=False)
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=True)


@pytest.mark.parametrize("threshold", [0, 8])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_module_mtp_chunks_stop_short_of_the_lookahead(
    async_scheduling: bool, threshold: int, tiny_model_dir: Path, manager_cls: type, mtp: None
) -> None:
    """Prompts 1 to 5 tokens longer than a multiple of the chunk (a 16-token budget, or an
    8-token long-prefill threshold) under a lookahead of 4: a chunk that would end 1 to 3
    tokens before the prompt's end ends 4 before it instead, in the waiting pass and the
    running pass, one request at a time and several sharing the budget; prefix hits on the
    shared prompts start mid-prompt. Every step compared, every step native."""
    cfg = dataclasses.replace(
        h.SchedConfig(),
        block_size=4,
        num_blocks=96,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=threshold,
        num_spec_tokens=4,
        async_scheduling=async_scheduling,
    )
    rng = random.Random(threshold * 2 + async_scheduling)
    base = [rng.randrange(3, h.VOCAB_SIZE) for _ in range(40)]
    specs = [
        h.RequestSpec(f"m{i}", tuple(base[: 16 * (1 + i % 2) + extra]), 5, True, i // 3)
        for i, extra in enumerate((1, 2, 3, 4, 5, 1, 2, 3, 17, 18))
    ]
    stats = h.Lockstep(cfg, specs, 0, tiny_model_dir, manager_cls).run()
    assert stats["steps"] > 0 and stats["hits"] > 0
    assert_native_loop(stats, manager_cls)


def test_the_mtp_scheduler_reads_its_drafts_as_prefill_lookahead(
    tiny_model_dir: Path, mtp: None
) -> None:
    """The fixture's engine: vLLM's scheduler reads a prefill lookahead of its drafts, and
    pagedkv's native manager and loop both serve it."""
    from pagedkv.vllm_v1 import KVCacheManager
    from pagedkv.vllm_v1._scope import engine_out_of_scope

    cfg = dataclasses.replace(h.SchedConfig(), num_spec_tokens=3)
    sched = h.make_scheduler(cfg, tiny_model_dir, KVCacheManager)
    assert sched.num_prefill_lookahead == 3
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert engine_out_of_scope(sched) is None


@pytest.mark.parametrize("seed", range(40))
def test_eagle_multimodal_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, eagle: None
) -> None:
    """Images under EAGLE: the encoder inputs are scheduled one token ahead (the prefill
    lookahead of 1 shifts ``_try_schedule_encoder_inputs``) and freed one token later, every
    step native."""
    import mm_harness as mm
    from test_multimodal_native import SMALL, _run

    rng = random.Random(seed * 17 + 3)
    # A cache holding max_model_len (96 tokens): pagedkv caps lengths at a smaller cache, the
    # reference then being vLLM at that length, which drafts' lookahead slots do not follow
    # (v1_harness.random_config keeps drafts off such caches too).
    cfg = dataclasses.replace(
        SMALL,
        num_blocks=rng.choice((26, 30, 40)),
        num_spec_tokens=2,
        enable_caching=seed % 3 != 2,
        async_scheduling=seed % 2 == 1,
        abort_rate=rng.choice((0.0, 0.05)),
    )
    encoder = mm.Encoder(budget=32, cache_size=48, no_chunking=False, v2_runner=False)
    assert _run(cfg, encoder, seed, tiny_model_dir, manager_cls)["steps"] > 0


@LOOKAHEAD
@pytest.mark.parametrize("seed", range(24))
def test_eagle_lookahead_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, eagle_lookahead: None
) -> None:
    """0.33's default for EAGLE with prefix caching: lookahead block hashes, no drop. One
    group and hybrid layouts, sync and async, preemption, aborts and prefix hits, every step
    compared (block hashes, KV events with their ``lookahead_token_ids``) and native (vLLM's
    loop only while a held request is, one seed in four)."""
    stats = run_eagle_seed(seed, tiny_model_dir, manager_cls, caching_off=False)
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls, held=seed % 4 == 3)


@LOOKAHEAD
def test_the_lookahead_scheduler_builds_a_native_engine(
    tiny_model_dir: Path, eagle_lookahead: None
) -> None:
    """vLLM's scheduler turns lookahead hashes on and the drop off; pagedkv's manager,
    native loop and native hashing serve that engine."""
    from pagedkv import _native
    from pagedkv.vllm_v1 import KVCacheManager
    from pagedkv.vllm_v1._scope import engine_out_of_scope

    cfg = dataclasses.replace(h.SchedConfig(), num_spec_tokens=2, enable_caching=True)
    sched = h.make_scheduler(cfg, tiny_model_dir, KVCacheManager)
    assert sched.num_hash_lookahead_tokens == 1 and not sched.use_eagle_block_drop
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert sched.kv_cache_manager.num_hash_lookahead_tokens == 1
    assert not sched.kv_cache_manager._native.drops_eagle_block
    assert engine_out_of_scope(sched) is None
    # The requests' lookahead hasher (vLLM's) is recognized: the native stand-in hashes.
    spec = h.RequestSpec("r0", tuple(range(3, 40)), 4, True, 0)
    request = h.build_request(spec, h.request_block_hasher(cfg, 1))
    sched.add_request(request)
    assert isinstance(request._block_hasher, _native.VllmBlockHasher)
    assert request._block_hasher.lookahead == 1


@LOOKAHEAD
@pytest.mark.parametrize("seed", range(16))
def test_eagle_lookahead_sessions_lockstep(
    seed: int, tiny_model_dir: Path, manager_cls: type, eagle_lookahead: None
) -> None:
    """Streaming sessions under lookahead hashes (drafts, prefix caching, a starved pool for
    preemption): a session update drops the last sampled token, which a kept hash may cover;
    every step compared with vLLM's and native."""
    from test_streaming_sessions import session_config, session_workload

    rng = random.Random(f"sessions{seed}")
    cfg = session_config(rng)
    cfg = dataclasses.replace(
        cfg, async_scheduling=False, enable_caching=True, num_spec_tokens=2, sampling_mask=False
    )
    run = h.Lockstep(cfg, session_workload(rng), seed, tiny_model_dir, manager_cls)
    stats = run.run()
    assert stats["steps"] > 0 and stats["session_updates"] > 0
    assert_native_loop(stats, manager_cls)


@LOOKAHEAD
@pytest.mark.parametrize("resumable", [True, False])
def test_a_sessions_stale_hash_is_recomputed_at_lookup(
    tiny_model_dir: Path, eagle_lookahead: None, resumable: bool
) -> None:
    """A waiting streaming session with nothing computed and a stale last hash (one covering a
    token since discarded): vLLM's scheduler and pagedkv's native loop both recompute its
    hashes from the current tokens before the lookup; a plain request's hashes are left as
    they are by both."""
    from pagedkv.vllm_v1 import KVCacheManager

    cfg = dataclasses.replace(h.SchedConfig(), num_spec_tokens=2, enable_caching=True)
    spec = h.RequestSpec(
        "s0",
        tuple(range(3, 3 + 3 * cfg.block_size)),
        4,
        True,
        0,
        updates=(h.SessionUpdate(5, (7, 8), 2),) if resumable else (),
    )
    after = {}
    for name, manager in (("vllm", None), ("pagedkv", KVCacheManager)):
        sched = h.make_scheduler(cfg, tiny_model_dir, manager)
        hasher = h.request_block_hasher(cfg, sched.num_hash_lookahead_tokens)
        request = h.build_request(spec, hasher)
        assert request.resumable is resumable
        fresh = list(request.block_hashes)
        assert len(fresh) == 2  # the third block has no token after it yet
        request.block_hashes[-1] = b"stale"
        sched.add_request(request)
        sched.schedule()
        after[name] = list(request.block_hashes)
        if manager is not None:
            assert dict(sched.pagedkv_steps) == {"native": 1}
        expected = fresh if resumable else fresh[:-1] + [b"stale"]
        assert after[name] == expected, name
    assert after["vllm"] == after["pagedkv"]


def _session_recovery(sched: object, recovery: str) -> list:
    """vLLM 0.33's own streaming-session scenario under lookahead hashes (its
    ``test_streaming_lookahead_hashes_follow_recomputed_kv``, on this tiny model with
    scheduler-only EAGLE): a session's turn, an update that discards its last sampled token
    (the kept first hash covers it), then the session's KV recomputed after ``recovery``
    (``resident``: none; ``preempt``; ``reset`` of the prefix cache). vLLM's assertions, and
    what was observed, for comparison between schedulers."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    hasher = h.request_block_hasher(h.SchedConfig(block_size=4), 1)

    def request(rid: str, tokens: list, resumable: bool = False, max_tokens: int = 16) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
            resumable=resumable,
        )

    def step(token: int) -> object:
        out = sched.schedule()
        runner = ModelRunnerOutput(
            req_ids=[session.request_id],
            req_id_to_index={session.request_id: 0},
            sampled_token_ids=[[token]],
        )
        sched.update_from_output(out, runner)
        return out

    session = request("session", [1, 2, 3], resumable=True, max_tokens=2)
    sched.add_request(session)
    step(4), step(5)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    manager = sched.kv_cache_manager
    old_hash = session.block_hashes[0]
    old_probe = request("old", [1, 2, 3, 4, 5, 100])
    assert manager.get_computed_blocks(old_probe)[1] == 4
    sched.add_request(request("session", [42, 43, 44], resumable=True))
    assert list(session.all_token_ids) == [1, 2, 3, 4, 42, 43, 44]
    step(99)
    assert session.block_hashes[0] == old_hash  # resident KV keeps its key
    current = request("current", session.all_token_ids)
    assert current.block_hashes[0] != old_hash
    assert manager.get_computed_blocks(current)[1] == 0
    seen = [list(session.block_hashes), manager.get_block_ids("session")]
    if recovery == "resident":
        return seen
    if recovery == "reset":
        assert sched.reset_prefix_cache(reset_running_requests=True)
    else:
        sched.running.remove(session)
        sched._preempt_request(session, 0.0)
    assert session.num_computed_tokens == 0
    out = sched.schedule()
    assert session.block_hashes == current.block_hashes  # recomputed at the lookup
    assert out.num_scheduled_tokens[session.request_id] == session.num_tokens
    hit = manager.get_computed_blocks(current)[1]
    old_hit = manager.get_computed_blocks(old_probe)[1]
    assert (hit, old_hit) == (4, 0 if recovery == "reset" else 4)
    return seen + [list(session.block_hashes), manager.get_block_ids("session")]


@LOOKAHEAD
@pytest.mark.parametrize("recovery", ["resident", "preempt", "reset"])
def test_vllms_session_recovery_scenario_natively(
    recovery: str, tiny_model_dir: Path, eagle_lookahead: None
) -> None:
    """vLLM's own streaming-session recovery scenario under lookahead hashes, on vLLM's
    scheduler and on pagedkv's: vLLM's assertions hold on both, the hashes and block tables
    observed are equal, and every step of pagedkv's ran natively."""
    from pagedkv.vllm_v1 import KVCacheManager

    cfg = dataclasses.replace(h.SchedConfig(), block_size=4, num_spec_tokens=1, enable_caching=True)
    seen = {}
    for name, manager in (("vllm", None), ("pagedkv", KVCacheManager)):
        sched = h.make_scheduler(cfg, tiny_model_dir, manager)
        assert sched.num_hash_lookahead_tokens == 1
        seen[name] = _session_recovery(sched, recovery)
        if manager is not None:
            assert set(sched.pagedkv_steps) == {"native"}, sched.pagedkv_steps
    assert seen["vllm"] == seen["pagedkv"]


def test_the_mtp_scheduler_of_a_windowed_model_runs_natively(
    tiny_model_dir: Path, mtp: None
) -> None:
    """A GPT-OSS-like layout under multi-module MTP (3 drafts): the harness tags the window
    as vLLM's planner does (``extra_retained_tokens`` 2), and pagedkv's hybrid manager and
    native loop serve it (``test_multi_module_mtp_lockstep`` runs such layouts step by step;
    ``test_mtp_windows_hold_their_extra_retained_tokens_as_vllm`` the window's rules)."""
    from pagedkv.vllm_v1 import KVCacheManager
    from pagedkv.vllm_v1._scope import engine_out_of_scope

    cfg = h.with_layout(dataclasses.replace(h.SchedConfig(), num_spec_tokens=3), "gpt-oss")
    sched = h.make_scheduler(cfg, tiny_model_dir, KVCacheManager)
    specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
    assert [getattr(s, "extra_retained_tokens", 0) for s in specs] == [0, 2]
    manager = sched.kv_cache_manager
    assert type(manager).__name__ == "HybridKVCacheManager" and engine_out_of_scope(sched) is None
