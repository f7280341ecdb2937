"""pagedkv.vllm_release: vLLM's real scheduling files, fetched and loaded side by side.

These tests need the package index (as the README's test command does to install); a failed
fetch fails the test, it never skips."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import vllm_release


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
def test_fetch_holds_vllms_files_and_tests(version):
    root = vllm_release.fetch(version)
    assert (root / "vllm" / "core" / "scheduler.py").read_text().startswith(("import", '"""'))
    assert (root / "tests" / "core" / "test_scheduler.py").exists()
    # The cache is reused: a second fetch returns the same directory without downloading.
    assert vllm_release.fetch(version) == root


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
def test_flavours_load_side_by_side(version):
    own = vllm_release.load(version, "vllm")
    dropin = vllm_release.load(version, "pagedkv")
    assert own.package != dropin.package
    # vLLM's own classes in one, pagedkv's in the other; the scheduler code is vLLM's in both.
    assert own.sequence.Sequence.__module__ == f"{own.package}.sequence"
    assert dropin.sequence.Sequence is pagedkv.Sequence
    manager = dropin.block_manager_v1.BlockSpaceManagerV1
    assert manager is pagedkv.BlockSpaceManager or (  # vLLM 0.5 extends lists with the results
        issubclass(manager, pagedkv.BlockSpaceManager) and manager.mapping_format == "pairs"
    )
    assert own.block_manager_v1.BlockSpaceManagerV1.__module__.startswith(own.package)
    assert own.scheduler.Scheduler is not dropin.scheduler.Scheduler
    assert own.scheduler.Scheduler.__module__ == f"{own.package}.core.scheduler"


def test_loaded_scheduler_runs_with_its_own_block_manager():
    """vLLM's Scheduler, built from vLLM's own config classes, resolves its (lazily imported)
    BlockSpaceManagerV1 inside the same load."""
    v = vllm_release.load("0.4.2", "vllm")
    sched = v.scheduler.Scheduler(
        v.config.SchedulerConfig(64, 4, 64),
        _cache_config(v, caching=False),
        None,
    )
    assert type(sched.block_manager) is v.block_manager_v1.BlockSpaceManagerV1
    p = vllm_release.load("0.4.2", "pagedkv")
    sched = p.scheduler.Scheduler(
        p.config.SchedulerConfig(64, 4, 64), _cache_config(p, False), None
    )
    assert isinstance(sched.block_manager, pagedkv.BlockSpaceManager)


def _cache_config(ns, caching):
    cfg = ns.config.CacheConfig(4, 1.0, 1, "auto", enable_prefix_caching=caching)
    cfg.num_gpu_blocks = 16
    cfg.num_cpu_blocks = 16
    return cfg


def test_vllm_flavour_passes_vllms_own_tests():
    """The stand-ins are faithful enough that vLLM's own scheduler and block-manager tests pass
    on vLLM's own classes."""
    rc, out = vllm_release.run_own_tests("0.4.2", "vllm")
    assert rc == 0, out[-3000:]
    assert " passed" in out and "failed" not in out


def test_describe_names_the_stand_ins():
    text = vllm_release.describe("0.4.2")
    assert "core/scheduler.py" in text and "stand-ins" in text


def test_unknown_version_and_flavour_are_refused():
    with pytest.raises(ValueError):
        vllm_release.fetch("0.3.0")
    with pytest.raises(ValueError):
        vllm_release.load("0.4.2", "other")


def test_fetch_sdist_refuses_unpinned_versions_and_tampered_archives(tmp_path, monkeypatch):
    """tests/vllm_v1 takes vLLM's own tests from these sdists: only pinned releases, and a
    cached archive whose sha256 no longer matches the pin is refused (never re-used)."""
    import pytest

    with pytest.raises(ValueError, match="not pinned"):
        vllm_release.fetch_sdist("0.0.1")
    monkeypatch.setenv("PAGEDKV_VLLM_CACHE", str(tmp_path))
    archive = tmp_path / "0.33.0" / "vllm-0.33.0.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(b"not the release")
    with pytest.raises(vllm_release.FetchError, match="pinned sha256"):
        vllm_release.fetch_sdist("0.33.0")
    with pytest.raises(vllm_release.FetchError, match="pinned sha256"):
        vllm_release.fetch_file("0.33.0", "vllm/__init__.py")
