"""A one-step run of a tiny model with its own generation config: the export carries that config
unchanged, and the plot shows the run's one point in every panel (docs/metrics.md, "Plots")."""

import json

import pytest
from transformers import GenerationConfig

from helpers import QA, chat, save_tiny_model, write_jsonl
from osft.trainer.launch.cli import main
from osft.trainer.observe.plot import draw_run, run_series

#: The source model's generation config: two stop ids (eos and <|endoftext|>) and sampling defaults.
GENERATION = dict(eos_token_id=[2, 0], pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.8,
                  repetition_penalty=1.05)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A saved tiny Llama whose generation_config.json is GENERATION, trained one OSFT step."""
    root = tmp_path_factory.mktemp("one-step")
    model_dir = save_tiny_model(root / "model")
    GenerationConfig(**GENERATION).save_pretrained(model_dir)
    data = write_jsonl(root / "train.jsonl", [chat(q, a) for q, a in QA[:4]])
    out = root / "run"
    assert main(["--model-name-or-path", str(model_dir), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "2", "--max-tokens-per-gpu", "128", "--max-seq-len", "64",
                 "--max-steps", "1"]) == 0
    return model_dir, out


def test_the_export_carries_the_source_generation_config_unchanged(one_step_run):
    model_dir, out = one_step_run
    source = json.loads((model_dir / "generation_config.json").read_text())
    exported = json.loads((out / "hf_format" / "step_1" / "generation_config.json").read_text())
    assert exported == source
    assert exported["eos_token_id"] == [2, 0] and exported["do_sample"] is True
    assert exported["temperature"] == 0.7 and exported["top_p"] == 0.8 and exported["repetition_penalty"] == 1.05


def test_a_one_step_plot_shows_its_point_in_every_panel(one_step_run):
    _, out = one_step_run
    assert main(["plot", str(out)]) == 0
    data = run_series(out)
    assert data.loss.steps == [1]
    fig = draw_run(data, "one step")
    for ax in fig.axes:
        drawn = [line for line in ax.get_lines() if len(line.get_xdata()) > 0]
        assert drawn, ax.get_ylabel()
        # one point is visible only with a marker (a line through one point draws nothing)
        assert all(len(line.get_xdata()) > 1 or line.get_marker() not in ("", "None", None) for line in drawn), \
            ax.get_ylabel()
