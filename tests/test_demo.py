"""The end-to-end demo: a paged engine whose every logit equals a dense forward."""

import pytest

torch = pytest.importorskip("torch")

from pagedkv import demo  # noqa: E402
from pagedkv.attention import TinyDecoder  # noqa: E402
from pagedkv.demo import (  # noqa: E402
    EVENTS,
    DemoConfig,
    DemoEngine,
    choose_num_gpu_blocks,
    run_demo,
)

CONFIG = DemoConfig()  # 6 requests, block size 4


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


def test_demo_passes_and_shows_every_event(report):
    assert report.ok, report.failures
    assert report.failures == []
    assert report.mismatches == 0
    assert report.max_abs_diff <= 1e-5
    for name in EVENTS:
        assert getattr(report, name) > 0, name
    assert report.prefix_hits <= report.prefix_lookups
    assert report.forks == 2  # requests 1 and 4 have n=2
    assert report.blocks_swapped_out == report.blocks_swapped_in > 0
    # every generated token's logits row was checked (plus the prefill rows)
    assert report.checked_rows >= report.generated_tokens - report.forks
    requests = demo._make_requests(CONFIG)
    assert report.generated_tokens == sum(r.n * r.max_tokens for r in requests)
    assert report.sequences == sum(r.n for r in requests)
    assert report.steps == report.prefill_steps + report.decode_steps
    assert report.prefill_tokens_computed + report.prefix_cached_tokens >= report.prompt_tokens
    text = report.format()
    assert "result: OK" in text and "copy-on-write" in text


def test_engine_state_after_run():
    """Same run through the engine object: every sequence finished, blocks all free, the
    decode path through StepBuffers and the per-sequence append_slots path agree exactly."""
    size = choose_num_gpu_blocks(CONFIG)
    model = TinyDecoder(CONFIG.model)
    outputs = {}
    for path in ("step_buffers", "append_slots"):
        cfg = DemoConfig(decode_path=path)
        engine = DemoEngine(cfg, model, num_gpu_blocks=size)
        engine.run()
        engine.check(1e-5, 1e-5)
        assert engine.report.ok, engine.report.failures
        mgr = engine.manager
        assert mgr.get_num_free_gpu_blocks() == engine.num_gpu_blocks == size
        assert mgr.get_num_free_cpu_blocks() == engine.num_cpu_blocks
        for seq in engine.all_seqs.values():
            assert seq.is_finished()
            assert not mgr.has_table(seq)
        outputs[path] = {sid: s.get_token_ids() for sid, s in engine.all_seqs.items()}
        # forked children diverge from their parent on their first generated token
        for req in engine.requests:
            seqs = req.group.get_seqs()
            assert len(seqs) == req.n
            if req.n == 2:
                a, b = (s.get_output_token_ids() for s in seqs)
                assert a[0] != b[0]
    assert outputs["step_buffers"] == outputs["append_slots"]


def test_dry_run_predicts_the_schedule(report):
    """The pool chosen by model-free dry runs shows the same events in the real run."""
    size = choose_num_gpu_blocks(CONFIG)
    assert report.num_gpu_blocks == size
    dry = DemoEngine(CONFIG, None, num_gpu_blocks=size)
    dry.run()
    for name in ("swap_outs", "swap_ins", "recompute_preemptions", "cow_copies", "steps"):
        assert getattr(dry.report, name) == getattr(report, name), name
    roomy = DemoEngine(CONFIG, None)
    roomy.run()
    assert roomy.report.swap_outs == roomy.report.recompute_preemptions == 0
    assert size < roomy.num_gpu_blocks


def test_simultaneous_arrivals():
    """Requests arriving together are prefilled in one batch while sharing prefix blocks
    that none of them has computed yet: the shared slots are written once."""
    shared = []

    def hook(engine, plan):
        if plan.kind != "prefill":
            return
        bs, owners = engine.config.block_size, {}
        for seq, num_cached in plan.prefill:
            table = engine.manager.get_block_table(seq)
            for p in range(num_cached, seq.get_len()):
                slot = table[p // bs] * bs + p % bs
                if slot in owners:
                    shared.append(slot)
                owners[slot] = seq.seq_id

    rep = run_demo(DemoConfig(arrival_gap=0), verbose=False, hook=hook)
    assert rep.ok, rep.failures
    assert shared


def test_bf16():
    rep = run_demo(CONFIG, dtype=torch.bfloat16, verbose=False)
    assert rep.ok, rep.failures
    assert 0 < rep.max_abs_diff < 0.1


# --------------------------------------------------------------------------- #
# the check can fail
# --------------------------------------------------------------------------- #


def test_skipping_copy_on_write_is_detected():
    skipped = []

    def hook(engine, plan):
        if plan.blocks_to_copy:
            skipped.append(dict(plan.blocks_to_copy))
            plan.blocks_to_copy.clear()

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert skipped
    assert not rep.ok
    assert rep.mismatches > 0
    assert any("differ from dense_forward" in f for f in rep.failures)


def test_corrupted_block_is_detected():
    done = []

    def hook(engine, plan):
        if plan.kind == "decode" and not done and plan.step > 10:
            seq = plan.decode[0]
            block = engine.manager.get_block_table(seq)[0]
            engine.gpu_caches[1][0, block] += 0.5  # layer 1 keys of the first block
            done.append((seq.seq_id, block))

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert done
    assert not rep.ok and rep.mismatches > 0


def test_skipping_swap_in_is_detected():
    def hook(engine, plan):
        plan.blocks_to_swap_in.clear()

    rep = run_demo(CONFIG, verbose=False, hook=hook)
    assert rep.swap_ins > 0
    assert not rep.ok and rep.mismatches > 0


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #


def test_main_ok(capsys):
    assert demo.main(["--requests", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "recompute preemptions" in out


def test_main_quiet_and_bad_arguments(capsys):
    assert demo.main(["--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert demo.main(["--requests", "2"]) == 2
    assert "--requests" in capsys.readouterr().err
    assert demo.main(["--device", "nonsense"]) == 2
    assert "--device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert demo.main(["--device", "cuda"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_main_reports_a_failed_check(capsys, monkeypatch):
    monkeypatch.setitem(demo.TOLERANCES, torch.float32, (0.0, 0.0))
    assert demo.main(["--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_cli_dispatch(capsys):
    cli = pytest.importorskip("pagedkv.cli")
    assert cli.main(["demo", "--quiet"]) == 0
