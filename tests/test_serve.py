"""``meshtron serve``: one server process on a tiny checkpoint answers /health and
/v1/completions with ``meshtron generate``'s greedy text, streams the same text as server-sent
events, refuses bad requests with 4xx and goes on, and batches 16 concurrent requests; a tp=2
server gives the one-process text; start-up problems (a port in use, no tokenizer, a layout the
model cannot split into, no web stack) are one line before any model loads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshtron.checkpoint.loading import open_for_inference
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.cli import main
from tests.parity import run_training, test_overrides

PROMPTS = ["def ", "import os\nclass A:", "x"]
NEW = 8
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def checkpoint(data_cache, tmp_path_factory) -> str:
    """A llama run (2 kv heads, so tp=2 splits them) trained 4 steps by one process."""
    run = str(tmp_path_factory.mktemp("serve") / "run")
    run_training(test_overrides(data_cache, run, steps=4) + ["--model.num_kv_heads=2"])
    return run


class Server:
    """``meshtron serve`` in a subprocess on a free port, stopped with Ctrl-C's signal."""

    def __init__(self, checkpoint: str, log: Path, *extra: str):
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
        env.setdefault("OMP_NUM_THREADS", "1")  # beside pytest on a small CPU: no oversubscribing
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshtron", "serve", "--checkpoint", checkpoint, "--port",
             "0", *extra], stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the one line once it serves (or EOF: it failed)
        assert "meshtron: serving" in line, log.read_text()
        self.url = line.split(" at ")[1].split()[0]

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60), self.log.read_text()


def request(url: str, body: dict | bytes | None = None) -> tuple[int, dict | str]:
    """(status, JSON body, or the raw text of a stream) of a GET, or of a POST of ``body``."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            text = response.read().decode()
            kind = response.headers["Content-Type"]
            return response.status, json.loads(text) if "json" in kind else text
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def complete(url: str, **body) -> dict:
    status, answer = request(f"{url}/v1/completions", body)
    assert status == 200, answer
    return answer


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = Server(checkpoint, tmp_path_factory.mktemp("serve-log") / "stderr.txt")
    yield server
    code, log = server.stop()
    assert code == 130 and log.strip().splitlines()[-1] == "meshtron: stopped by SIGINT (Ctrl-C)"


def generated(checkpoint: str, prompts: list[str], capsys) -> list[dict]:
    """What ``meshtron generate --json`` prints, greedily, for ``prompts`` (in this process)."""
    args = ["generate", "--checkpoint", checkpoint, "--temperature", "0", "--max-new-tokens",
            str(NEW), "--json", *[f"--prompt={p}" for p in prompts]]
    assert main(args) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def events(stream: str) -> list[dict | str]:
    """The data of each server-sent event (``data: ...`` then a blank line)."""
    assert stream.endswith("\n\n")
    blocks = stream[:-2].split("\n\n")
    assert all(block.startswith("data: ") for block in blocks), stream
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]


def test_health_and_models(server):
    status, health = request(f"{server.url}/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "run"
    assert health["waiting"] == 0 and isinstance(health["batches"], int)
    status, models = request(f"{server.url}/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["run"]


def test_greedy_completions_equal_generate(server, checkpoint, capsys):
    expected = generated(checkpoint, PROMPTS, capsys)
    answer = complete(server.url, prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert answer["object"] == "text_completion" and answer["model"] == "run"
    assert answer["id"].startswith("cmpl-") and isinstance(answer["created"], int)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [row["text"] for row in expected]
    assert [c["finish_reason"] for c in answer["choices"]] == [
        "length" if row["finish_reason"] == "length" else "stop" for row in expected]
    prompt_tokens = sum(len(open_for_inference(Path(checkpoint)).tokenizer.encode(p))
                        for p in PROMPTS)
    completion_tokens = sum(len(row["tokens"]) for row in expected)
    assert answer["usage"] == {"prompt_tokens": prompt_tokens,
                               "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}
    one = complete(server.url, prompt=PROMPTS[1], max_tokens=NEW, temperature=0)
    assert one["choices"][0]["text"] == expected[1]["text"]


def test_a_stream_sends_the_same_text_in_chunks_then_done(server):
    body = {"prompt": PROMPTS, "max_tokens": NEW, "temperature": 0}
    whole = [c["text"] for c in complete(server.url, **body)["choices"]]
    status, stream = request(f"{server.url}/v1/completions", {**body, "stream": True})
    assert status == 200
    chunks = events(stream)
    assert chunks[-1] == "[DONE]" and len(chunks) > len(PROMPTS) + 1
    texts, finishes = [""] * len(PROMPTS), [None] * len(PROMPTS)
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        assert finishes[choice["index"]] is None, "a chunk after the prompt's last"
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"]
    assert texts == whole and None not in finishes


def test_a_stop_string_cuts_the_text_whole_and_streamed(server):
    full = complete(server.url, prompt=PROMPTS[1], max_tokens=NEW, temperature=0)
    text = full["choices"][0]["text"]
    assert len(text) >= 4, text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    body = {"prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0, "stop": [stop, "\x00"]}
    cut = complete(server.url, **body)["choices"][0]
    assert cut == {"text": text[: text.find(stop)], "index": 0, "logprobs": None,
                   "finish_reason": "stop"}
    status, stream = request(f"{server.url}/v1/completions",
                             {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(stream)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-2]) == cut["text"]
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("body", "message"), [
    (b"{bad", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"max_tokens": 4}, "needs a prompt"),
    ({"prompt": [1, 2]}, "prompt must be a string or a non-empty list of strings"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be an integer >= 0, got -1"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "x", "temperature": -0.5}, "temperature must be >= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p must lie in (0, 1]"),
    ({"prompt": "x", "stop": [""]}, "stop must be a non-empty string"),
    ({"prompt": "x", "n": 2}, "n=2 is not supported"),
    ({"prompt": "x", "frobnicate": 1}, "unsupported field 'frobnicate'"),
    ({"prompt": "x " * 100}, "the model has 64 positions"),
    ({"prompt": ["x", "def "], "max_tokens": 63}, "prompt 2 takes 2 tokens and max_tokens is 63"),
])
def test_a_bad_request_is_a_4xx_with_a_message_and_the_server_goes_on(server, body, message):
    status, answer = request(f"{server.url}/v1/completions", body)
    assert status == 400 and message in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert complete(server.url, prompt="x", max_tokens=2)["choices"][0]["finish_reason"]


def test_16_concurrent_requests_all_complete_in_shared_batches(server, checkpoint, capsys):
    prompts = [f"def f{i}(x):\n    return" if i % 2 else f"import m{i}" for i in range(16)]
    expected = [row["text"] for row in generated(checkpoint, prompts, capsys)]
    before = request(f"{server.url}/health")[1]["batches"]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: complete(server.url, prompt=p, max_tokens=NEW,
                                                   temperature=0), prompts))
    assert [a["choices"][0]["text"] for a in answers] == expected
    batches = request(f"{server.url}/health")[1]["batches"] - before
    assert batches < len(prompts), "no two requests shared a batch"


@pytest.mark.slow
def test_a_tp2_server_gives_the_one_process_text(server, checkpoint, tmp_path):
    body = {"prompt": PROMPTS, "max_tokens": NEW, "temperature": 0}
    one = [c["text"] for c in complete(server.url, **body)["choices"]]
    tp2 = Server(checkpoint, tmp_path / "stderr.txt", "--nproc", "2", "--parallel.tp=2")
    try:
        assert [c["text"] for c in complete(tp2.url, **body)["choices"]] == one
    finally:
        code, log = tp2.stop()
    assert code == 130 and "meshtron: stopped by SIGINT" in log


def test_a_port_in_use_is_one_line_before_the_model_loads(checkpoint, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--checkpoint", checkpoint, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"meshtron: error: port {port} on 127.0.0.1 is in use (another server?): "
                   "stop it or choose another --port"), err  # no "checkpoint:": nothing loaded


@pytest.mark.parametrize(("args", "message"), [
    (["--parallel.tp=3"], "parallel.tp"),
    (["--nproc", "2"], "not 2 (set --nproc to tp x pp)"),
    (["--port", "70000"], "--port must be at most 65535"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
])
def test_a_bad_start_is_one_line(checkpoint, capsys, args, message):
    assert main(["serve", "--checkpoint", checkpoint, "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_checkpoint_without_tokenizer_is_refused(checkpoint, tmp_path, capsys):
    cfg, tensors = read_model_tensors(open_for_inference(Path(checkpoint)).path)
    write_model_checkpoint(tmp_path / "bare", cfg, tensors)
    assert main(["serve", "--checkpoint", str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no tokenizer.json" in err and len(err.splitlines()) == 1


def test_without_the_web_stack_serve_says_what_to_install(checkpoint, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an absent package imports as
    assert main(["serve", "--checkpoint", checkpoint]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install meshtron[serve]" in err and len(err.splitlines()) == 1
