"""Tool calls and reasoning (docs/data.md, "Tool calls and reasoning"): tool calls, tool results,
per-row tools and reasoning, with a Qwen3-style template that renders earlier turns differently;
what is trained is checked on decoded tokens."""

import json

import pytest

from helpers import TOOL_REASONING_TEMPLATE, save_tiny_model, tiny_chat_tokenizer, write_jsonl
from osft.trainer.config import TrainConfig, build_parser, check_config, config_from_args, config_to_argv
from osft.trainer.data import DataValidationError, tokenize_chat_file
from osft.trainer.data.tokenize import IGNORE_INDEX
from osft.trainer.data.validate import validate_chat_file
from osft.trainer.model.loading import load_tokenizer

END = "<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def conversation(**train):
    """A Qwen3-style agent exchange: a reasoned tool call, its result, a reasoned answer, then a
    follow-up question answered without reasoning. ``train`` sets "train" on messages by index."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": "The tool says sunny."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    for index, value in train.items():
        messages[int(index.removeprefix("m"))]["train"] = value
    return {"messages": messages, "tools": TOOLS}


def trained_texts(tok, data) -> list[list[str]]:
    """Per sample, the decoded runs of consecutive trained tokens."""
    out = []
    for k in range(len(data)):
        runs, cur = [], []
        for tok_id, label in zip(data[k]["input_ids"], data[k]["labels"]):
            if label != IGNORE_INDEX:
                cur.append(tok_id)
            elif cur:
                runs, cur = runs + [cur], []
        out.append([tok.decode(r) for r in runs + ([cur] if cur else [])])
    return out


def test_a_qwen3_style_tool_call_with_reasoning_trains_what_the_model_generated(tmp_path):
    """Each assistant turn is trained as the template renders it when it is the newest turn: the
    tool call with its reasoning, the answer with its reasoning (in context of the call and the
    result), the last answer without the empty block; never the tools, the tool result or a user turn."""
    tok = tiny_chat_tokenizer(chat_template=TOOL_REASONING_TEMPLATE)
    data = tokenize_chat_file(write_jsonl(tmp_path / "t.jsonl", [conversation()]), tok, 1024)
    assert trained_texts(tok, data) == [
        ["You are welcome." + END],  # the whole conversation: earlier turns are history (no reasoning)
        ["<think>\nI should call the tool.\n</think>\n\n" + CALL + END],
        ["<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris." + END],
    ]
    texts = [tok.decode(data[k]["input_ids"]) for k in range(3)]
    assert "I should call the tool." not in texts[0] and texts[0].count("<tool_response>") == 1
    assert texts[2].startswith('<|im_start|>system\n# Tools\n{"type": "function"')  # tools reach the template
    assert "I should call the tool." in texts[2]  # the call's reasoning is context of the answer in the same query
    assert data.report.split == [(1, 3)]
    assert data.report.template_inserted[0]["text"] == "<think>\n\n</think>\n\n"  # the last turn's empty block
    # without reasoning: only what follows it
    lean = tokenize_chat_file(write_jsonl(tmp_path / "t.jsonl", [conversation()]), tok, 1024, train_reasoning=False)
    assert trained_texts(tok, lean) == [["You are welcome." + END], [CALL + END], ["It is sunny in Paris." + END]]


@pytest.mark.parametrize("last_only,train,expected", [
    (True, {}, [["You are welcome." + END]]),
    (True, {"m1": True}, [["You are welcome." + END], ["<think>\nI should call the tool.\n</think>\n\n" + CALL + END]]),
    (False, {"m3": False, "m5": False}, [["<think>\nI should call the tool.\n</think>\n\n" + CALL + END]]),
])
def test_last_turn_only_and_per_message_train(tmp_path, last_only, train, expected):
    tok = tiny_chat_tokenizer(chat_template=TOOL_REASONING_TEMPLATE)
    data = tokenize_chat_file(write_jsonl(tmp_path / "t.jsonl", [conversation(**train)]), tok, 1024,
                              last_turn_only=last_only)
    assert trained_texts(tok, data) == expected


def test_a_plain_template_trains_every_turn_in_one_sample_with_tools(tmp_path):
    """A template that renders every prefix the same way keeps one sample per conversation."""
    tok = tiny_chat_tokenizer(chat_template=TOOL_REASONING_TEMPLATE.replace("loop.index0 > ns.last_user", "false"))
    data = tokenize_chat_file(write_jsonl(tmp_path / "t.jsonl", [conversation(m5=False)]), tok, 1024)
    assert trained_texts(tok, data) == [[CALL + END, "It is sunny in Paris." + END]] and data.report.split == []


def test_validation_knows_the_tool_and_reasoning_fields(tmp_path):
    good = conversation()
    rows = [
        good,
        {"messages": [{"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "user", "content": "x", "reasoning_content": "r", "train": True},
                      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": ""}}]}]},
        {"messages": [{"role": "user", "content": "x"},
                      {"role": "assistant", "content": None, "tool_calls": [], "train": "yes"}], "tools": {"a": 1}},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "reasoning_content": 3,
                       "tool_calls": [{"name": "f", "arguments": 5}]}]},
    ]
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    records, problems = validate_chat_file(path, tiny_chat_tokenizer(chat_template=TOOL_REASONING_TEMPLATE))
    assert [c.line for c in records] == [1] and records[0].tools == TOOLS
    assert [str(p).removeprefix(f"{path}:") for p in problems] == [
        "2: messages[0] is a tool result, but no assistant tool call comes before it",
        "3: messages[0].reasoning_content is only allowed on assistant messages",
        "3: messages[0].train is only allowed on assistant messages",
        "3: messages[1].tool_calls[0].function.name must be a non-empty string",
        '4: "tools" must be a list of objects (tool schemas)',
        "4: messages[1].train must be true or false, got string",
        "4: messages[1].tool_calls must be a non-empty list of tool calls",
        "4: missing content in messages[1].content",
        "5: messages[1].reasoning_content must be a string, got int",
        "5: messages[1].tool_calls[0].arguments must be an object or a JSON string, got int",
    ]


#: ChatML rendering each tool call as {"name": ..., "parameters": <arguments | tojson>} (as Llama 3.1's
#: template does), or looping over the arguments' items (as Qwen3-Coder's does).
_CHATML_CALLS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                 "{% for c in m['tool_calls'] or [] %}CALL{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOJSON_CALLS = _CHATML_CALLS.replace(
    "CALL", "{{ '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' }}"
            "{{ c['function']['arguments'] | tojson }}{{ '}' }}")
ITEMS_CALLS = _CHATML_CALLS.replace(
    "CALL", "{{ '<function=' + c['function']['name'] + '>' }}"
            "{% for k, v in c['function']['arguments'] | items %}{{ '<parameter=' + k + '>' + v + '</parameter>' }}"
            "{% endfor %}{{ '</function>' }}")


def weather_call(arguments) -> dict:
    return {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}


@pytest.mark.parametrize("template", [TOJSON_CALLS, ITEMS_CALLS], ids=["tojson", "items"])
def test_tool_call_arguments_as_a_json_string_train_as_the_object_and_other_strings_are_refused(tmp_path, template):
    """The OpenAI wire format gives arguments as the JSON text of an object: the template gets the
    object, so it is neither encoded twice (tojson) nor a crash (items); a string that is not the
    JSON text of an object is refused, located by file, line and field."""
    tok = tiny_chat_tokenizer(chat_template=template)
    arguments = {"city": "Paris", "unit": "C"}
    rows = [weather_call(arguments), weather_call(json.dumps(arguments)), weather_call(json.dumps(arguments, indent=2))]
    data = tokenize_chat_file(write_jsonl(tmp_path / "calls.jsonl", rows), tok, 1024)
    assert len(data) == 3
    assert data[0]["input_ids"] == data[1]["input_ids"] == data[2]["input_ids"]
    assert data[0]["labels"] == data[1]["labels"] == data[2]["labels"]
    call = trained_texts(tok, data)[0][0]
    assert "Paris" in call and "\\" not in call
    bad = write_jsonl(tmp_path / "bad.jsonl", [weather_call("city=Paris"), weather_call("[1, 2]"), rows[1]])
    with pytest.raises(DataValidationError) as exc:
        tokenize_chat_file(bad, tok, 1024)
    hint = "give the arguments as an object, or as the JSON text of one"
    assert [str(p).removeprefix(f"{bad}:") for p in exc.value.problems] == [
        ("1: messages[1].tool_calls[0].function.arguments is a string that is not a JSON object (invalid JSON: "
         f"Expecting value at column 1); {hint}"),
        "2: messages[1].tool_calls[0].function.arguments is a string that is not a JSON object (it holds array); "
        + hint]


#: REASONING_CHATML_TEMPLATE that, as Qwen3's does, takes the reasoning out of an assistant content
#: holding </think> (after an optional leading <think>) when the message has no reasoning_content.
THINK_IN_CONTENT_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% set ns.content = m['content'] %}"
    "{% set ns.reasoning = m['reasoning_content'] if m['reasoning_content'] is defined else '' %}"
    "{% if m['role'] == 'assistant' and not ns.reasoning and '</think>' in ns.content %}"
    "{% set ns.reasoning = ns.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set ns.content = ns.content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<think>\\n' + ns.reasoning + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ ns.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
THINK_ROWS = [
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "2+2 equals 4.\n</think>\n\nThe answer is 4."}]},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>\n2+2 equals 4.\n</think>\n\nThe answer is 4."}]},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "2+2 equals 4."}]},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>\n2+2 equals 4.\n</think>\n\nThe answer is 4."},
                  {"role": "user", "content": "3+3?"},
                  {"role": "assistant", "content": "<think>\n3+3 equals 6.\n</think>\n\nThe answer is 6."}]},
]


@pytest.mark.parametrize("template", [THINK_IN_CONTENT_TEMPLATE, TOOL_REASONING_TEMPLATE.replace(
    "loop.index0 > ns.last_user", "false")], ids=["splits-think", "renders-content-as-is"])
def test_no_train_reasoning_leaves_reasoning_inside_the_content_untrained(tmp_path, template):
    """Reasoning written into the content (<think>R</think>C, or R</think>C as raw completions have
    it) is left untrained by --no-train-reasoning as reasoning_content is, in every turn, whether the
    template splits it out into its reasoning block or renders the content as it is."""
    tok = tiny_chat_tokenizer(chat_template=template)
    path = write_jsonl(tmp_path / "think.jsonl", THINK_ROWS)
    lean = tokenize_chat_file(path, tok, 1024, train_reasoning=False)
    texts = trained_texts(tok, lean)
    by_row = {}
    for k in range(len(lean)):
        by_row.setdefault(lean[k]["line"], []).append(k)
    for row in (1, 2, 3):
        (k,) = by_row[row]
        assert texts[k] == ["The answer is 4." + END], row
    trained_ids = [[i for i, label in zip(lean[by_row[row][0]]["input_ids"], lean[by_row[row][0]]["labels"])
                    if label != IGNORE_INDEX] for row in (1, 2, 3)]
    assert trained_ids[0] == trained_ids[1] == trained_ids[2]
    assert sorted(t for k in by_row[4] for t in texts[k]) == ["The answer is 4." + END, "The answer is 6." + END]
    full = trained_texts(tok, tokenize_chat_file(path, tok, 1024))  # with the reasoning trained, as before
    assert full[0] == ["2+2 equals 4.\n</think>\n\nThe answer is 4." + END]
    if template == THINK_IN_CONTENT_TEMPLATE:  # its <think>\n before row 1's reasoning is the template's
        assert full[1] == full[2] == ["<think>\n2+2 equals 4.\n</think>\n\nThe answer is 4." + END]
        inserted = tokenize_chat_file(path, tok, 1024).report.template_inserted
        assert [(e["text"], e["samples"]) for e in inserted] == [("<think>\n", 1)]
    # a <think> without its </think>: the reasoning cannot be told from the answer, and the run says so
    unclosed = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\n2+2 is"}]}
    report = tokenize_chat_file(write_jsonl(tmp_path / "open.jsonl", [THINK_ROWS[1], unclosed]), tok, 1024,
                                train_reasoning=False).report
    assert report.reasoning_trained == [2]
    assert ("  warning: 1 assistant turns hold <think> without a closing </think>, so their reasoning is trained in "
            "spite of --no-train-reasoning: line 2") in report.summary_lines()


def test_chat_template_file_replaces_the_tokenizer_s_and_the_flags_round_trip(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    template = tmp_path / "qwen3ish.jinja"
    template.write_text(TOOL_REASONING_TEMPLATE)
    assert load_tokenizer(model, chat_template=template).chat_template == TOOL_REASONING_TEMPLATE
    assert load_tokenizer(model).chat_template != TOOL_REASONING_TEMPLATE
    data = write_jsonl(tmp_path / "d.jsonl", [conversation()])
    args = build_parser().parse_args(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir",
                                      str(tmp_path / "o"), "--chat-template", str(template), "--no-train-reasoning",
                                      "--train-last-turn-only"])
    cfg = config_from_args(args)
    assert (cfg.chat_template, cfg.train_reasoning, cfg.train_last_turn_only) == (str(template), False, True)
    assert config_from_args(build_parser().parse_args(config_to_argv(cfg))) == cfg
    check_config(cfg)
    with pytest.raises(ValueError, match="--chat-template .*: no such file"):
        check_config(TrainConfig(str(model), str(data), "o", chat_template=str(tmp_path / "none.jinja")))
