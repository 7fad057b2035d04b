"""Every `vllm serve` flag (vLLM 0.32) is accounted for: vllm_flags.py's table against vLLM's own
parser (tests/support/vllm_cli.py), the table in docs/serving.md, the parsing of vLLM's spellings,
and real `shoal serve` processes that log the no-effect reasons, honour the HTTP flags (root
path, CORS, X-Request-Id, TLS with a certificate openssl makes here, a chat template) and exit 2
naming a refused flag."""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from shoal.engine.entrypoints import vllm_flags
from shoal.engine.entrypoints.serve import load_chat_template
from shoal.engine.entrypoints.serve_flags import build_parser, human_int_or_auto
from support.servers import MODEL_NAME, ServeProcess
from support.vllm_cli import ensure_vllm_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _shoal_options() -> dict[str, argparse.Action]:
    return build_parser()._option_string_actions


@pytest.mark.process
@pytest.mark.timeout(1800)  # a cold cache builds vLLM's environment first (minutes)
def test_every_flag_of_vllm_serve_is_in_the_table_and_parses():
    ours, table = _shoal_options(), vllm_flags.table()
    theirs = [a for a in ensure_vllm_cli().serve_options() if a["options"]]
    assert len(theirs) > 250  # the parser was read, not an empty list
    missing = [a["options"] for a in theirs
               if a["dest"] != "help" and a["options"][0] not in table
               and not any(o in table for o in a["options"])]
    assert not missing, f"vLLM flags in none of the three lists (vllm_flags.py): {missing}"
    unparsed = sorted({o for a in theirs for o in a["options"]} - ours.keys())
    assert not unparsed, f"vLLM option strings `shoal serve` does not parse: {unparsed}"
    names = {o for a in theirs for o in a["options"]}
    stale = sorted(f.name for f in vllm_flags.FLAGS if f.name not in names)
    assert not stale, f"table flags vLLM 0.32 does not have: {stale}"


def test_honoured_flags_are_implemented_and_the_others_are_not():
    ours = _shoal_options()
    for flag in vllm_flags.table().values():
        generic = ours[flag.name].dest.startswith("vllm_")
        assert generic == (flag.kind != vllm_flags.HONOURED), flag


def test_docs_carry_the_generated_table():
    doc = DOC.read_text()
    assert vllm_flags.DOC_BEGIN in doc and vllm_flags.DOC_END in doc
    assert doc == vllm_flags.doc_with_table(doc), (
        "docs/serving.md's flag table differs from vllm_flags.py: run "
        "`python -m shoal.engine.entrypoints.vllm_flags docs/serving.md`")


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1k", 1000), ("25.6k", 25600), ("32K", 32768), ("1m", 10**6),
    ("2M", 2 * 2**20), ("-1", -1), ("auto", -1), (" 8k ", 8000)])
def test_max_model_len_as_vllm_parses_it(text, value):
    assert human_int_or_auto(text) == value


@pytest.mark.parametrize("text", ["1.5K", "32x", "k"])
def test_max_model_len_refuses_what_vllm_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int_or_auto(text)


def _check(*argv: str):
    return vllm_flags.check(build_parser().parse_args(["m", *argv]))


@pytest.mark.parametrize("argv,refused", [
    (["--enforce-eager", "--disable-log-requests", "--gpu-memory-utilization", "0.9"], None),
    (["--no-enable-lora", "-dp", "1", "--scheduling-policy", "fcfs", "--load-format", "auto"],
     None),
    (["-q", "awq"], "--quantization awq"),
    (["--lora-dtype", "float16"], "--lora-dtype float16"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["--speculative-config", "{}"], "--speculative-config {}"),
    (["--kv-offloading-size", "4"], "--kv-offloading-size 4"),
])
def test_refused_flags_are_named_and_off_values_accepted(argv, refused):
    _, problem = _check(*argv)
    if refused is None:
        assert problem is None
    else:
        assert problem.startswith(f"{refused} is not supported: ")


def test_no_effect_flags_say_why_once_each():
    notes, problem = _check("--enforce-eager", "--disable-log-requests")
    assert problem is None and notes == [
        f"--enforce-eager: accepted, no effect: {vllm_flags.EAGER}",
        f"--disable-log-requests: accepted, no effect: {vllm_flags.LOGGING}"]


def _startup_problem(*argv: str, config: dict | None = None):
    args = build_parser().parse_args(["m", *argv])
    return vllm_flags.startup_problem(args, config or {})


def test_kv_cache_dtype_and_trust_remote_code():
    assert _startup_problem("--kv-cache-dtype", "auto") is None
    assert _startup_problem("--kv-cache-dtype", "bfloat16", "--dtype", "bfloat16") is None
    assert _startup_problem("--kv-cache-dtype", "fp8").startswith("--kv-cache-dtype fp8 ")
    assert "--dtype bfloat16" in _startup_problem("--kv-cache-dtype", "bfloat16")
    assert _startup_problem("--trust-remote-code") is None
    remote = {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}
    assert _startup_problem("--trust-remote-code", config=remote).startswith(
        "--trust-remote-code: ")


def test_chat_template_is_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'from file' }}")
    assert load_chat_template(str(path)) == "{{ 'from file' }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith(
        "{% for")
    with pytest.raises(OSError):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ---- real servers ---------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


@pytest.mark.process
def test_vllm_command_line_starts_and_honours_its_http_flags(tiny_model, tmp_path):
    """A vLLM command line: --model as a flag, suffixed length, no-effect flags logged once,
    the HTTP flags honoured."""
    s = ServeProcess(f"--model={tiny_model}", tmp_path, "--max-model-len", "1k",
                     "--enforce-eager", "--disable-log-requests", "--gpu-memory-utilization",
                     "0.9", "--no-enable-chunked-prefill", "--dtype", "float",
                     "--kv-cache-dtype", "float32", "--root-path", "/proxy",
                     "--allowed-origins", '["https://app.example"]',
                     "--enable-request-id-headers", "--chat-template", TEMPLATE)
    try:
        s.wait_healthy()
        log = s.log()
        for note in (f"--enforce-eager: accepted, no effect: {vllm_flags.EAGER}",
                     "--gpu-memory-utilization 0.9: accepted, no effect: "):
            assert log.count(note) == 1, log
        r = httpx.get(f"{s.url}/v1/models", headers={"X-Request-Id": "abc"})  # proxy stripped
        assert r.json()["data"][0]["id"] == MODEL_NAME and r.headers["x-request-id"] == "abc"
        assert httpx.get(f"{s.url}/openapi.json").json()["servers"] == [{"url": "/proxy"}]
        assert len(httpx.get(f"{s.url}/health").headers["x-request-id"]) == 32
        pre = httpx.options(f"{s.url}/v1/models", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        body = {"model": MODEL_NAME, "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}]}
        chat = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json()
        r = httpx.post(f"{s.url}/tokenize", json={"model": MODEL_NAME, "messages":
                       body["messages"], "add_special_tokens": False}, timeout=30).json()
        assert r["count"] == chat["usage"]["prompt_tokens"]
        detok = httpx.post(f"{s.url}/detokenize", json={"model": MODEL_NAME,
                           "tokens": r["tokens"]}, timeout=30).json()
        assert detok["prompt"] == "[user] hi\n"  # the flag's template, not the model's
        assert "max_model_len 1000" in log
    finally:
        s.stop()


@pytest.mark.process
def test_vllm_engine_flags_are_honoured_by_a_real_server(tiny_model, tmp_path):
    """--scheduling-policy priority: a request's priority reaches the engine (not refused);
    --return-tokens-as-token-ids: logprob tokens are "token_id:{id}" unless the request says;
    --enable-prompt-tokens-details: usage says how many prompt tokens the prefix cache served."""
    s = ServeProcess(tiny_model, tmp_path, "--scheduling-policy", "priority",
                     "--return-tokens-as-token-ids", "--enable-prompt-tokens-details")
    try:
        s.wait_healthy()
        chat = {"model": MODEL_NAME, "max_tokens": 2, "priority": -5,
                "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "a",
                                                         "max_tokens": 2},
                       headers={"X-Vllm-Priority": "3"}, timeout=60)
        assert r.status_code == 200, r.text
        chat.update(logprobs=True, return_token_ids=True)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).json()
        tokens = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
        assert tokens == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
        r = httpx.post(f"{s.url}/v1/chat/completions", json={
            **chat, "return_tokens_as_token_ids": False}, timeout=60).json()
        assert not r["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
        prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks to reuse
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
        first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        again = httpx.post(f"{s.url}/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}, timeout=60)
        usage = [json.loads(line[6:])["usage"] for line in again.text.splitlines()
                 if line.startswith("data: {") and '"usage"' in line][-1]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
        scrape = httpx.get(f"{s.url}/metrics").text  # vLLM's HTTP metrics, vLLM's labels
        assert ('http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} '
                '3.0') in scrape, scrape[-3000:]
    finally:
        s.stop()


@pytest.mark.process
def test_tls_flags_serve_https(tiny_model, tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    s = ServeProcess(tiny_model, tmp_path, "--ssl-keyfile", str(key), "--ssl-certfile",
                     str(cert))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        url = s.url.replace("http://", "https://")

        def answering():
            assert s.proc.poll() is None, s.log()
            try:
                return httpx.get(f"{url}/health", verify=context, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        from support.wait import wait_for

        wait_for(answering, timeout=180, what="shoal serve over https")
        assert httpx.get(f"{url}/v1/models", verify=context).json()["data"][0]["id"] == MODEL_NAME
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{s.url}/health", timeout=5)  # plain http is not served
        # the start-up line may be written just after the first answer (found in CI)
        wait_for(lambda: "ready: https://127.0.0.1:" in s.log(), timeout=30,
                 what="the start-up line naming https")
    finally:
        s.stop()


@pytest.mark.process
@pytest.mark.parametrize("argv,named", [
    (["--quantization", "awq"], "--quantization awq is not supported: "),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported: "),
    (["--lora-dtype", "float16"], "--lora-dtype float16 is not supported: "),
    (["--trust-remote-code"], "--trust-remote-code: this model's config.json names remote code"),
])
def test_refused_flags_exit_2_naming_the_flag(tiny_model, tmp_path, argv, named):
    model = tiny_model
    if "--trust-remote-code" in argv:  # the project's model with remote code declared
        model = tmp_path / "remote"
        model.mkdir()
        for f in Path(tiny_model).iterdir():
            if f.name != "config.json":
                (model / f.name).symlink_to(f)
        config = json.loads((Path(tiny_model) / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
        (model / "config.json").write_text(json.dumps(config))
    s = ServeProcess(str(model), tmp_path, *argv)
    assert s.wait_exit(60) == 2
    message = json.loads(s.termination_log.read_text())
    assert message["cause"] == "config_error" and named in message["message"], message
    assert named in s.log()


@pytest.mark.parametrize("given,read", [
    (["--max_num_batched_tokens", "1024"], ["--max-num-batched-tokens", "1024"]),
    (["--served_model_name=a_b"], ["--served-model-name=a_b"]),  # the value keeps its "_"
    (["some_model", "-tp", "2"], ["some_model", "-tp", "2"]),
])
def test_option_names_take_underscores_as_vllm_does(given, read):
    from shoal.engine.entrypoints.serve_flags import dashed

    assert dashed(given) == read
    args = build_parser().parse_args(["/m", "--max_num_batched_tokens", "512"])
    assert args.max_num_batched_tokens == 512
