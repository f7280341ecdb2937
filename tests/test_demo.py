"""The end-to-end demo: pagedkv.Scheduler driving a paged engine whose every logit equals a
dense forward, through the batch step and through the compat schedule()."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import SamplingParams, Sequence, SequenceGroup, demo  # noqa: E402
from pagedkv.attention import TinyDecoder  # noqa: E402
from pagedkv.demo import engine as demo_engine  # noqa: E402
from pagedkv.demo.engine import (  # noqa: E402
    EVENTS,
    DemoConfig,
    DemoEngine,
    choose_num_gpu_blocks,
    run_demo,
)
from pagedkv.errors import InvalidArgumentError  # noqa: E402

CONFIG = DemoConfig()  # 6 requests, block size 4, the batch path


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """The tiny model only slows down with intra-op threads (run_demo does the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def report():
    return run_demo(CONFIG, verbose=False)


@pytest.fixture(scope="module")
def engines():
    """The default workload through both paths on the same model and pool."""
    size = choose_num_gpu_blocks(CONFIG)
    model = TinyDecoder(CONFIG.model)
    out = {}
    for path in ("batch", "compat"):
        engine = DemoEngine(dataclasses.replace(CONFIG, path=path), model, num_gpu_blocks=size)
        with torch.inference_mode():
            engine.run()
            engine.check(1e-5, 1e-5)
        out[path] = engine
    return out


def plan_arrays(plan, skip=()):
    return {
        f.name: np.asarray(getattr(plan, f.name)).tolist()
        for f in dataclasses.fields(plan)
        if f.name not in skip
    }


def test_demo_passes_and_shows_every_event(report):
    assert report.ok, report.failures
    assert report.path == "batch"
    assert report.mismatches == 0
    assert report.max_abs_diff <= 1e-5
    for name in EVENTS:
        assert getattr(report, name) > 0, name
    assert report.prefix_hits <= report.prefix_lookups
    assert report.forks == 2  # requests 1 and 4 have n=2
    assert report.blocks_swapped_out == report.blocks_swapped_in > 0
    assert report.swap_outs == report.swap_ins
    requests = demo_engine._make_requests(CONFIG)
    assert report.generated_tokens == sum(r.n * r.max_tokens for r in requests)
    assert report.sequences == sum(r.n for r in requests)
    # every generated token's logits row was checked (a fork's first token shares its
    # parent's row), plus the prompt rows; recomputation prefills again
    assert report.checked_rows >= report.generated_tokens - report.forks
    assert report.steps == report.prefill_steps + report.decode_steps
    computed_or_cached = report.prefill_tokens_computed + report.prefix_cached_tokens
    assert computed_or_cached > report.prompt_tokens  # recomputed sequences prefill again
    text = report.format()
    assert "result: OK" in text and "copy-on-write" in text and "batch path" in text


def test_both_paths_make_identical_decisions(engines):
    """The batch step and the compat schedule() (vLLM's model-runner rules over its
    metadata, vLLM's output processing in Python) give the same plan at every step, the
    same logits and the same generated tokens."""
    batch, compat = engines["batch"], engines["compat"]
    for engine in (batch, compat):
        assert engine.report.ok, engine.report.failures
    assert len(batch.plans) == len(compat.plans) > 20
    for a, b in zip(batch.plans, compat.plans):
        assert plan_arrays(a) == plan_arrays(b), a.step
    assert batch.records.keys() == compat.records.keys()
    for sid, recs in batch.records.items():
        for (pa, la), (pb, lb) in zip(recs, compat.records[sid]):
            assert torch.equal(pa, pb) and torch.equal(la, lb)
    tokens = {
        p: {s: q.get_token_ids() for s, q in e.all_seqs().items()} for p, e in engines.items()
    }
    assert tokens["batch"] == tokens["compat"]
    for f in dataclasses.fields(batch.report):
        if f.name not in ("path", "seconds"):
            assert getattr(batch.report, f.name) == getattr(compat.report, f.name), f.name
    # every token the model computed had its logits row checked
    fed = sum(len(p.input_tokens) for p in batch.plans)
    assert batch.report.checked_rows == fed


@pytest.mark.parametrize("seed, requests", [(1, 5), (2, 8), (3, 12)])
def test_paths_agree_on_other_workloads(seed, requests):
    cfg = DemoConfig(
        num_requests=requests, seed=seed, model=dataclasses.replace(CONFIG.model, seed=seed)
    )
    size = choose_num_gpu_blocks(cfg)
    model = TinyDecoder(cfg.model)
    runs = []
    for path in ("batch", "compat"):
        engine = DemoEngine(dataclasses.replace(cfg, path=path), model, num_gpu_blocks=size)
        with torch.inference_mode():
            engine.run()
            engine.check(1e-5, 1e-5)
        assert engine.report.ok, engine.report.failures
        runs.append(engine)
    batch, compat = runs
    assert [plan_arrays(p) for p in batch.plans] == [plan_arrays(p) for p in compat.plans]
    assert batch.preemptions == compat.preemptions


def test_engine_state_after_run(engines):
    for engine in engines.values():
        mgr = engine.manager
        assert mgr.get_num_free_gpu_blocks() == engine.num_gpu_blocks
        assert mgr.get_num_free_cpu_blocks() == engine.num_cpu_blocks
        assert not engine.scheduler.has_unfinished_seqs()
        for seq in engine.all_seqs().values():
            assert seq.is_finished()
            assert not mgr.has_table(seq)
        # a forked child takes the runner-up token, its parent the best one, both from
        # the last row of the parent's prefill
        for req in engine.requests:
            seqs = req.group.get_seqs()
            assert len(seqs) == req.n
            if req.n == 2:
                parent, child = (s.get_output_token_ids() for s in seqs)
                row = engine.records[seqs[0].seq_id][0][1][-1]
                assert [parent[0], child[0]] == torch.topk(row, 2).indices.tolist()


def test_preemption_follows_vllms_policy(engines):
    """vLLM's choice, not the demo's: groups with several running sequences are swapped
    out (and come back), single-sequence groups are recomputed."""
    for engine in engines.values():
        log = engine.preemptions
        kinds = {event for _, event, _, _ in log}
        assert kinds == {"swap_outs", "swap_ins", "recompute_preemptions"}
        for _, event, rid, live in log:
            n = engine.requests[int(rid.split("-")[1])].n
            if event == "recompute_preemptions":
                assert live == 1 and n == 1, (event, rid)
            else:
                assert live == 2 and n == 2, (event, rid)
        outs = [rid for _, e, rid, _ in log if e == "swap_outs"]
        ins = [rid for _, e, rid, _ in log if e == "swap_ins"]
        assert sorted(outs) == sorted(ins)
    assert engines["batch"].preemptions == engines["compat"].preemptions


def test_prompt_rows_leave_the_cached_prefix_out(engines):
    """A prompt row's tokens start where its computed blocks end (vLLM's model runner):
    positions and slots follow, the context still counts the whole prompt."""
    engine, bs = engines["batch"], CONFIG.block_size
    cached_rows = 0
    for plan in engine.plans:
        q = plan.query_start_loc
        for i in range(plan.num_prompt_rows):
            skip = int(plan.cached_tokens[i])
            assert skip % bs == 0
            first = int(plan.positions[q[i]])
            assert first == skip  # whole prompts: the row starts at its cached prefix
            assert int(plan.positions[q[i + 1] - 1]) == plan.context_lens[i] - 1
            cached_rows += skip > 0
        assert not plan.cached_tokens[plan.num_prompt_rows :].any()
    assert cached_rows >= 3


def test_dry_run_predicts_the_schedule(engines):
    """The model-free dry run makes the real run's decisions: the pool it chooses shows the
    same plans but for the token ids (random logits there)."""
    real = engines["batch"]
    dry = DemoEngine(CONFIG, None, num_gpu_blocks=real.num_gpu_blocks)
    dry.run()
    assert len(dry.plans) == len(real.plans)
    for a, b in zip(dry.plans, real.plans):
        assert plan_arrays(a, skip=("input_tokens",)) == plan_arrays(b, skip=("input_tokens",))
    roomy = DemoEngine(CONFIG, None)
    roomy.run()
    assert roomy.report.swap_outs == roomy.report.recompute_preemptions == 0
    assert real.num_gpu_blocks < roomy.num_gpu_blocks


def test_simultaneous_arrivals():
    """Requests arriving together are prefilled in one batch while sharing prefix blocks
    that none of them has computed yet (vLLM marks blocks computed after building the
    step's metadata): each writes the shared slots itself."""
    shared = []

    def hook(engine, plan):
        p = plan.num_prompt_rows
        slots = plan.slot_mapping[: plan.query_start_loc[p]].tolist()
        shared.extend(s for s in set(slots) if slots.count(s) > 1)

    rep = run_demo(DemoConfig(arrival_gap=0), verbose=False, hook=hook)
    assert rep.ok, rep.failures
    assert shared


def test_bf16():
    rep = run_demo(CONFIG, dtype=torch.bfloat16, verbose=False)
    assert rep.ok, rep.failures
    assert 0 < rep.max_abs_diff < 0.1


def test_forced_swap_preemption_is_reported_as_a_missing_event():
    """``preemption_mode="swap"`` reaches the scheduler: nothing is recomputed, and the
    check says so while every logit still matches."""
    rep = run_demo(DemoConfig(preemption_mode="swap"), verbose=False)
    assert rep.recompute_preemptions == 0 and rep.swap_outs > 0
    assert rep.mismatches == 0
    assert rep.failures == ["event did not happen: recompute_preemptions == 0"]


# --------------------------------------------------------------------------- #
# the check can fail
# --------------------------------------------------------------------------- #


def test_skipping_copy_on_write_is_detected():
    skipped = []

    def hook(engine, plan):
        if len(plan.copies):
            skipped.append(plan.copies.tolist())
            plan.copies = plan.copies[:0]

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert skipped
    assert not rep.ok
    assert rep.mismatches > 0
    assert any("differ from dense_forward" in f for f in rep.failures)


def test_corrupted_cached_prefix_is_detected():
    """A prompt row reads its cached prefix from the cache: corrupt it and the row fails."""
    done = []

    def hook(engine, plan):
        if not done and plan.num_prompt_rows and plan.cached_tokens[0] > 0:
            block = int(plan.block_tables[0, 0])
            engine.gpu_caches[0][0, block] += 0.5  # layer 0 keys of the first cached block
            done.append(block)

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert done
    assert not rep.ok and rep.mismatches > 0


def test_skipping_swap_in_is_detected():
    def hook(engine, plan):
        plan.swap_in = plan.swap_in[:0]

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert rep.swap_ins > 0
    assert not rep.ok and rep.mismatches > 0


def test_corrupted_swap_out_is_detected():
    """Swapped-out blocks land in the wrong CPU blocks (destinations rotated)."""
    rotated = []

    def hook(engine, plan):
        if len(plan.swap_out) > 1:
            plan.swap_out = plan.swap_out.copy()
            plan.swap_out[:, 1] = np.roll(plan.swap_out[:, 1], 1)
            rotated.append(plan.step)

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert rotated
    assert not rep.ok and rep.mismatches > 0


def test_unfreed_block_is_reported():
    """The end-of-run state check: a block left allocated fails the run."""
    leaked = []

    def hook(engine, plan):
        if not leaked:  # a table the scheduler does not know about, never freed
            seq = Sequence(999, "leak", [1, 2, 3], CONFIG.block_size)
            engine.manager.allocate(SequenceGroup("leak", [seq], SamplingParams(), 0.0))
            leaked.append(seq)

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert leaked
    assert rep.mismatches == 0
    assert "1 GPU blocks still in use" in rep.failures


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #


def test_main_ok(capsys):
    assert demo.main(["--requests", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "recompute preemptions" in out


def test_main_compat_path(capsys):
    assert demo.main(["--path", "compat"]) == 0
    assert "via the compat path" in capsys.readouterr().out


def test_main_quiet_and_bad_arguments(capsys):
    assert demo.main(["--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert demo.main(["--requests", "2"]) == 2
    assert "--requests" in capsys.readouterr().err
    assert demo.main(["--device", "nonsense"]) == 2
    assert "--device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--path", "nonsense"])
    if not torch.cuda.is_available():
        assert demo.main(["--device", "cuda"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_bad_config_is_refused():
    with pytest.raises(InvalidArgumentError, match="path"):
        DemoEngine(DemoConfig(path="nonsense"), None)
    with pytest.raises(InvalidArgumentError, match="num_requests"):
        DemoEngine(DemoConfig(num_requests=0), None)


def test_main_reports_a_failed_check(capsys, monkeypatch):
    monkeypatch.setitem(demo_engine.TOLERANCES, torch.float32, (0.0, 0.0))
    assert demo.main(["--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_cli_dispatch(capsys):
    cli = pytest.importorskip("pagedkv.cli")
    assert cli.main(["demo", "--quiet"]) == 0
