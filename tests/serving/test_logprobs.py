"""Logprobs over HTTP: completions (logprobs, echo, streaming), chat (logprobs + top_logprobs,
streaming) and vLLM's prompt_logprobs, parsed by the official `openai` client and checked
against transformers' float32 log_softmax of the same model; out-of-range values are 400s."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from support.servers import API_KEY, MODEL_NAME, healthy_server

pytestmark = pytest.mark.process

TOL = 1e-3
PROMPT = "def parse(text):\n    return"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # float32 for a 1e-3 comparison; a 16-token budget chunks every prompt's prefill.
    with healthy_server(tiny_model, tmp_path_factory, "--dtype", "float32",
                        "--max-num-batched-tokens", "16", "--max-logprobs", "5",
                        api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def oracle(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        """Row p: the distribution of token p + 1."""
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    log_softmax.tokenizer = tok
    return log_softmax


def token_str(tok, token_id: int) -> str:
    return tok.decode([token_id])


def complete(client, **kw):
    kw.setdefault("extra_body", {})["ignore_eos"] = True
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0, **kw)


def test_completion_logprobs_equal_transformers(client, oracle):
    r = complete(client, max_tokens=5, logprobs=3, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    lp = choice.logprobs
    prompt_ids, ids = choice.prompt_token_ids, choice.token_ids
    ref = oracle(prompt_ids + ids)
    tok = oracle.tokenizer
    assert lp.tokens == [token_str(tok, t) for t in ids]
    for k, t in enumerate(ids):
        row = ref[len(prompt_ids) - 1 + k]
        assert abs(lp.token_logprobs[k] - row[t].item()) < TOL
        top = row.topk(3)
        want = {token_str(tok, i): v for i, v in zip(top.indices.tolist(), top.values.tolist(),
                                                     strict=True)}
        assert lp.top_logprobs[k].keys() == want.keys()  # greedy: the sampled token is top 1
        for key, value in want.items():
            assert abs(lp.top_logprobs[k][key] - value) < TOL
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    assert "".join(lp.tokens) == choice.text


def test_echo_with_logprobs_prepends_the_prompt_and_its_logprobs(client, oracle):
    r = complete(client, max_tokens=3, logprobs=1, echo=True,
                 extra_body={"return_token_ids": True})
    choice = r.choices[0]
    prompt_ids, ids = choice.prompt_token_ids, choice.token_ids
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    all_ids = prompt_ids + ids
    assert len(lp.tokens) == len(all_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as OpenAI and vLLM
    ref = oracle(all_ids)
    for k in range(1, len(all_ids)):
        assert abs(lp.token_logprobs[k] - ref[k - 1][all_ids[k]].item()) < TOL
        assert 1 <= len(lp.top_logprobs[k]) <= 2  # the token itself and the top 1
    assert lp.text_offset[0] == 0


def test_echo_without_logprobs_only_prepends_the_text(client):
    plain = complete(client, max_tokens=4).choices[0]
    echoed = complete(client, max_tokens=4, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None


def test_streamed_completion_logprobs_equal_the_whole_ones(client):
    whole = complete(client, max_tokens=6, logprobs=2, echo=True).choices[0].logprobs
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in complete(client, max_tokens=6, logprobs=2, echo=True, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    assert tokens == whole.tokens and tops == whole.top_logprobs
    assert values == whole.token_logprobs
    assert text.startswith(PROMPT)
    assert offsets == whole.text_offset


def as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def test_completion_tokens_as_token_ids_in_vllms_format(client, oracle):
    """return_tokens_as_token_ids: every token and top_logprobs key is "token_id:{id}" and
    text_offset counts those strings (vLLM's); the values are the same."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = complete(client, max_tokens=4, logprobs=2, echo=True, extra_body=extra)
    choice = r.choices[0]
    all_ids = choice.prompt_token_ids + choice.token_ids
    lp = choice.logprobs
    assert lp.tokens == [as_id(t) for t in all_ids]
    assert lp.text_offset == [sum(len(as_id(t)) for t in all_ids[:k]) for k in range(len(all_ids))]
    plain = complete(client, max_tokens=4, logprobs=2, echo=True).choices[0].logprobs
    assert lp.token_logprobs == plain.token_logprobs and lp.top_logprobs[0] is None
    ref = oracle(all_ids)
    for k in range(1, len(all_ids)):
        top = ref[k - 1].topk(2).indices.tolist()
        assert set(lp.top_logprobs[k]) <= {as_id(all_ids[k]), *map(as_id, top)}
        assert sorted(lp.top_logprobs[k].values()) == sorted(plain.top_logprobs[k].values())
    tokens, offsets = [], []
    for chunk in complete(client, max_tokens=4, logprobs=2, echo=True, stream=True,
                          extra_body={"return_tokens_as_token_ids": True}):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_tokens_as_token_ids_in_vllms_format(client, oracle):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = chat(client, max_tokens=4, logprobs=True, top_logprobs=2, extra_body=extra)
    ids = r.choices[0].token_ids
    content = r.choices[0].logprobs.content
    plain = chat(client, max_tokens=4, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [e.token for e in content] == [as_id(t) for t in ids]
    # vLLM's: the position's own bytes are its text's; an alternative's are its placeholder's
    assert [e.bytes for e in content] == [e.bytes for e in plain]
    assert [e.logprob for e in content] == [e.logprob for e in plain]
    rendered = oracle.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                    add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    for k, entry in enumerate(content):
        top = oracle(rendered + ids[:k])[-1].topk(2).indices.tolist()
        assert [a.token for a in entry.top_logprobs] == [as_id(i) for i in top]
        assert [a.bytes for a in entry.top_logprobs] == [list(as_id(i).encode()) for i in top]
    streamed = []
    for chunk in chat(client, max_tokens=4, logprobs=True, top_logprobs=2, stream=True,
                      extra_body={"return_tokens_as_token_ids": True}):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in streamed] == \
        [(e.token, [a.token for a in e.top_logprobs]) for e in content]


def chat(client, **kw):
    kw.setdefault("extra_body", {})["ignore_eos"] = True
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], temperature=0, **kw)


def test_chat_top_logprobs_equal_transformers(client, oracle):
    r = chat(client, max_tokens=4, logprobs=True, top_logprobs=2,
             extra_body={"prompt_logprobs": 1})
    content = r.choices[0].logprobs.content
    plp = r.model_extra["prompt_logprobs"]  # vLLM: on the response, the prompt is shared
    assert plp[0] is None
    assert len(content) == 4
    tok = oracle.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                       add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    # prompt_logprobs name every prompt token but the first, the chosen one first in each dict
    assert [int(next(iter(d))) for d in plp[1:]] == rendered[1:]
    ids: list[int] = []
    for entry in content:  # greedy: transformers' argmax, one forward per token
        row = oracle(rendered + ids)[-1]
        t = int(row.argmax())
        assert entry.token == token_str(tok, t)
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        assert abs(entry.logprob - row[t].item()) < TOL
        top = row.topk(2)
        assert [a.token for a in entry.top_logprobs] == [token_str(tok, i)
                                                       for i in top.indices.tolist()]
        for alt, value in zip(entry.top_logprobs, top.values.tolist(), strict=True):
            assert abs(alt.logprob - value) < TOL
        ids.append(t)
    ref = oracle(rendered)
    for j in range(1, len(rendered)):
        d = plp[j][str(rendered[j])]
        assert abs(d["logprob"] - ref[j - 1][rendered[j]].item()) < TOL
        assert d["rank"] == int((ref[j - 1] >= ref[j - 1][rendered[j]] - 1e-6).sum())
        assert d["decoded_token"] == token_str(tok, rendered[j])
        assert len(plp[j]) <= 2


def test_streamed_chat_deltas_carry_their_tokens_logprobs(client):
    whole = chat(client, max_tokens=5, logprobs=True, top_logprobs=1).choices[0].logprobs.content
    streamed = []
    for chunk in chat(client, max_tokens=5, logprobs=True, top_logprobs=1, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in whole]


def test_completion_prompt_logprobs_are_per_choice(client, oracle):
    r = complete(client, max_tokens=2, n=2, extra_body={"prompt_logprobs": 0,
                                                       "return_token_ids": True})
    for choice in r.choices:
        plp = choice.model_extra["prompt_logprobs"]
        ids = choice.prompt_token_ids
        assert plp[0] is None and len(plp) == len(ids)
        ref = oracle(ids)
        for j in range(1, len(ids)):
            (key, d), = plp[j].items()
            assert key == str(ids[j])
            assert abs(d["logprob"] - ref[j - 1][ids[j]].item()) < TOL


def test_no_logprobs_asked_means_none_in_the_response(client):
    r = complete(client, max_tokens=2)
    assert r.choices[0].logprobs is None and "prompt_logprobs" not in r.choices[0].model_extra
    c = chat(client, max_tokens=2)
    assert c.choices[0].logprobs is None


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs must be between 0 and 5"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 6},
     "prompt_logprobs must be between 0 and 5"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6},
     "top_logprobs must be between 0 and 5"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_bad_logprob_fields_are_400_naming_the_field(server, path, body, field):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, "max_tokens": 2, **body},
                   headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]

