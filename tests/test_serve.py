"""`onnx-offload serve` on the real model (SmolLM2-135M-Instruct), driven by OpenAI's own
Python client over 127.0.0.1: streaming and not, two clients at once, a client that goes
away mid-stream, and bad requests answered in OpenAI's error shape."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import CHILD_CWD, child_env

openai = pytest.importorskip("openai", reason="the server's tests use OpenAI's client (the [test] extra)")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (the [serve] extra)")
pytest.importorskip("starlette", reason="the server needs starlette (the [serve] extra)")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """The server on a free port of 127.0.0.1: (its base URL, the process); its output goes
    to a file, read for the line that names the port."""
    log = tmp_path_factory.mktemp("serve") / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "onnx_offload", "serve", smollm2, "--port", "0", "--model-id",
                                 MODEL, "--cpu"], stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=CHILD_CWD)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not start: {log.read_text()}")
            time.sleep(0.2)
        assert "decoding: greedy (the model's generation config sets no sampling)" in log.read_text()
        yield m.group(1), proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()  # Ctrl-C's signal (SIGTERM here) ends it cleanly
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=300)


def test_models_and_a_chat_completion_answer_as_openai_s_api_does(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the model's EOS ended it before max_tokens
    assert r.usage.prompt_tokens > 20 and 0 < r.usage.completion_tokens < 30
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert choice.message.content.startswith(short.choices[0].message.content)


def test_a_streamed_chat_gives_the_same_text_in_chunks(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole and len([c for c in chunks if c.choices[0].delta.content]) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_batch_a_list_of_prompts_and_cut_at_a_stop_string(client, smollm2):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    assert "5" in alone[1]
    cut = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, stop=["6"])
    assert cut.choices[0].text == alone[1].split("6")[0] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, stop=["6"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    # token ids, as OpenAI's API takes them: one prompt's, or a batch of them beside text
    assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1).usage.prompt_tokens == 2
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(smollm2, "tokenizer.json"))
    as_ids = [tok.encode(p).ids for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=[as_ids[0], prompts[1]], max_tokens=6, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    with pytest.raises(openai.BadRequestError, match=r"token ids must lie in \[0, 49152\)"):
        client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=1)


def test_two_clients_at_once_each_get_their_own_answer(server, client):
    questions = [QUESTION, [{"role": "user", "content": "What is the capital of Italy?"}]]
    alone = [client.chat.completions.create(model=MODEL, messages=q, max_tokens=20).choices[0].message.content
             for q in questions]
    got = [None, None]

    def ask(i, stream):
        c = openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model=MODEL, messages=questions[i], max_tokens=20, stream=stream)
        got[i] = "".join(x.choices[0].delta.content or "" for x in r) if stream else r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(0, True)), threading.Thread(target=ask, args=(1, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == alone


def test_a_client_that_disconnects_mid_stream_stops_its_generation(client):
    """A stream of up to 1500 tokens (minutes on two cores), dropped after its first chunks:
    the next request is answered in seconds, so the dropped one stopped."""
    long = [{"role": "user", "content": "Write a very long story about a dragon."}]
    stream = client.chat.completions.create(model=MODEL, messages=long, max_tokens=1500, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert time.perf_counter() - t0 < 60


def _post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("fields,param,needle", [
    (dict(temperature=5), "temperature", r"'temperature' must be in \[0.0, 2.0\]"),
    (dict(temperature="hot"), "temperature", "'temperature' must be a number"),
    (dict(max_tokens=0), "max_tokens", "'max_tokens' must be >= 1"),
    (dict(max_tokens=2.5), "max_tokens", "'max_tokens' must be an integer"),
    (dict(max_tokens=100000), "max_tokens", "context is 2048 tokens"),
    (dict(top_p=0), "top_p", r"'top_p' must be in \(0.0, 1.0\]"),
    (dict(n=2), "n", "'n' = 2 is not supported"),
    (dict(stop=[""]), "stop", "'stop' must be"),
    (dict(messages=[]), "messages", "'messages' is required"),
    (dict(messages=[{"role": "user", "content": 3}]), "messages[0].content", "must be a string"),
])
def test_bad_fields_get_openai_s_error_shape_and_status_400(client, fields, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, **fields})
    assert e.value.status_code == 400
    error = e.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.search(needle, error["message"]), error["message"]


def test_an_unknown_model_a_body_that_is_no_json_and_an_unknown_path(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    status, body = _post(server[0] + "/chat/completions", b"{not json", raw=True)
    assert status == 400 and body["error"]["message"] == "the request body is not JSON"
    status, body = _post(server[0] + "/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and "no such endpoint" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="'prompt' is required"):
        client.completions.create(model=MODEL, prompt=[])
    # JSON's escapes reach a lone surrogate, which no UTF-8 holds (OpenAI's client cannot send one)
    for path, field in (("/completions", '"prompt": ["ok", "\\udc00"]'),
                        ("/chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800"}]')):
        status, body = _post(server[0] + path, ('{"model": "%s", %s}' % (MODEL, field)).encode(), raw=True)
        assert status == 400 and "lone surrogate" in body["error"]["message"], body
        assert body["error"]["param"] == field.split('"')[1]
    status, body = _post(server[0] + "/completions", b"[" * 100000 + b"]" * 100000, raw=True)
    assert status == 400 and "nested too deep" in body["error"]["message"]
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices[0].message.content


def test_fields_sent_as_off_are_taken_and_a_stream_can_end_with_its_usage(client):
    """Clients spell out OpenAI's defaults (logprobs false, logit_bias {}, tools []):
    those ask for nothing the server does not do. stream_options.include_usage ends a
    stream with a chunk of no choices that carries the usage, as OpenAI's API does."""
    off = dict(logprobs=False, logit_bias={}, tools=[], top_logprobs=0, frequency_penalty=0.0, n=1)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, **off)
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    with pytest.raises(openai.BadRequestError, match="only allowed when 'stream' is true"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                       stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="'logprobs' = True is not supported"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, logprobs=True)


def test_a_port_in_use_is_named_with_what_to_do(server):
    port = server[0].split(":")[2].split("/")[0]
    out = subprocess.run([sys.executable, "-m", "onnx_offload", "serve", ".", "--port", port],
                         capture_output=True, text=True, timeout=120, env=child_env(), cwd=CHILD_CWD)
    assert out.returncode != 0
    assert f"127.0.0.1:{port} is in use (another server?): pass --port N" in out.stderr, out.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_the_server_stopped_while_it_streams_ends_the_stream_and_exits(smollm2, tmp_path, sig, ctrl_c):
    """Ctrl-C or SIGTERM while a reply of up to 1500 tokens (minutes on two cores)
    streams: the stream ends with an error event at the next step, and the server exits
    in seconds (status 0 on SIGTERM, 130 on Ctrl-C as every command), not once the reply
    is done."""
    import signal
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "onnx_offload", "serve", smollm2, "--port", "0", "--model-id",
                                 MODEL, "--cpu"], stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=CHILD_CWD)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        c = openai.OpenAI(base_url=m.group(1), api_key="unused", max_retries=0, timeout=300)
        long = [{"role": "user", "content": "Write a very long story about a dragon."}]
        stream = c.chat.completions.create(model=MODEL, messages=long, max_tokens=1500, stream=True)
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            for i, _ in enumerate(stream):
                if i == 3:
                    proc.send_signal(getattr(signal, sig))
        t0 = time.perf_counter()
        assert proc.wait(60) == (0 if sig == "SIGTERM" else 130), log.read_text()
        assert time.perf_counter() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()
