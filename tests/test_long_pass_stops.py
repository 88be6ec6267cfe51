"""Stops during the long passes outside training steps (docs/architecture.md, "Long passes";
docs/checkpoints.md, "Stops during long passes"): a real SIGTERM to a real ``osft-train`` launcher,
on 1 rank (in process) and 2 ranks (torchrun, gloo), while a test hook makes the pass slow, is
served within seconds by abandoning the pass, and a resume afterwards completes the run."""

from __future__ import annotations

import signal
import time

import pytest
from osft.trainer.exit_codes import EXIT_STOPPED
from test_resume import STEPS, assert_no_orphans, complete_checkpoints, job, records, train  # noqa: F401 (job: fixture)
from test_stop_rule import finish, one_rank, wait_for

pytestmark = pytest.mark.torchrun

#: Seconds each module's fold sleeps (test hook OSFT_TEST_FOLD_DELAY_S): the tiny Llama's 14 OSFT
#: modules take 42 s on 1 rank, 21 s on 2 (7 rounds of one module per rank).
FOLD_DELAY_S = 3.0


def launch(job, out, ranks, *flags):
    """``osft-train`` on ``ranks`` ranks (1: in process, 2 steps; 2: torchrun, 8 steps), not waited for."""
    return one_rank(job, out, *flags) if ranks == 1 else train(job, out, *flags, wait=False)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stop_during_the_fold_at_export_is_served_within_seconds_and_a_resume_exports(job, tmp_path, monkeypatch,
                                                                                        ranks):
    """SIGTERM to the launcher 1.5 s after the last step's record, inside the fold of the protected
    subspaces of the final export (every module's fold made 3 s slower): the fold is abandoned at
    its next round and the stop served by a checkpoint of the last step within 5 s (exit 75, point
    ``fold``), no export or ``subspaces_folded`` record; the resume has no step left and writes
    the final export with its subspaces."""
    out = tmp_path / "run"
    steps = 2 if ranks == 1 else STEPS
    monkeypatch.setenv("OSFT_TEST_FOLD_DELAY_S", str(FOLD_DELAY_S))
    proc = launch(job, out, ranks)
    metrics = out / "metrics" / "node0.jsonl"
    wait_for(lambda: metrics.is_file() and any(r["step"] == steps for r in records(out, "step")), proc,
             f"step {steps}")
    time.sleep(1.5)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    exited = time.time() - sent
    assert code == EXIT_STOPPED, output
    finished = records(out, "run_finished")[-1]
    assert (finished["reason"], finished["step"], finished["signal"]) == ("stopped", steps, "SIGTERM")
    served = finished["ts"] - sent
    assert served < 5.0 and exited < 15.0, (served, exited)  # the whole fold: 21 s or more
    assert [(r["step"], r["point"]) for r in records(out, "checkpoint_requested")] == [(steps, "fold")]
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [steps]
    assert complete_checkpoints(out) == [f"step_{steps}"]
    assert not records(out, "subspaces_folded") and not (out / "hf_format").exists()
    assert f"stopped after step {steps} on SIGTERM" in output

    monkeypatch.delenv("OSFT_TEST_FOLD_DELAY_S")
    code, output = finish(launch(job, out, ranks, "--resume"))
    assert code == 0, output
    assert_no_orphans(out)
    assert [r["from_step"] for r in records(out, "resumed")] == [steps]
    assert [r["step"] for r in records(out, "subspaces_folded")] == [steps]
    assert (out / "hf_format" / f"step_{steps}" / "osft_subspaces.safetensors").is_file()
    assert records(out, "run_finished")[-1]["reason"] == "completed"
