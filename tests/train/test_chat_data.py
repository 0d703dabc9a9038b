"""Chat fine-tuning (training/chat_data.py, training/chat_batches.py): OpenAI's fine-tuning JSONL
rendered with the served model's chat template, the loss on the assistant messages only.

The masking is checked token by token against examples built by hand: for GPT-2's plain
"Role: content" template (the bundled model's) and for a ChatML Jinja template of a tiny
Llama-shaped checkpoint with its own tokenizer. Every bad line is refused naming its line, and
train.py fine-tunes (fully and with LoRA) on a few examples into a directory the engine serves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, get_tokenizer, load_checkpoint, save_checkpoint
from gptserve.model.lora.peft_format import CONFIG_FILE as ADAPTER_FILE
from gptserve.model.tokenizers import load_tokenizer
from gptserve.server.chat.templates import (
    ChatTemplate,
    JinjaChat,
    JinjaChatTemplate,
    load_chat_format,
)
from gptserve.training import cli as train
from gptserve.training import loop as training_loop
from gptserve.training.chat_batches import ChatBatchSampler, pad_rows
from gptserve.training.chat_data import (
    IGNORE_INDEX,
    ChatDataError,
    ChatRenderer,
    check_chat_file,
)
from gptserve.training.step import train_step
from tokenizers import AddedToken

from tests.conftest import byte_level_bpe
from tests.train.conftest import metric_rows

CHATML = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}


def line(*messages: dict, **fields: object) -> str:
    return json.dumps({"messages": list(messages), **fields})


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str | None = None, weight: int | None = None, **fields: object) -> dict:
    m: dict = {"role": "assistant", **fields}
    if text is not None:
        m["content"] = text
    if weight is not None:
        m["weight"] = weight
    return m


def trained_positions(tokens: list[int], targets: list[int]) -> list[int]:
    """The token positions the loss counts (target i predicts token i + 1)."""
    return [i + 1 for i, t in enumerate(targets) if t != IGNORE_INDEX]


# ----------------------------------------------------------------- GPT-2's plain template


def test_plain_template_masks_all_but_the_weighted_answers_token_by_token() -> None:
    tok = get_tokenizer("gpt2")
    renderer = ChatRenderer(ChatTemplate(), tok)
    text = line(
        system("Be brief."), user("Hi"), assistant("Hello!", weight=0), user("Bye"),
        assistant("Farewell."),
    )  # fmt: skip
    (example,) = check_chat_file([text], renderer, max_tokens=256)
    # by hand: the server's prompt for the last answer, then the answer and the turn's end
    # (the plain template's stop string "\nUser:", where the server stops generating)
    prompt = "System: Be brief.\nUser: Hi\nAssistant: Hello!\nUser: Bye\nAssistant:"
    answer = " Farewell.\nUser:"
    expected = tok.encode(prompt) + tok.encode(answer)
    assert example.tokens == expected
    assert example.tokens == tok.encode(prompt + answer)  # as the whole text tokenizes
    inputs, targets = example.inputs_and_targets()
    assert inputs == expected[:-1]
    n = len(tok.encode(prompt))
    assert targets == [IGNORE_INDEX] * (n - 1) + expected[n:]
    assert tok.decode([t for t in targets if t != IGNORE_INDEX]) == answer


def test_plain_template_trains_every_weighted_answer_and_its_end() -> None:
    tok = get_tokenizer("gpt2")
    text = line(user("Hi"), assistant("Hello!"), user("Bye"), assistant("Farewell.", weight=1))
    (example,) = check_chat_file([text], ChatRenderer(ChatTemplate(), tok))
    first = "User: Hi\nAssistant:"
    second = " Hello!\nUser: Bye\nAssistant:"
    ids = tok.encode(first + second + " Farewell.\nUser:")
    assert example.tokens == ids
    a = len(tok.encode(first))
    b = len(tok.encode(first + " Hello!\nUser:"))
    c = len(tok.encode(first + second))
    _, targets = example.inputs_and_targets()
    assert trained_positions(ids, targets) == [*range(a, b), *range(c, len(ids))]
    assert [tok.decode(ids[s:e]) for s, e in example.spans] == [
        " Hello!\nUser:",
        " Farewell.\nUser:",
    ]


def test_plain_template_writes_tools_calls_and_results_as_the_server_does() -> None:
    tok = get_tokenizer("gpt2")
    text = line(
        user("Weather in Oslo?"), assistant(tool_calls=[CALL]),
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, assistant("Sunny."),
        tools=[WEATHER],
    )  # fmt: skip
    (example,) = check_chat_file([text], ChatRenderer(ChatTemplate(), tok))
    rendered = tok.decode(example.tokens)
    assert rendered.startswith("System: You may call functions.")  # the tools' system turn
    assert [tok.decode(example.tokens[s:e]) for s, e in example.spans] == [
        ' <tool_call>\n{"name":"get_weather","arguments":{"city": "Oslo"}}\n</tool_call>\nUser:',
        " Sunny.\nUser:",
    ]
    assert "User: <tool_response>\nsunny\n</tool_response>\nAssistant: Sunny." in rendered


# --------------------------------------------------------------------- a Jinja template


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    """A tiny random Llama-shaped checkpoint with a byte-level BPE (ChatML's special tokens,
    <tool_call> tags as added tokens) and the CHATML template in tokenizer_config.json."""
    text = shakespeare_path.read_text(encoding="utf-8")[:40_000]
    rust = byte_level_bpe([text[i : i + 2000] for i in range(0, len(text), 2000)], 400,
                          ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # fmt: skip
    rust.add_tokens([AddedToken("<tool_call>", special=False),
                     AddedToken("</tool_call>", special=False)])  # fmt: skip
    path = tmp_path_factory.mktemp("chatml") / "tiny-chatml"
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=rust.get_vocab_size(), block_size=256, n_layer=2, n_head=4, n_embd=64,
        intermediate_size=96, bias=False, tie_embeddings=False, pos_encoding="rotary",
        norm="rmsnorm", activation="swiglu", tokenizer="hf",
    )  # fmt: skip
    tokenizer_config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    save_checkpoint(GPT(config), path, {"tokenizer_config.json": json.dumps(tokenizer_config)})
    rust.save(str(path / "tokenizer.json"))
    return path


def chatml_renderer(path: Path) -> ChatRenderer:
    tok = load_tokenizer("hf", path)
    template = load_chat_format(path, tok)  # as the server loads it
    assert isinstance(template, JinjaChat)
    return ChatRenderer(template, tok)


def test_jinja_template_masks_all_but_the_answers_and_their_end_of_turn(chatml_dir: Path) -> None:
    renderer = chatml_renderer(chatml_dir)
    tok = renderer.tokenizer
    text = line(system("Be brief."), user("Hi"), assistant("Hello there!"), user("Bye"),
                assistant("Farewell, friend.", weight=0))  # fmt: skip
    (example,) = check_chat_file(["", text], renderer)  # a blank line is skipped
    assert example.line == 2
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    prompt = head + "<|im_start|>assistant\n"
    answer = "Hello there!<|im_end|>\n"
    rest = "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nFarewell, friend.<|im_end|>\n"
    ids = tok.encode(prompt + answer + rest, allow_special=True)
    assert example.tokens == ids
    n, m = len(tok.encode(prompt, True)), len(tok.encode(prompt + answer, True))
    inputs, targets = example.inputs_and_targets()
    assert inputs == ids[:-1]
    assert targets == [IGNORE_INDEX] * (n - 1) + ids[n:m] + [IGNORE_INDEX] * (len(ids) - m)
    end = tok.encode("<|im_end|>", allow_special=True)
    assert len(end) == 1 and end[0] in targets  # the end-of-turn token is trained
    assert tok.decode(ids[n:m]) == answer


def test_jinja_template_with_tools_trains_the_calls(chatml_dir: Path) -> None:
    renderer = chatml_renderer(chatml_dir)
    tok = renderer.tokenizer
    text = line(
        user("Weather in Oslo?"), assistant(tool_calls=[CALL]),
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, assistant("Sunny."),
        tools=[WEATHER],
    )  # fmt: skip
    (example,) = check_chat_file([text], renderer)
    spans = [example.tokens[s:e] for s, e in example.spans]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert spans == [
        tok.encode(call + "<|im_end|>\n", True), tok.encode("Sunny.<|im_end|>\n", True)
    ]  # fmt: skip
    full = tok.decode(example.tokens)
    assert full.startswith("<|im_start|>system\n# Tools\n" + json.dumps(WEATHER))


def test_a_template_that_renders_earlier_turns_differently_is_refused(chatml_dir: Path) -> None:
    # drops the content of every assistant message but the last: not rendered turn by turn
    source = CHATML.replace("{{ m.content }}", "{{ m.content if loop.last or m.role != 'assistant' else '' }}")  # fmt: skip
    tok = load_tokenizer("hf", chatml_dir)
    renderer = ChatRenderer(JinjaChat(JinjaChatTemplate(source)), tok)
    good = line(user("Hi"), assistant("Hello!"))
    bad = line(user("Hi"), assistant("Hello!"), user("Bye"), assistant("Farewell."))
    with pytest.raises(ChatDataError) as caught:
        check_chat_file([good, bad], renderer)
    (error,) = caught.value.errors
    assert error.startswith("line 2: messages[1]: the chat template does not render this")


# ------------------------------------------------------------------------- bad lines

BAD_LINES = [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"prompt": "x"}), "no messages"),
    (json.dumps({"messages": []}), "no messages"),
    (line(user("x"), {"role": "robot", "content": "y"}), "messages[1]: unknown role 'robot'"),
    (line(user("x"), {"content": "y"}), "messages[1]: no role"),
    (line(user("x"), assistant()), "messages[1]: an assistant message needs content or tool_calls"),
    (line(user("x"), assistant("")), "an assistant message needs content or tool_calls"),
    (line(user("x"), assistant("y", weight=2)), "messages[1].weight must be 0 or 1, got 2"),
    (line(user("x"), assistant("y", weight=0.5)), "messages[1].weight must be 0 or 1, got 0.5"),
    (line(user("x"), assistant("y", weight=True)), "must be 0 or 1, got true"),
    (line({**user("x"), "weight": 1}, assistant("y")), "messages[0].weight: only assistant"),
    (line(user("x"), assistant("y", weight=0)), "no assistant message with weight 1"),
    (line(user("x")), "no assistant message with weight 1"),
    (line({"role": "user"}, assistant("y")), "messages[0]: a user message needs content"),
    (line(user("x"), assistant({"a": 1})), "messages[1].content must be a string"),
    (line(user("x"), assistant(tool_calls=[{**CALL, "function": {"name": "f", "arguments": {}}}])),
     "messages[1].tool_calls[0].function.arguments: Input should be a valid string"),
    (line(user("x"), assistant(tool_calls=[{**CALL, "function": {"name": "f", "arguments": "{"}}])),
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    (line(user("x"), assistant(tool_calls=[CALL]), {"role": "tool", "content": "sunny"},
          assistant("y")), "messages[2]: a tool message needs tool_call_id"),
    (line(user("x"), assistant("y"), tools="get_weather"), "tools: Input should be a valid list"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "says"), BAD_LINES)
def test_a_bad_line_is_refused_naming_its_line(bad: str, says: str) -> None:
    good = line(user("Hi"), assistant("Hello!"))
    with pytest.raises(ChatDataError) as caught:
        check_chat_file([good, "", bad, good])  # the bad one is line 3
    (error,) = caught.value.errors
    assert error.startswith("line 3: ") and says in error, error


def test_every_bad_line_is_named_and_too_long_examples_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    good = line(user("Hi"), assistant("Hello!"))
    long = line(user("word " * 300), assistant("Hello!"))
    path.write_bytes("\n".join([good, "{", good, long, line(user("x"))]).encode() + b"\n\xff\xfe\n")
    renderer = ChatRenderer(ChatTemplate(), get_tokenizer("gpt2"))
    with pytest.raises(ChatDataError) as caught:
        check_chat_file(path, renderer, max_tokens=64)
    errors = caught.value.errors
    assert [e.split(":")[0] for e in errors] == ["line 2", "line 4", "line 5", "line 6"]
    assert "longer than the context (64)" in errors[1] and "not UTF-8" in errors[3]
    assert str(caught.value).startswith(f"{path}: 4 bad lines: line 2: not JSON")
    path.write_text(f"{good}\n\n{good}\n", encoding="utf-8")
    assert [e.line for e in check_chat_file(str(path), renderer)] == [1, 3]  # a path as text


# ----------------------------------------------------------------------- the batches


def test_batches_pad_at_the_end_and_the_sampler_resumes_exactly() -> None:
    rows = [(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) + 100) for n in (3, 5, 2)]
    x, y = pad_rows(rows, pad_id=7)
    assert x.tolist()[2] == [0, 1, 7, 7, 7] and y.tolist()[0] == [100, 101, 102, -1, -1]
    a = ChatBatchSampler(rows, 2, [1, 0], pad_id=7)
    seen = [a.next()[0].shape[0] for _ in range(3)]  # crosses an epoch
    assert seen == [2, 2, 2]
    b = ChatBatchSampler(rows, 2, [9, 9], pad_id=7)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        torch.testing.assert_close(a.next(), b.next())


# ---------------------------------------------------------------------------- train.py

FAST = ["--batch-size", "4", "--log-interval", "1", "--sample-tokens", "4", "--eval-iters", "2",
        "--warmup-steps", "0"]  # fmt: skip
ANSWERS = ["To be, or not to be.", "Now is the winter.", "All the world's a stage.", "Friends, Romans."]  # fmt: skip


def chat_file(path: Path, answers: list[str]) -> Path:
    lines = [
        line(system("You quote Shakespeare."), user(f"Quote number {i}, please."), assistant(a))
        for i, a in enumerate(answers)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = train.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def greedy_through_the_engine(path: Path, prompt: list[int], n: int) -> list[int]:
    model = load_checkpoint(path, dtype=torch.float32)
    tok = load_tokenizer(model.config.tokenizer, path)
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=32))
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while engine.has_work():
        out += [t for ev in engine.step() for t in ev.token_ids]
    return out


def test_full_fine_tune_on_chat_data_learns_the_answers_and_serves(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = chat_file(tmp_path / "train.jsonl", ANSWERS)
    val = chat_file(tmp_path / "val.jsonl", ANSWERS[:2])
    out = tmp_path / "run"
    argv = ["--init-from", str(tiny_checkpoint), "--data", str(data), "--val-data", str(val),
            "--out", str(out), "--max-steps", "40", "--eval-interval", "20", "--lr", "3e-3",
            *FAST]  # fmt: skip
    printed = run(argv, capsys)
    assert "chat data: 4 examples" in printed and "/ 2 examples" in printed
    rows = metric_rows(out)
    losses = [r["train_loss"] for r in rows]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    # served: the checkpoint, its tokenizer and template, and the answer the engine generates
    tok = get_tokenizer("gpt2")
    renderer = ChatRenderer(load_chat_format(out, tok), tok)
    (example,) = check_chat_file([line(system("You quote Shakespeare."),
                                       user("Quote number 0, please."), assistant("x"))], renderer)  # fmt: skip
    prompt = example.tokens[: example.spans[0][0]]
    answer = tok.encode(" " + ANSWERS[0] + "\nUser:")
    assert greedy_through_the_engine(out, prompt, len(answer)) == answer


def test_resume_continues_a_chat_run_exactly(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    data = chat_file(tmp_path / "train.jsonl", ANSWERS * 2)
    common = ["--init-from", str(tiny_checkpoint), "--data", str(data), "--eval-interval", "3",
              "--val-fraction", "0.25", "--sample-tokens", "0", *FAST[:4], "--warmup-steps", "0"]  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    run([*common, "--out", str(whole), "--max-steps", "6"], capsys)
    steps = []

    def interrupted(*args: object, **kwargs: object) -> object:  # at step 5, after step 3's save
        steps.append(1)
        if len(steps) == 5:
            raise KeyboardInterrupt
        return train_step(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(training_loop, "train_step", interrupted)
        assert train.main([*common, "--out", str(part), "--max-steps", "6"]) == 130
    run(["--out", str(part), "--resume"], capsys)
    assert metric_rows(part) == metric_rows(whole)
    other = chat_file(tmp_path / "other.jsonl", ANSWERS[::-1] * 2)
    code = train.main(["--out", str(part), "--resume", "--data", str(other), "--max-steps", "9"])
    assert code == 2 and "is not the data the run" in capsys.readouterr().err


def test_lora_on_chat_data_with_a_jinja_template(
    chatml_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = chat_file(tmp_path / "chats.jsonl", ANSWERS)
    out = tmp_path / "lora"
    argv = ["--init-from", str(chatml_dir), "--data", str(data), "--out", str(out),
            "--lora-rank", "4", "--lora-targets", "all", "--max-steps", "12", "--lr", "1e-2",
            "--eval-interval", "6", "--val-fraction", "0.25", *FAST]  # fmt: skip
    run(argv, capsys)
    losses = [r["train_loss"] for r in metric_rows(out)]
    assert losses[-1] < losses[0], losses
    assert (out / ADAPTER_FILE).is_file() and (out / "adapter_model.safetensors").is_file()


def test_a_bad_chat_file_stops_before_training_with_its_lines(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(line(user("Hi"), assistant("Hello!")) + "\n" + line(user("Hi")) + "\n")
    out = tmp_path / "run"
    code = train.main(["--init-from", str(tiny_checkpoint), "--data", str(data), "--out", str(out),
                       "--max-steps", "2", "--val-fraction", "0"])  # fmt: skip
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and lines == [
        f"error: chat data {data}: line 2: no assistant message with weight 1: nothing to train on"
    ], err
    assert not out.exists()
    long = tmp_path / "long.jsonl"
    long.write_text(line(user("word " * 40), assistant("Hello!")) + "\n")
    argv = ["--init-from", str(tiny_checkpoint), "--data", str(long), "--out", str(out),
            "--block-size", "16", "--val-fraction", "0"]  # fmt: skip
    assert train.main(argv) == 2
    assert "line 1: the example is" in capsys.readouterr().err
    text = tmp_path / "x.txt"
    text.write_text("hello")
    assert train.main(["--data", str(text), "--val-data", str(data), "--out", str(out)]) == 2
    assert "--val-data needs chat data" in capsys.readouterr().err
