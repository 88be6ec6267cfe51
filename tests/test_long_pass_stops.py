"""Stops during the long passes outside training steps (docs/architecture.md, "Long passes";
docs/checkpoints.md, "Stops during long passes"): a real SIGTERM to a real ``osft-train`` launcher,
on 1 rank (in process) and 2 ranks (torchrun, gloo), while a test hook makes the start-up SVDs or
the fold at export slow, is served within seconds by abandoning the pass, and the run started
again and resumed completes."""

from __future__ import annotations

import json
import signal
import time

import pytest
from osft.trainer.exit_codes import EXIT_STOPPED
from test_resume import assert_no_orphans, complete_checkpoints, job, records, train  # noqa: F401 (job: fixture)
from test_stop_rule import finish, one_rank, wait_for

pytestmark = pytest.mark.torchrun

#: Seconds each target's start-up SVD or each module's fold at export sleeps (test hooks
#: OSFT_TEST_SVD_DELAY_S, OSFT_TEST_FOLD_DELAY_S): the tiny Llama's 14 OSFT modules take 42 s on
#: 1 rank (one intra-op thread), 21 s on 2 (7 rounds of one module per rank).
SLOW_S = 3.0


#: Steps of every run here, on 1 rank and on 2.
STEPS = 2


def launch(job, out, ranks, *flags):
    """``osft-train`` on ``ranks`` ranks (1: in process; 2: torchrun), :data:`STEPS` steps, not waited for."""
    return one_rank(job, out, *flags) if ranks == 1 else train(job, out, "--max-steps", str(STEPS), *flags,
                                                               wait=False)


def signal_after(proc, out, what, ready, wait_s: float) -> float:
    """SIGTERM to the launcher ``wait_s`` after ``ready(records)`` holds; returns when it was sent."""
    metrics = out / "metrics" / "node0.jsonl"
    wait_for(lambda: metrics.is_file() and ready(records(out)), proc, what)
    time.sleep(wait_s)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    return sent


def stopped(out, proc, sent, step, point):
    """Wait for the stopped run; check exit 75, a ``run_finished`` of ``step`` within 5 s of the
    signal (the process gone within 15 s) and the request agreed at ``point``. Returns its output."""
    code, output = finish(proc)
    exited = time.time() - sent
    assert code == EXIT_STOPPED, output
    finished = records(out, "run_finished")[-1]
    assert (finished["reason"], finished["step"], finished["signal"]) == ("stopped", step, "SIGTERM")
    served = finished["ts"] - sent
    assert served < 5.0 and exited < 15.0, (served, exited)  # the slow pass: 21 s or more
    assert (records(out, "checkpoint_requested")[-1]["step"], records(out, "checkpoint_requested")[-1]["point"]) \
        == (step, point)
    assert json.loads((out / "run.json").read_text())["state"] == "stopped"
    return output


@pytest.mark.parametrize("ranks", [1, 2])
def test_stops_during_the_start_up_svds_and_the_export_fold_are_served_within_seconds(job, tmp_path, monkeypatch,
                                                                                     ranks):
    """One output directory, three runs. 1. A fresh run whose every start-up SVD is made 3 s slower
    (test hook OSFT_TEST_SVD_DELAY_S): SIGTERM to the launcher 2 s after ``run_started`` is agreed
    between two rounds of the SVDs (point ``start_up``) and ends the run within 5 s, exit 75,
    nothing trained and no checkpoint (there is no model to save), ``run.json`` stopped. 2. Run
    again, every module's fold at export 3 s slower (OSFT_TEST_FOLD_DELAY_S): SIGTERM 1.5 s after
    the last step's record abandons the fold at its next round (point ``fold``) and the stop is
    served by a checkpoint of the last step within 5 s, no export or ``subspaces_folded`` record.
    3. The resume has no step left and writes the final export with its subspaces."""
    out = tmp_path / "run"
    monkeypatch.setenv("OSFT_TEST_SVD_DELAY_S", str(SLOW_S))
    proc = launch(job, out, ranks)
    sent = signal_after(proc, out, "run_started", lambda recs: any(r["event"] == "run_started" for r in recs), 2.0)
    output = stopped(out, proc, sent, 0, "start_up")
    assert records(out, "run_finished")[-1]["checkpoint"] is None
    assert not records(out, "step") and not records(out, "checkpoint_saved") and not complete_checkpoints(out)
    assert "SIGTERM: stopped during start-up before step 0: nothing trained; run again to start" in output
    assert "nothing trained, no checkpoint; run again to start" in output

    monkeypatch.delenv("OSFT_TEST_SVD_DELAY_S")
    monkeypatch.setenv("OSFT_TEST_FOLD_DELAY_S", str(SLOW_S))
    proc = launch(job, out, ranks)
    sent = signal_after(proc, out, f"step {STEPS}", lambda recs: any(r["event"] == "step" and r["step"] == STEPS
                                                                     for r in recs), 1.5)
    output = stopped(out, proc, sent, STEPS, "fold")
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [STEPS]
    assert complete_checkpoints(out) == [f"step_{STEPS}"]
    assert not records(out, "subspaces_folded") and not (out / "hf_format").exists()
    assert f"stopped after step {STEPS} on SIGTERM" in output

    monkeypatch.delenv("OSFT_TEST_FOLD_DELAY_S")
    code, output = finish(launch(job, out, ranks, "--resume"))
    assert code == 0, output
    assert_no_orphans(out)
    assert [r["from_step"] for r in records(out, "resumed")] == [STEPS]
    assert [r["step"] for r in records(out, "subspaces_folded")] == [STEPS]
    assert (out / "hf_format" / f"step_{STEPS}" / "osft_subspaces.safetensors").is_file()
    assert records(out, "run_finished")[-1]["reason"] == "completed"
