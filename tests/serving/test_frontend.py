"""Frontend pieces without processes: the tokenizer matches transformers', the one-slot collector
merges (never drops), incremental detokenization and stop strings."""

from __future__ import annotations

import asyncio

import pytest
from shoal.engine.frontend.output_processor import (
    IncrementalDetokenizer,
    OutputProcessor,
    RequestOutput,
    RequestOutputCollector,
)
from shoal.engine.tokenizer import FastTokenizer
from shoal.engine.wire import EngineCoreOutput, FinishReason, SamplingParams

TEXTS = ["def main():\n    print('hello, world')\n", "  x = [1, 2, 3]  # é ü 🙂", ""]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    from transformers import AutoTokenizer

    return FastTokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(tokenizers, text):
    fast, hf = tokenizers
    for special in (True, False):
        assert fast(text, add_special_tokens=special).input_ids == \
            hf(text, add_special_tokens=special).input_ids
    ids = hf(text).input_ids
    for skip in (True, False):
        assert (fast.decode(ids, skip_special_tokens=skip)
                == hf.decode(ids, skip_special_tokens=skip))
    assert fast.eos_token_id == hf.eos_token_id and len(fast) == len(hf)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tokenizers, messages):
    fast, hf = tokenizers
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        if not isinstance(expected, list):
            expected = expected["input_ids"]
        assert fast.apply_chat_template(messages, add_generation_prompt=gen) == list(expected)


def _out(text, tokens, n, finish=None):
    return RequestOutput("r", text, tokens, 3, n, finish_reason=finish)


async def test_collector_merges_outputs_when_the_consumer_is_slow():
    c = RequestOutputCollector()
    c.put(_out("a", [1], 1))
    c.put(_out("b", [2], 2))
    c.put(_out("c", [3], 3, "length"))
    got = await c.get()
    assert (got.text, got.token_ids, got.num_output_tokens, got.finish_reason) == \
        ("abc", [1, 2, 3], 3, "length")
    assert c.get_nowait() is None


async def test_collector_wakes_a_waiting_consumer_and_raises_errors():
    c = RequestOutputCollector()
    waiter = asyncio.ensure_future(c.get())
    await asyncio.sleep(0)
    c.put(_out("x", [1], 1))
    assert (await asyncio.wait_for(waiter, 5)).text == "x"
    c.put(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        await c.get()


def test_incremental_detokenization_equals_a_full_decode(tokenizers):
    fast, hf = tokenizers
    ids = hf("ünïcödé 🙂 text with spaces\n\tand tabs").input_ids[1:]
    detok = IncrementalDetokenizer(fast, SamplingParams())
    pieces = []
    for t in ids:
        detok.append([t])
        pieces.append(detok.release(False))
    pieces.append(detok.release(True))
    assert "".join(pieces) == hf.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_found_and_held_back(tokenizers):
    fast, hf = tokenizers
    ids = hf("alpha beta gamma delta").input_ids[1:]
    params = SamplingParams(stop=["a gam"])
    detok = IncrementalDetokenizer(fast, params)
    released, stop = "", None
    for t in ids:
        stop = detok.append([t])
        released += detok.release(stop is not None)
        if stop:
            break
    assert stop == "a gam" and released == "alpha bet"


def test_output_processor_turns_a_stop_string_into_an_engine_abort(tokenizers):
    fast, hf = tokenizers
    ids = hf("x = 1\ny = 2\n").input_ids[1:]
    op = OutputProcessor(fast)
    collector = op.add_request("eng-1", "ext-1", 3, SamplingParams(stop=["y ="]))
    to_abort = []
    for t in ids:
        to_abort += op.process_outputs([EngineCoreOutput("eng-1", [t])])
        if to_abort:
            break
    assert to_abort == ["eng-1"] and "eng-1" not in op.request_states
    out = collector.get_nowait()
    assert out.text == "x = 1\n" and out.finish_reason == "stop" and out.stop_reason == "y ="
    # A late engine output for the aborted request is ignored.
    assert op.process_outputs([EngineCoreOutput("eng-1", [5], FinishReason.ABORT)]) == []
