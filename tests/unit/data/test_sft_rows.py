"""SFT rows (data/sft_rows.py): the shapes from JSON lines, CSV and Parquet (ShareGPT conversations, a
conversational prompt/completion, tools, tool calls and content parts among them), and every bad row
refused in one line naming its file and line (a Parquet row by row group and row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ft_framework.data.readers import source_files
from ft_framework.data.sft_rows import CHAT_PROMPT_COMPLETION, MESSAGES, PROMPT_COMPLETION, TEXT, SFTRow, read_sft_rows
from ft_framework.errors import UserError

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return path


def rows_of(path: Path, split: str = "train", limit: int | None = None):
    return list(read_sft_rows(path, split, limit))


def test_the_three_shapes_from_json_lines(tmp_path):
    text = rows_of(jsonl(tmp_path / "t.jsonl", [{"text": "a story", "id": 1}]))
    assert [(r.shape, r.text, r.where) for r in text] == [(TEXT, "a story", f"{tmp_path}/t.jsonl:1")]
    pairs = rows_of(jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "completion": "A", "source": "x"},
                                                 {"prompt": "", "completion": ""}]))
    assert [(r.shape, r.prompt, r.completion) for r in pairs] == [(PROMPT_COMPLETION, "Q", "A"),
                                                                 (PROMPT_COMPLETION, "", "")]
    chat = rows_of(jsonl(tmp_path / "m.jsonl", [{"messages": CHAT + [{"role": "tool", "content": "ok"}]}]))
    assert chat[0].shape == MESSAGES and list(chat[0].messages) == CHAT + [{"role": "tool", "content": "ok"}]


def test_csv_rows_and_a_conversation_held_as_json_in_a_cell(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('prompt,completion\n"Say ""hi""",hi\nQ2,"two\nlines"\n', encoding="utf-8")
    assert [(r.prompt, r.completion, r.where) for r in rows_of(path)] == [
        ('Say "hi"', "hi", f"{path}:2"), ("Q2", "two\nlines", f"{path}:3")]
    chat = tmp_path / "chat.csv"
    chat.write_text("messages\n" + '"' + json.dumps(CHAT).replace('"', '""') + '"\n', encoding="utf-8")
    assert list(rows_of(chat)[0].messages) == CHAT


def test_parquet_rows_with_a_list_of_structs_and_extra_columns(tmp_path):
    path = tmp_path / "train.parquet"
    # A struct column writes every field of every message: the absent ones as null.
    messages = [[dict(m, name=None) for m in CHAT], [{"role": "user", "content": "hi", "name": None},
                                                    {"role": "assistant", "content": "hello", "name": None}]]
    pq.write_table(pa.table({"messages": messages, "image": [b"\x00" * 10, b"\x01"]}), path, row_group_size=1)
    rows = rows_of(path)
    assert [list(r.messages) for r in rows] == [CHAT, [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "hello"}]]
    assert rows[1].where == f"{path} (row group 1, row 1)"
    assert source_files(path, "train") == [path]


def test_a_hub_directory_gives_each_split_its_own_files(tmp_path):
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    for name, prompts in (("train-00000-of-00001", ["a", "b"]), ("validation-00000-of-00001", ["c"])):
        table = pa.table({"prompt": prompts, "completion": ["x"] * len(prompts)})
        pq.write_table(table, hub / "data" / f"{name}.parquet")
    assert [r.prompt for r in rows_of(hub, "train")] == ["a", "b"]
    assert [r.prompt for r in rows_of(hub, "validation")] == ["c"]
    assert source_files(hub, "validation") == [hub / "data" / "validation-00000-of-00001.parquet"]


def test_limit_reads_the_first_rows_only(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(5)] + ["not json"])
    assert [r.text for r in rows_of(path, limit=2)] == ["row 0", "row 1"]


BAD_JSONL = [
    ({"prompt": "Q"}, r":1: `prompt` without `completion`; a row holds `text`, or `prompt` and `completion`, or "
                      r"`messages`, or `conversations` \(ShareGPT\)$"),
    ({"completion": "A"}, r":1: `completion` without `prompt`"),
    ({"txt": "typo"}, r":1: no SFT row shape in the keys \['txt'\]; a row holds `text`"),
    ({"text": "a", "prompt": "b", "completion": "c"}, r":1: the keys text, prompt, completion mix two shapes"),
    ({"text": "a", "messages": CHAT}, r":1: the keys text, messages mix two shapes"),
    ({"prompt": "Q", "completion": 4}, r":1: `completion` holds int 4, expected a string$"),
    ({"prompt": None, "completion": "A"}, r":1: `prompt` holds null, expected a string$"),
    ({"text": "  "}, r":1: `text` is empty"),
    ({"messages": []}, r":1: `messages` is empty; a conversation needs at least one assistant message$"),
    ({"messages": "not json"}, r":1: `messages` is text but not JSON"),
    ({"messages": {"role": "user"}}, r":1: `messages` holds dict, expected a list of messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r":1: the conversation has no assistant message"),
    ({"messages": CHAT[:2] + [{"role": "robot", "content": "4"}]},
     r":1: messages\[2\] has an unknown role 'robot'; valid: system, developer, user, assistant, tool$"),
    ({"messages": [{"role": "assistant", "content": 4}]},
     r":1: messages\[0\]: the content holds int 4, expected a string or a list of text parts"),
    ({"messages": [{"role": "assistant"}]}, r":1: messages\[0\] has no `content`"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     r":1: messages\[0\]: a user message holds `tool_calls`; only an assistant message calls tools$"),
    ({"messages": [{"role": "assistant", "content": "x", "weight": 1}]},
     r":1: messages\[0\] has the key 'weight'; a message holds role, content, tool_calls, tool_call_id, name$"),
    ({"messages": ["hi"]}, r":1: messages\[0\] is a str, expected an object with `role` and `content`$"),
]


@pytest.mark.parametrize("row, message", BAD_JSONL, ids=[m.split(":")[1][:30] for _, m in BAD_JSONL])
def test_a_bad_json_line_is_one_line_naming_its_file_and_line(tmp_path, row, message):
    path = jsonl(tmp_path / "train.jsonl", [row])
    with pytest.raises(UserError, match=r"^" + str(path).replace(".", r"\.") + message) as caught:
        rows_of(path)
    assert "\n" not in str(caught.value)


def test_bad_rows_further_down_name_their_line(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [{"text": "fine"}, "", {"prompt": "Q", "completion": "A"}])
    with pytest.raises(UserError, match=r"train\.jsonl:3: a row of the prompt_completion shape, but the file's first "
                                        r"row \(.*train\.jsonl:1\) is of the text shape; all rows of a file have one"):
        rows_of(path)


def test_a_csv_header_of_no_shape_is_named_at_the_header(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("question,answer\nQ,A\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"train\.csv:1: no SFT row shape in the keys \['answer', 'question'\]"):
        rows_of(path)


def test_a_bad_parquet_row_is_named_by_row_group_and_row(tmp_path):
    path = tmp_path / "train.parquet"
    chats = [CHAT, CHAT, CHAT[:2] + [{"role": "assistent", "content": "4"}]]
    pq.write_table(pa.table({"messages": chats}), path, row_group_size=2)
    with pytest.raises(UserError, match=r"train\.parquet \(row group 1, row 2\): messages\[2\] has an unknown role "
                                        r"'assistent'"):
        rows_of(path)


# ---- the formats TRL, axolotl and LLaMA-Factory users bring ------------------------------------------
def test_sharegpt_conversations_are_read_as_the_messages_they_mean(tmp_path):
    speakers = ["system", "human", "gpt", "function_call", "observation", "function", "tool", "user", "assistant"]
    row = {"conversations": [{"from": who, "value": f"v{i}"} for i, who in enumerate(speakers)], "id": 3}
    got = rows_of(jsonl(tmp_path / "s.jsonl", [row]))[0]
    assert got.shape == MESSAGES
    assert [m["role"] for m in got.messages] == ["system", "user", "assistant", "assistant", "tool", "tool", "tool",
                                                 "user", "assistant"]
    assert [m["content"] for m in got.messages] == [f"v{i}" for i in range(len(speakers))]


def test_a_conversational_prompt_and_completion(tmp_path):
    row = {"prompt": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "completion": [{"role": "assistant", "content": "4"}]}
    got = rows_of(jsonl(tmp_path / "c.jsonl", [row]))[0]
    assert got.shape == CHAT_PROMPT_COMPLETION
    assert list(got.messages) == row["prompt"] and list(got.completion_messages) == row["completion"]


def test_tools_tool_calls_and_content_parts(tmp_path):
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}
    tools = [{"type": "function", "function": {"name": "add"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "4", "tool_call_id": "call_0", "name": "add"},
                {"role": "assistant", "content": "4"}]
    as_list, as_text = rows_of(jsonl(tmp_path / "t.jsonl", [{"messages": messages, "tools": tools},
                                                            {"messages": messages, "tools": json.dumps(tools)}]))
    assert as_list == SFTRow(as_list.where, MESSAGES, messages=(
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "call_0", "name": "add"},
        {"role": "assistant", "content": "4"}), tools=tuple(tools))
    assert as_text.tools == as_list.tools and as_text.messages == as_list.messages


def test_parquet_parts_and_tool_calls_with_null_fields(tmp_path):
    """A Parquet struct writes every field everywhere: a null one counts as absent."""
    path = tmp_path / "train.parquet"
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "image": None}], "tool_calls": None},
                {"role": "assistant", "content": [{"type": "text", "text": "hello", "image": None}],
                 "tool_calls": None}]
    pq.write_table(pa.table({"messages": [messages], "tools": [None]}), path)
    got = rows_of(path)[0]
    assert list(got.messages) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert got.tools is None


BAD_FORMATS = [
    ({"conversations": [{"from": "bot", "value": "x"}]},
     r":1: conversations\[0\] is from an unknown speaker 'bot'; valid: human, user, gpt, assistant, system"),
    ({"conversations": [{"from": "human", "content": "x"}]},
     r":1: conversations\[0\] has the key 'content'; a ShareGPT message holds `from` and `value` only$"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, r":1: the conversation has no assistant message"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": "a"},
     r":1: `completion` holds str while the other is a list of messages"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": []}, r":1: `completion` is an empty list"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant"}]},
     r":1: completion\[0\] has no `content`"),
    ({"text": "a story", "tools": [{"type": "function"}]}, r":1: `tools` beside a text row"),
    ({"prompt": "q", "completion": "a", "tools": []}, r":1: `tools` beside a prompt/completion row of strings"),
    ({"messages": CHAT, "tools": "not json"}, r":1: `tools` is text but not JSON"),
    ({"messages": CHAT, "tools": [1]},
     r":1: `tools` holds list, expected a list of objects, each a tool's description"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}, CHAT[2]]},
     r":1: messages\[0\]: content part \[0\] is of type 'image'; only text parts are read"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}, CHAT[2]]},
     r":1: messages\[0\]: content part \[0\]: `text` holds null, expected a string$"),
    ({"messages": [CHAT[1], {"role": "assistant", "tool_calls": "add"}]},
     r":1: messages\[1\].tool_calls holds str, expected a list of objects, each a tool call$"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}, CHAT[2]]},
     r":1: messages\[0\]: a user message holds `tool_call_id`; it names the call a tool message answers$"),
]


@pytest.mark.parametrize("row, message", BAD_FORMATS, ids=[m.split(":")[1][:30] for _, m in BAD_FORMATS])
def test_a_bad_row_of_the_new_formats_is_one_line_naming_its_file_and_line(tmp_path, row, message):
    path = jsonl(tmp_path / "train.jsonl", [row])
    with pytest.raises(UserError, match=r"^" + str(path).replace(".", r"\.") + message) as caught:
        rows_of(path)
    assert "\n" not in str(caught.value)


def test_a_file_mixing_messages_and_sharegpt_rows_is_refused(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [{"messages": CHAT}, {"conversations": [{"from": "gpt", "value": "4"}]}])
    with pytest.raises(UserError, match=r"train\.jsonl:2: a row of the conversations \(ShareGPT\) shape, but the "
                                        r"file's first row \(.*train\.jsonl:1\) is of the messages shape"):
        rows_of(path)
