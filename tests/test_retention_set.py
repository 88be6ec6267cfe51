"""``osft-train make-retention-set`` on a tiny random model: valid chat rows, replies equal to a
direct greedy ``generate``, held-out row choice, exit code 2 with FILE:LINE on bad input, and a
stop signal that ends it at once with one line and nothing written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import chat, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from osft.trainer.launch.cli import EXIT_BAD_INPUT, EXIT_COMPLETED, main
from osft.trainer.data.validate import validate_chat_file
from osft.trainer.tools.retention_set import chat_prompts
from test_stop_rule import caught

PROMPTS = ["hello", "What do you like to do on the weekend?", "the capital of France is", "seven ate nine"]


def _direct_greedy(model_dir, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def test_replies_are_valid_rows_equal_to_direct_greedy_generate(tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n\n" + "\n".join(PROMPTS[2:]) + "\n")  # a blank line is skipped
    out = tmp_path / "retention.jsonl"
    argv = ["make-retention-set", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "6", "--batch-size", "3"]
    assert main(argv) == EXIT_COMPLETED
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records, problems = validate_chat_file(out, tokenizer)
    assert problems == []
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(rows) == len(PROMPTS)  # a random model does not stop at once here
    for prompt, row in zip(PROMPTS, rows):
        user, assistant = row["messages"]
        assert user == {"role": "user", "content": prompt}
        assert assistant["role"] == "assistant"
        assert assistant["content"] == _direct_greedy(tiny_model_dir, prompt, 6)  # batching changes nothing
    first = out.read_bytes()
    jsonl = tmp_path / "prompts.jsonl"
    write_jsonl(jsonl, [{"prompt": p} for p in PROMPTS])
    assert main(argv[:3] + ["--prompts", str(jsonl), "--out", str(out), "--max-new-tokens", "6"]) == EXIT_COMPLETED
    assert out.read_bytes() == first  # same prompts as jsonl, other batch size: the same file


def test_self_prompts_are_sampled_on_the_pre_query_template_and_answered_greedily(tmp_path, tiny_model_dir):
    """``--self-prompts 6``: six distinct prompts, each the sampled continuation of the chat
    template's start of a user turn (default system turn included) up to its first special token,
    with the greedy reply a direct ``generate`` gives; the same seed gives the same file, another
    seed other prompts."""
    from osft.trainer.tools.self_prompts import pre_query_template, sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prefix = pre_query_template(tokenizer)
    assert prefix == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    out = tmp_path / "self.jsonl"
    argv = ["make-retention-set", "--model", str(tiny_model_dir), "--self-prompts", "6", "--out", str(out),
            "--max-new-tokens", "5", "--batch-size", "4", "--seed", "3"]
    assert main(argv) == EXIT_COMPLETED
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = [r["messages"][0]["content"] for r in rows]
    assert validate_chat_file(out, tokenizer)[1] == []
    assert len(prompts) == len(set(prompts)) == 6 and all(p and p == p.strip() for p in prompts)
    assert not any(t in p for p in prompts for t in tokenizer.all_special_tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert sample_prompts(model, tokenizer, 6, seed=3, max_new_tokens=5, batch_size=4) == prompts
    torch.manual_seed(3)  # the first round by hand: the template's start continued, cut at a special token
    ids = tokenizer(prefix, return_tensors="pt", add_special_tokens=False)["input_ids"].expand(4, -1)
    first = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0, max_new_tokens=5, pad_token_id=tokenizer.pad_token_id)
    by_hand = [re.split(r"<\|im_end\|>|<\|im_start\|>|<\|endoftext\|>", text)[0].strip()
               for text in tokenizer.batch_decode(first[:, ids.shape[1]:])]
    by_hand = [t for i, t in enumerate(by_hand) if t and t not in by_hand[:i]]
    assert by_hand and prompts[: len(by_hand)] == by_hand
    for prompt, row in zip(prompts, rows):
        assert row["messages"][1]["content"] == _direct_greedy(tiny_model_dir, prompt, 5)
    first_file = out.read_bytes()
    assert main(argv) == EXIT_COMPLETED and out.read_bytes() == first_file
    assert main(argv[:-1] + ["4"]) == EXIT_COMPLETED
    assert [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()] != prompts


def test_self_prompts_give_up_after_four_samples_per_prompt_without_enough_distinct_ones():
    """A model that ends the user turn at once (or repeats itself) writes no usable prompt: after
    4 × count continuations, a ValueError that says how many were found."""
    from helpers import tiny_chat_tokenizer

    from osft.trainer.tools.self_prompts import sample_prompts

    tokenizer = tiny_chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hello = tokenizer("hello", add_special_tokens=False)["input_ids"]
    calls = []

    class Repeats:
        def generate(self, input_ids, **kwargs):
            calls.append(input_ids.shape[0])
            n = input_ids.shape[0]
            tail = [hello + [end]] + [[end] * (len(hello) + 1)] * (n - 1)  # "hello" once, then empty turns
            return torch.cat([input_ids, torch.tensor(tail)], dim=1)

    with pytest.raises(ValueError, match=r"1 distinct non-empty prompts in 12 samples, 3 asked for"):
        sample_prompts(Repeats(), tokenizer, 3, batch_size=5)
    assert calls == [5, 5, 2]


def test_self_prompts_need_a_chat_template_that_shows_where_the_user_turn_begins(tmp_path):
    """A template without the user's text verbatim has no place to start a prompt: exit 2, nothing written."""
    from helpers import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n<|im_end|>{% endfor %}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path / "self.jsonl"
    assert main(["make-retention-set", "--model", str(model_dir), "--self-prompts", "2", "--out", str(out)]) \
        == EXIT_BAD_INPUT
    assert not out.exists()


def test_from_chat_takes_last_user_turn_of_spread_rows(tmp_path):
    rows = [chat(f"q{i}", f"a{i}", f"q{i}b", f"a{i}b") for i in range(6)]
    rows[3] = chat("q0", "a", system="be brief")  # a repeated prompt is kept once
    path = write_jsonl(tmp_path / "eval.jsonl", rows)
    prompts, lines = chat_prompts(path, 3)
    assert lines == [1, 3, 5]  # rows floor(i * 6 / 3)
    assert prompts == ["q0", "q0b", "q2", "q2b", "q4", "q4b"]
    prompts, lines = chat_prompts(path, 6)
    assert lines == [1, 2, 3, 4, 5, 6] and prompts.count("q0") == 1


@pytest.mark.parametrize("content, flags, message", [
    ('{"prompt": "ok"}\n{"prompt": ""}\n', ["--prompts"],
     r'prompts\.jsonl:2: row needs a non-empty string field "prompt"'),
    ('{"prompt": "ok"}\n\n{"prompt": \n', ["--prompts"], r"prompts\.jsonl:3: invalid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
     '{"messages": [{"role": "gpt", "content": "x"}]}\n', ["--held-out", "1", "--from-chat"],
     r'prompts\.jsonl:2: .*unknown role "gpt"'),
])
def test_bad_input_exits_2_naming_file_and_line(tmp_path, tiny_model_dir, capsys, content, flags, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    out = tmp_path / "out.jsonl"
    code = main(["make-retention-set", "--model", str(tiny_model_dir), "--out", str(out), *flags, str(path)])
    assert code == EXIT_BAD_INPUT
    assert re.search(message, " ".join(capsys.readouterr().err.split()))
    assert not out.exists()


def test_a_stop_whose_handler_runs_inside_a_finalizer_still_stops_the_command():
    """The stop handler of make-retention-set and protect-base (trainer/tools/stops.py) raises in
    the main thread; raised inside a ``__del__`` (a tokenizer's regex nodes are collected while it
    loads) Python ignores it. It is delivered again and stops the work right after the finalizer;
    another ignored exception still reaches the previous ``sys.unraisablehook``."""
    from osft.trainer.tools.stops import ToolStopped, stopped_by_signals

    class Finalized:
        def __init__(self, signum):
            self.signum = signum

        def __del__(self):
            os.kill(os.getpid(), self.signum)
            for _ in range(10_000):  # the handler runs here, inside the finalizer
                pass

    class Broken:
        def __del__(self):
            raise RuntimeError("not a stop")

    seen, went_on, hook, handler = [], [], sys.unraisablehook, signal.getsignal(signal.SIGTERM)

    def ours(unraisable):
        seen.append(type(unraisable.exc_value).__name__)

    sys.unraisablehook = ours
    try:
        with pytest.raises(ToolStopped, match="stopped by SIGTERM"):
            with stopped_by_signals(lambda signum: ToolStopped(signum, "")):
                Broken()
                Finalized(signal.SIGTERM)
                start = time.monotonic()
                while time.monotonic() < start + 10:  # the work that would go on
                    pass
                went_on.append(True)
        assert not went_on and time.monotonic() - start < 2.0 and seen == ["RuntimeError"]
        assert signal.getsignal(signal.SIGTERM) is handler and sys.unraisablehook is ours  # put back
        Broken()
        assert seen == ["RuntimeError", "RuntimeError"]
    finally:
        sys.unraisablehook = hook


@pytest.mark.subprocess
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_it_within_seconds_with_one_line_and_leaves_the_output_as_it_was(tmp_path, tiny_model_dir,
                                                                                            signum):
    """20 prompts, each batch of one made 3 s slower (test hook OSFT_TEST_GENERATE_DELAY_S: 60 s in
    all): the signal 1 s after the command catches SIGTERM ends it within 5 s with exit code 128 + N and
    one line, no traceback; the existing output file is untouched and no temporary file is left."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(20)))
    out = tmp_path / "retention.jsonl"
    out.write_text("the earlier set\n")
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "make-retention-set", "--model", str(tiny_model_dir),
           "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4", "--batch-size", "1"]
    # SIGINT at its default in the command, as in a terminal, even when the tests run in a background
    # job (a shell starts those with SIGINT ignored, and the command keeps an ignored signal ignored)
    proc = subprocess.Popen(cmd, env={**os.environ, "OSFT_TEST_GENERATE_DELAY_S": "3"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not caught(proc.pid, signal.SIGTERM):  # its handlers are in (SIGINT has Python's from the start)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 5.0
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, output
    assert (f"make-retention-set: stopped by {name} before the replies were complete: nothing written ({out} "
            "unchanged)") in output
    assert "Traceback" not in output
    assert out.read_text() == "the earlier set\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt", "retention.jsonl"]
