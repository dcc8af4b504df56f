"""`vericache-hf serve` as its users meet it: a real server process on loopback, driven by the `openai` client.

The model is a tiny random Llama saved to a temporary folder (float64, so that a verify pass over many positions
and stock generate's one position at a time agree to the last bit), with the embedded model's tokenizer and chat
template. Every answer is compared with stock `model.generate` on the same prompt, run here on the full cache.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from vericache_tools.embedded import embedded_model_dir
from vericache_tools.redis_server import free_port

openai = pytest.importorskip("openai", reason="the serve extra: pip install 'vericache-hf[serve]'")
psutil = pytest.importorskip("psutil")

READY_TIMEOUT_S = 180
# Draft on every round (a cost-aware schedule may choose plain steps on a CPU), and store prefixes in small chunks
SERVER_CONFIG = {"draft_schedule": "fixed", "draft_length": 6, "prefix_chunk_tokens": 32}
REUSED = re.compile(r"Prefix store: (\d+) prompt tokens reused")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # long greedy runs that a draft can follow
    model.generation_config.do_sample = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """Stock `generate` on the full cache: the answer every server answer must equal."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def answer(max_tokens: int, messages: list[dict] | None = None, prompt: str | None = None) -> str:
        if messages is not None:
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[-1] :], skip_special_tokens=True)

    return answer


class Server:
    """`vericache-hf serve` in a process of its own, on a free loopback port, its log in a file."""

    def __init__(self, model_dir: Path, log: Path, *options: str) -> None:
        self.port, self.log = free_port(), log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "vericache_tools.cli", "serve", str(model_dir)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", *options]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()
        self.children = psutil.Process(self.process.pid).children(recursive=True)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"the server exited with {self.process.returncode}:\n{self.log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        pytest.fail(f"the server was not ready within {READY_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def reused_tokens(self) -> list[int]:
        return [int(match) for match in REUSED.findall(self.log.read_text())]

    def chat(self, messages: list[dict], max_tokens: int, stream: bool = False, **settings) -> str:
        extra = {"generation_config": json.dumps(settings)} if settings else None
        response = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, stream=stream, extra_body=extra
        )
        if not stream:
            return response.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)

    def stop(self) -> int:
        """Ctrl+C, as a user stops it; its exit status once it and every process it started are gone."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                for process in [*self.children, self.process]:
                    if process.is_running():
                        process.kill()
                self.process.wait()
                pytest.fail(f"the server did not stop within 60 s:\n{self.log.read_text()[-4000:]}")
        return self.process.returncode

    def leftovers(self) -> list:
        gone, alive = psutil.wait_procs(self.children, timeout=10)
        return alive


@pytest.fixture(scope="module")
def redis(request):
    return request.getfixturevalue("redis_url")


@pytest.fixture(scope="module")
def server(model_dir, redis, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    running = Server(
        model_dir,
        log,
        "--compressor",
        "streaming_llm",
        "--compression-ratio",
        "0.5",
        "--vericache-config",
        json.dumps(SERVER_CONFIG),
        "--prefix-store",
        redis,
    )
    yield running
    running.stop()
    for process in running.leftovers():
        process.kill()


def long_messages(seed: int, words: int = 120) -> list[dict]:
    text = " ".join(f"item{(seed * 7919 + i * 31) % 997}" for i in range(words))
    return [{"role": "user", "content": f"Continue this list: {text}"}]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_stock_generate(server, reference, stream):
    messages = long_messages(seed=1)
    assert server.chat(messages, max_tokens=40, stream=stream) == reference(40, messages=messages)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_stock_generate(server, reference, stream):
    prompt = "def fibonacci(n):\n" + "    # " + " ".join(f"step{i}" for i in range(150)) + "\n"
    response = server.client.completions.create(
        model=server.model, prompt=prompt, max_tokens=40, stream=stream
    )
    text = response.choices[0].text if not stream else "".join(chunk.choices[0].text for chunk in response)
    assert text == reference(40, prompt=prompt)


def test_a_request_overrides_or_turns_off_vericache(server, reference):
    messages = long_messages(seed=2)
    expected = reference(24, messages=messages)
    before = len(server.reused_tokens())  # one line per VeriCache request on this server (it has a store)
    assert (
        server.chat(messages, 24, vericache_config={"compressor": "knorm", "compression_ratio": 0.75})
        == expected
    )
    assert len(server.reused_tokens()) == before + 1
    assert server.chat(messages, 24, generation_mode=None) == expected
    assert len(server.reused_tokens()) == before + 1  # stock generate: no VeriCache request ran


def ask_at_once(
    server: Server, conversations: list, max_tokens: int, settings: list[dict] | None = None
) -> dict:
    """Every conversation sent at once from a thread of its own, odd ones streamed; the answers by index."""
    settings = settings or [{}] * len(conversations)
    answers: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(index: int) -> None:
        try:
            answers[index] = server.chat(
                conversations[index], max_tokens=max_tokens, stream=index % 2 == 1, **settings[index]
            )
        except BaseException as error:  # noqa: BLE001 - reported below, with the others
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    return answers


def test_eight_concurrent_clients(server, reference):
    conversations = [long_messages(seed=10 + i, words=40 + 10 * i) for i in range(8)]
    answers = ask_at_once(server, conversations, 16)
    assert answers == {i: reference(16, messages=conversations[i]) for i in range(8)}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"vericache_config": {"compresion_ratio": 0.5}}, "compresion_ratio"),
        ({"vericache_config": {"compression_ratio": 1.5}}, "compression_ratio"),
        ({"vericache_config": {"compressor": "no_such_method"}}, "no_such_method"),
        ({"draft_length": 4}, "draft_length"),
        ({"vericache_typo": 1}, "vericache_typo"),
        ({"generation_mode": "vericash"}, "vericash"),
        ({"vericache_config": {"prefix_store": "redis://elsewhere"}}, "prefix_store"),
    ],
)
def test_a_bad_setting_is_a_422_and_the_server_goes_on(server, reference, settings, named):
    messages = [{"role": "user", "content": "Say hello."}]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        server.chat(messages, max_tokens=4, **settings)
    assert named in refused.value.response.json()["detail"]
    assert server.chat(messages, max_tokens=4) == reference(4, messages=messages)


def leave_mid_stream(server: Server, messages: list[dict]) -> None:
    """Ask for far more tokens than the server could make in a test's time, and leave after three chunks."""
    stream = server.client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=30000, stream=True
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    stream.close()


def test_a_client_that_leaves_mid_stream_frees_its_request(server, reference):
    messages = long_messages(seed=3)
    # one generate at a time: only a freed request lets the next one in within the client timeout below
    leave_mid_stream(server, messages)
    quick = server.client.with_options(timeout=60)
    response = quick.chat.completions.create(model=server.model, messages=messages, max_tokens=8)
    assert response.choices[0].message.content == reference(8, messages=messages)


@pytest.fixture(scope="module")
def second_server(server, redis, model_dir, tmp_path_factory):
    """Another process with the first one's settings and Redis; started after the first has answered."""
    log = tmp_path_factory.mktemp("serve") / "second.log"
    options = ["--compressor", "streaming_llm", "--compression-ratio", "0.5"]
    running = Server(
        model_dir, log, *options, "--vericache-config", json.dumps(SERVER_CONFIG), "--prefix-store", redis
    )
    yield running
    running.stop()
    for process in running.leftovers():
        process.kill()


def test_a_second_server_reuses_the_first_ones_prefixes(server, redis, model_dir, reference, request):
    import redis as redis_client

    messages = long_messages(seed=4, words=200)
    expected = reference(16, messages=messages)
    assert (
        server.chat(messages, max_tokens=16) == expected
    )  # saves the prompt's chunks to Redis behind the answer
    assert server.reused_tokens()[-1] == 0
    assert redis_client.Redis.from_url(redis).dbsize() > 0

    second = request.getfixturevalue("second_server")
    assert second.chat(messages, max_tokens=16) == expected
    assert second.reused_tokens() and second.reused_tokens()[-1] >= SERVER_CONFIG["prefix_chunk_tokens"]


def test_the_server_stops_cleanly(second_server, reference):
    messages = long_messages(seed=5)
    assert second_server.chat(messages, max_tokens=12) == reference(12, messages=messages)
    assert second_server.children, "the model runs in a process of its own"
    # Ctrl+C: uvicorn shuts the app down (which stops the model's process), then exits as the signal asks
    assert second_server.stop() in (0, 128 + signal.SIGINT, -signal.SIGINT)
    assert "Application shutdown complete" in second_server.log.read_text()
    assert second_server.leftovers() == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{second_server.url}/health", timeout=2)


@pytest.fixture(scope="module")
def batching_server(model_dir, tmp_path_factory):
    """`--continuous-batching`: requests served together by a VeriCacheEngine in the model's process."""
    log = tmp_path_factory.mktemp("serve") / "batching.log"
    config = {"draft_schedule": "fixed", "draft_length": 6}
    options = [
        "--compressor",
        "streaming_llm",
        "--compression-ratio",
        "0.5",
        "--vericache-config",
        json.dumps(config),
    ]
    running = Server(model_dir, log, "--continuous-batching", *options)
    yield running
    running.stop()
    for process in running.leftovers():
        process.kill()


SHARED = re.compile(
    r"VeriCache engine: request \d+ ended; cohorts so far: (\d+) rounds, at most (\d+) rows a round"
)


def test_continuous_batching_serves_requests_together_in_the_engine(batching_server, reference):
    """Six clients at once, streamed and not, one turning VeriCache off and one setting its own compressor: every
    answer equals stock generate's, and the engine's cohorts decoded several requests in one pass."""
    conversations = [long_messages(seed=20 + i, words=40 + 12 * i) for i in range(6)]
    settings = [{}, {}, {"generation_mode": None}, {"vericache_config": {"compressor": "knorm"}}, {}, {}]
    answers = ask_at_once(batching_server, conversations, 24, settings)
    assert answers == {i: reference(24, messages=conversations[i]) for i in range(6)}
    ended = SHARED.findall(batching_server.log.read_text())
    assert len(ended) == 5  # the stock request ran beside the engine, not in it
    assert max(int(rows) for _, rows in ended) >= 2


def test_continuous_batching_cancels_a_request_whose_client_left(batching_server, reference):
    """The engine ends a request whose client left at its next round, instead of making its 30000 tokens."""
    messages = long_messages(seed=6)
    before = len(SHARED.findall(batching_server.log.read_text()))
    leave_mid_stream(batching_server, messages)
    assert batching_server.chat(messages, max_tokens=8) == reference(8, messages=messages)
    deadline = time.monotonic() + 60
    while len(SHARED.findall(batching_server.log.read_text())) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(SHARED.findall(batching_server.log.read_text())) == before + 2


def test_continuous_batching_refuses_the_paged_cache_options(model_dir, capsys):
    from vericache_tools.cli import main

    assert main(["serve", str(model_dir), "--continuous-batching", "--cb-num-blocks", "64"]) != 0
    refusal = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "--cb-num-blocks" in refusal and "VeriCacheEngine" in refusal
