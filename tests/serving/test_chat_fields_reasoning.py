"""Issue 24's request fields and --reasoning-parser over the real app and a scripted engine
(test_vllm_fields.ScriptedEngine): chat_template_kwargs and reasoning_effort reach the template,
request_id and X-Request-Id name the response, truncate_prompt_tokens keeps the last N tokens
with vLLM's errors, replayed reasoning reaches the template under vLLM's two names, and the
deepseek_r1 / qwen3 parsers answer `reasoning` beside `content`, whole and streamed."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient
from reasoning_cases import CASES, resolve
from shoal.engine.entrypoints.api_server import build_app
from shoal.engine.entrypoints.reasoning import ReasoningParser
from shoal.engine.entrypoints.tool_calls import ToolSettings
from shoal.engine.frontend.input_processor import InputProcessor
from shoal.engine.frontend.output_processor import RequestOutput
from shoal.engine.tokenizer import load_tokenizer
from test_vllm_fields import ScriptedEngine, _sse

ECHO_TEMPLATE = ("{% for m in messages %}[{{ m.role }}:{{ m.content }}|{{ m.reasoning_content }}"
                 "|{{ m.reasoning }}]{% endfor %}think={{ enable_thinking }} "
                 "effort={{ reasoning_effort }} x={{ x }}")


@pytest.fixture
def think_model(tiny_model, tmp_path):
    """The tiny model's tokenizer with <think> and </think> as added tokens."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(tiny_model, tmp_path / "m")
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    return str(tmp_path / "m")


class ThinkEngine(ScriptedEngine):
    """Answers `script`: [(delta text, token ids)], the last delta finishing with "stop"."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.tokenizer = load_tokenizer(model)
        self.input_processor = InputProcessor(self.tokenizer, max_model_len=512,
                                              vocab_size=len(self.tokenizer))
        self.script: list[tuple[str, list[int]]] = []

    async def generate(self, ids, params, request_id, priority=0, lora=None):
        self.asked.append((list(ids), params))
        self.ids_asked = getattr(self, "ids_asked", []) + [request_id]
        done = 0
        for n, (text, tokens) in enumerate(self.script):
            done += len(tokens)
            yield RequestOutput(request_id, text, tokens, len(ids), done,
                                finish_reason="stop" if n == len(self.script) - 1 else None)


def _ids(engine) -> tuple[int, int]:
    p = ReasoningParser.load("deepseek_r1", engine.tokenizer)
    return p.start_id, p.end_id


@pytest.fixture
def think(think_model):
    engine = ThinkEngine(think_model)

    def client(parser: str | None = "deepseek_r1") -> TestClient:
        return TestClient(build_app(engine, served_model_names=["tiny"],
                                    tool_settings=ToolSettings(reasoning_parser=parser)))

    return engine, client


def _chat(c: TestClient, **extra):
    return c.post("/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}], **extra})


# ----- reasoning output -------------------------------------------------------------------------


@pytest.mark.parametrize("case", range(len(CASES)))
def test_deepseek_r1_answers_reasoning_beside_content_whole_and_streamed(think, case):
    engine, client = think
    engine.script = resolve(CASES[case], *_ids(engine))
    c = client()
    whole = "".join(t for t, _ in engine.script)
    reasoning, content = ReasoningParser.load("deepseek_r1", engine.tokenizer).split(whole)
    message = _chat(c).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    deltas = [ch["choices"][0]["delta"] for ch in _sse(_chat(c, stream=True).text)
              if ch["choices"]]
    stream = ReasoningParser.load("deepseek_r1", engine.tokenizer).stream()
    expected = [d for d in (stream.feed(t, i) for t, i in engine.script) if d is not None]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d for d in deltas[1:] if d] == expected  # vLLM's split (its parity test)


def test_the_reasoning_split_table():
    p = ReasoningParser("qwen3", 1, 2)
    assert p.split("<think>a</think>b") == ("a", "b")
    assert p.split("a</think>") == ("a", None)
    assert p.split("a") == ("a", None)
    assert p.split("<think>a</think>b", thinking=False) == (None, "<think>a</think>b")
    assert p.thinks({"enable_thinking": False}) is False
    assert ReasoningParser("deepseek_r1", 1, 2).thinks({"enable_thinking": False}) is True


def test_qwen3_without_thinking_answers_everything_as_content(think):
    engine, client = think
    engine.script = [("ok", [5])]
    c = client("qwen3")
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _chat(c, **body).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "ok")
    deltas = [ch["choices"][0]["delta"] for ch in _sse(_chat(c, stream=True, **body).text)
              if ch["choices"]]
    assert {"content": "ok"} in deltas


def test_without_a_parser_the_think_text_stays_content(think):
    engine, client = think
    engine.script = resolve(CASES[0], *_ids(engine))
    message = _chat(client(None)).json()["choices"][0]["message"]
    assert "reasoning" not in message and message["content"].startswith("<think>")


def test_a_tokenizer_without_think_tokens_fails_at_start(tiny_model):
    with pytest.raises(ValueError, match="could not locate"):
        ReasoningParser.load("qwen3", load_tokenizer(tiny_model))


def test_structured_output_while_thinking_is_refused(think):
    _, client = think
    r = _chat(client(), response_format={"type": "json_object"})
    assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]


def test_the_openai_client_reads_the_reasoning(think):
    from openai import OpenAI

    engine, client = think
    engine.script = resolve(CASES[0], *_ids(engine))
    oa = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client())
    msg = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}])
    assert msg.choices[0].message.model_extra["reasoning"] == "abc"
    chunks = list(oa.chat.completions.create(model="tiny", stream=True,
                                             messages=[{"role": "user", "content": "q"}]))
    assert "".join(ch.choices[0].delta.model_extra.get("reasoning") or ""
                   for ch in chunks if ch.choices) == "abc"


# ----- request fields ---------------------------------------------------------------------------


def test_template_kwargs_reasoning_effort_and_replayed_reasoning_reach_the_template(think):
    engine, client = think
    engine.tokenizer.chat_template, engine.tokenizer._template = ECHO_TEMPLATE, None
    engine.script = [("ok", [5])]
    c = client(None)
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "a", "reasoning_content": "r1", "refusal": None},
               {"role": "assistant", "content": "b", "reasoning": "r2"}]
    r = c.post("/v1/chat/completions", json={"messages": history, "reasoning_effort": "none",
                                              "chat_template_kwargs": {"x": 7}})
    assert r.status_code == 200
    prompt = engine.tokenizer.decode(engine.asked[-1][0])
    assert prompt == ("[user:q||][assistant:a|r1|r1][assistant:b|r2|r2]think=False "
                      "effort=none x=7")
    _chat(c, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert "think=False effort=high" in engine.tokenizer.decode(engine.asked[-1][0])
    r = _chat(c, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and "tokenize" in r.json()["error"]["message"]


def test_request_id_and_x_request_id_name_the_response(think):
    engine, client = think
    engine.script = [("ok", [5])]
    c = client(None)
    assert _chat(c, request_id="abc").json()["id"] == "chatcmpl-abc"
    assert _chat(c, request_id="abc", stream=True).text.count('"id":"chatcmpl-abc"') >= 2
    r = c.post("/v1/chat/completions", headers={"X-Request-Id": "hdr"}, json={
        "messages": [{"role": "user", "content": "hi"}], "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-hdr"
    assert c.post("/v1/completions", json={"prompt": "a", "request_id": "q"}).json()["id"] \
        == "cmpl-q"


def test_truncate_prompt_tokens_keeps_the_last_n_tokens(think):
    engine, client = think
    engine.script = [("ok", [5])]
    c = client(None)
    ids = list(range(10, 30))
    assert c.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 5}
                  ).status_code == 200
    assert engine.asked[-1][0] == ids[-5:]
    c.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 5,
                                    "truncation_side": "right"})
    assert engine.asked[-1][0] == ids[:5]
    c.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": -1})
    assert engine.asked[-1][0] == ids
    r = c.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 513})
    assert r.status_code == 400
    assert "truncate_prompt_tokens=513 cannot be greater than max_total_tokens = 512" in \
        r.json()["error"]["message"]
    assert c.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": -2}
                  ).status_code == 400
    _chat(c, truncate_prompt_tokens=3)
    assert len(engine.asked[-1][0]) == 3


@pytest.mark.parametrize("field, off, on", [
    ("spaces_between_special_tokens", True, False),
    ("length_penalty", 1.0, 0.5),
])
def test_defaults_only_fields_are_accepted_at_off_and_refused_otherwise(think, field, off, on):
    engine, client = think
    engine.script = [("ok", [5])]
    c = client(None)
    assert _chat(c, **{field: off}).status_code == 200
    r = _chat(c, **{field: on})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_reasoning_on_a_user_message_is_refused(think):
    _, client = think
    r = client(None).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "q", "reasoning_content": "r"}]})
    assert r.status_code == 400 and "messages.0.reasoning_content" in r.json()["error"]["message"]


def test_pythonic_tool_calls_over_http(think):
    engine, client = think
    engine.script = [('[weather(city="Os', [5]), ('lo")]', [6])]
    c = TestClient(build_app(engine, served_model_names=["tiny"], tool_settings=ToolSettings(
        enable_auto_tool_choice=True, tool_call_parser="pythonic")))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    choice = _chat(c, tools=tools).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "weather", "arguments": '{"city": "Oslo"}'}
    calls = [tc for ch in _sse(_chat(c, tools=tools, stream=True).text) if ch["choices"]
             for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == '{"city": "Oslo"}'
    assert calls[0]["function"]["name"] == "weather"


def test_an_unknown_field_is_logged_once_and_refused(think, caplog):
    _, client = think
    c = client(None)
    with caplog.at_level("WARNING", logger="shoal.engine.api"):
        for _ in range(2):
            assert _chat(c, frobnicate_once=1).status_code == 400
    assert sum("frobnicate_once" in r.getMessage() for r in caplog.records) == 1


def test_qwen3_coder_tool_calls_over_http(think):
    engine, client = think
    xml = "<tool_call>\n<function=weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    engine.script = [(xml[:30], [5]), (xml[30:], [6])]
    c = TestClient(build_app(engine, served_model_names=["tiny"], tool_settings=ToolSettings(
        enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}}}}}]
    call = _chat(c, tools=tools).json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": '{"days": 3}'}
    calls = [tc for ch in _sse(_chat(c, tools=tools, stream=True).text) if ch["choices"]
             for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == '{"days": 3}'
