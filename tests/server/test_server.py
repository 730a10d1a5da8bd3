"""`webgpu-llm serve` end to end, with the official `openai` client (PyPI) and raw HTTP.

Starts the release binary on the default model (the GPU, or lavapipe where there is none) and
checks it against transformers' greedy outputs (../shared/golden/generations.json):
  - chat and text completions, streamed and whole, through `openai`, give the golden text;
  - `curl -N` shows the server-sent events;
  - 32 concurrent streams each give what the prompt gives alone (the golden greedy text);
  - a reader that stops reading is paused (not decoded) without holding up the others, then ended
    past --pause-timeout; one that disconnects is freed at once; the others' inter-token latency
    is printed before/after;
  - bad requests get OpenAI-style JSON errors (400/404/413/422), a full server 429 with
    Retry-After, and SIGTERM ends a running stream with a final event.
Usage: python tests/server/test_server.py  (scripts/test runs it in its virtual environment).
"""
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "target" / "release" / "webgpu-llm"
GOLDEN = Path(os.environ.get("GOLDEN_DIR", ROOT.parent / "shared" / "golden"))
CASES = {c["name"]: c for c in json.loads((GOLDEN / "generations.json").read_text())["cases"]}
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        self.log = open(ROOT / "target" / f"serve-test-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [str(BINARY), "serve", "--port", str(self.port), *args], stdout=self.log, stderr=self.log, env=env
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the server did not start in 120 s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def metrics(self):
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def expected(case, max_tokens):
    """What greedy decoding of `case` gives in `max_tokens` tokens, and its finish reason; or,
    when the golden text does not end within them, None and the full text to be a prefix of."""
    eos = case["first_eos_index"]
    if eos is not None and eos < max_tokens:
        return case["greedy_text_before_first_eos"], "stop"
    return None, "length"


def request_for(case, max_tokens, **extra):
    if case["kind"] == "chat":
        return "chat", dict(messages=case["messages"], max_tokens=max_tokens, temperature=0, **extra)
    return "completions", dict(prompt=case["prompt_text"], max_tokens=max_tokens, temperature=0, **extra)


class ServerTest(unittest.TestCase):
    server = None

    @classmethod
    def setUpClass(cls):
        # Room for 32 streams of the golden prompts; a small stream buffer so a reader that
        # stops reading is paused soon.
        cls.server = Server("--max-batch", "32", "--context-length", "8192", "--stream-buffer", "2",
                            "--send-buffer", "4096", "--prefill-chunk", "512", "--pause-timeout", "20")
        cls.client = openai.AsyncOpenAI(base_url=cls.server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def check(self, case, max_tokens, text, finish, tokens=None):
        whole, reason = expected(case, max_tokens)
        if whole is not None:
            self.assertEqual(text, whole, case["name"])
        else:
            self.assertTrue(case["greedy_text"].startswith(text) and text, f"{case['name']}: {text!r}")
            if tokens is not None:
                self.assertEqual(tokens, max_tokens, case["name"])
        self.assertEqual(finish, reason, case["name"])

    async def stream(self, case, max_tokens, times=None):
        kind, args = request_for(case, max_tokens)
        args["stream_options"] = {"include_usage": True}
        text, finish, tokens = "", None, None
        if kind == "chat":
            stream = await self.client.chat.completions.create(model=MODEL, stream=True, **args)
        else:
            stream = await self.client.completions.create(model=MODEL, stream=True, **args)
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                piece = choice.delta.content if kind == "chat" else choice.text
                if piece:
                    text += piece
                    if times is not None:
                        times.append(time.perf_counter())
                if choice.finish_reason:
                    finish = choice.finish_reason
        return text, finish, tokens

    def test_1_openai_client_streams_the_golden_greedy_text(self):
        # Every golden prompt at once: chat through chat.completions, raw through completions.
        names = list(CASES)
        max_tokens = {n: 16 for n in names}

        async def go():
            return await asyncio.gather(*(self.stream(CASES[n], max_tokens[n]) for n in names))

        for n, (text, finish, tokens) in zip(names, asyncio.run(go())):
            self.check(CASES[n], max_tokens[n], text, finish, tokens)

    def test_2_whole_responses_and_usage(self):
        chat = CASES["chat_capital_france"]
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        cached = self.server.metrics()["webgpu_llm_prompt_tokens_cached_total"]
        r = sync.chat.completions.create(model=MODEL, messages=chat["messages"], temperature=0, max_tokens=20)
        self.assertEqual(r.choices[0].message.content, chat["greedy_text_before_first_eos"])
        # Its prompt ran before (test 1): all but the block holding its last token came from the
        # prefix cache, and the text is still transformers' greedy text.
        reused = self.server.metrics()["webgpu_llm_prompt_tokens_cached_total"] - cached
        self.assertEqual(reused, (chat["n_prompt_tokens"] - 1) // 16 * 16)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.prompt_tokens, chat["n_prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, chat["first_eos_index"])
        raw = CASES["raw_capital_france"]
        r = sync.completions.create(model=MODEL, prompt=raw["prompt_text"], temperature=0, max_tokens=40)
        self.assertEqual(r.choices[0].text, raw["greedy_text_before_first_eos"])
        self.assertEqual(r.usage.prompt_tokens, raw["n_prompt_tokens"])
        models = sync.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])

    def test_2b_logprobs_match_transformers(self):
        # The chosen token's logprob and the top alternatives at the recorded steps, against
        # transformers' log-softmax (f16 KV cache on the GPU: within 0.1).
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        chat = CASES["chat_capital_france"]
        r = sync.chat.completions.create(model=MODEL, messages=chat["messages"], temperature=0, max_tokens=6,
                                         logprobs=True, top_logprobs=5)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 6)
        raw = CASES["raw_capital_france"]
        r2 = sync.completions.create(model=MODEL, prompt=raw["prompt_text"], temperature=0, max_tokens=6, logprobs=3)
        lp = r2.choices[0].logprobs
        self.assertEqual("".join(lp.tokens), r2.choices[0].text)
        for case, chosen, tops in [
            (chat, [c.logprob for c in content], [[t.logprob for t in c.top_logprobs] for c in content]),
            (raw, lp.token_logprobs, [sorted(t.values(), reverse=True) for t in lp.top_logprobs]),
        ]:
            for rec in case["top_logprobs"]:
                step = rec["step"]
                if step >= len(chosen):
                    continue
                self.assertLess(abs(chosen[step] - rec["logprobs"][0]), 0.1, f"{case['name']} step {step}")
                for got, want in zip(tops[step], rec["logprobs"]):
                    self.assertLess(abs(got - want), 0.1, f"{case['name']} step {step}: {tops[step]}")

    def test_3_curl_shows_the_events(self):
        raw = CASES["raw_capital_france"]
        body = json.dumps({"prompt": raw["prompt_text"], "temperature": 0, "max_tokens": 40, "stream": True})
        out = subprocess.run(
            ["curl", "-sN", self.server.url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout
        lines = [l for l in out.split("\n") if l]
        self.assertTrue(all(l.startswith("data: ") for l in lines), lines[:3])
        self.assertEqual(lines[-1], "data: [DONE]")
        chunks = [json.loads(l[6:]) for l in lines[:-1]]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), raw["greedy_text_before_first_eos"])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")

    def test_4_thirty_two_concurrent_streams_match_each_alone(self):
        names = [n for n in CASES for _ in range(4)]
        max_tokens = 6

        async def go():
            return await asyncio.gather(*(self.stream(CASES[n], max_tokens) for n in names))

        start = time.perf_counter()
        results = asyncio.run(go())
        secs = time.perf_counter() - start
        for n, (text, finish, tokens) in zip(names, results):
            self.check(CASES[n], max_tokens, text, finish, tokens)
        total = sum(r[2] for r in results)
        print(f"\n  32 concurrent streams: {total} tokens in {secs:.1f} s ({total / secs:.1f} tok/s aggregate)", file=sys.stderr)

    def test_5_a_stalled_reader_and_a_disconnect_do_not_hold_up_the_others(self):
        cases = [CASES[n] for n in ("chat_haiku_sea", "chat_gravity", "raw_once_upon", "raw_primes")]
        max_tokens = 12

        async def others(times):
            return await asyncio.gather(*(self.stream(c, max_tokens, times[i]) for i, c in enumerate(cases)))

        def gaps(times):
            return [b - a for t in times for a, b in zip(t, t[1:])]

        before = [[] for _ in cases]
        for c, (text, finish, tokens) in zip(cases, asyncio.run(others(before))):
            self.check(c, max_tokens, text, finish, tokens)

        # A reader that sends a long request and never reads (a tiny receive buffer, so the
        # server's side fills soon), and one that reads three events and hangs up.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", self.server.port))
        body = json.dumps({"prompt": "Once upon a time, there was a", "max_tokens": 2000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

        async def hang_up():
            async with httpx.AsyncClient(timeout=600) as h:
                async with h.stream("POST", self.server.url + "/v1/completions", json={
                    "prompt": "def fibonacci(n):", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            return

        asyncio.run(hang_up())
        # The stalled stream fills its buffers and is paused: it stops taking decode rows.
        deadline = time.time() + 300
        while self.server.metrics().get("webgpu_llm_paused_streams", 0) < 1:
            self.assertLess(time.time(), deadline, "the stalled stream was never paused")
            time.sleep(0.5)
        m = self.server.metrics()
        # The hung-up request is gone; only the stalled one runs.
        self.assertEqual(m["webgpu_llm_running_requests"], 1)
        generated = m["webgpu_llm_generated_tokens_total"]
        after = [[] for _ in cases]
        for c, (text, finish, tokens) in zip(cases, asyncio.run(others(after))):
            self.check(c, max_tokens, text, finish, tokens)
        m = self.server.metrics()
        # The stalled stream took no tokens while the others ran (4 × 12 tokens, not more): it
        # stayed paused, or (where the four outlast --pause-timeout, on a slow CPU adapter) it
        # was ended by the timeout, never resumed.
        self.assertEqual(m["webgpu_llm_generated_tokens_total"] - generated, sum(
            min(max_tokens, c["first_eos_index"] or max_tokens) + 0 for c in cases))
        p50 = lambda xs: statistics.median(xs) * 1e3
        print(f"\n  inter-token p50 of 4 streams: {p50(gaps(before)):.0f} ms alone, "
              f"{p50(gaps(after)):.0f} ms beside a stalled reader (one hung up)", file=sys.stderr)
        # A reader paused past --pause-timeout (20 s) has its request ended and its blocks freed,
        # its connection still open.
        deadline = time.time() + 120
        while self.server.metrics()["webgpu_llm_running_requests"] != 0:
            self.assertLess(time.time(), deadline, "the stalled request was not ended after the pause timeout")
            time.sleep(0.5)
        self.assertEqual(self.server.metrics()["webgpu_llm_paused_streams"], 0)
        stalled.close()

    def test_6_bad_requests_get_openai_errors(self):
        url = self.server.url
        status, _, body = post(url + "/v1/chat/completions", b"{not json")
        self.assertEqual(status, 400)
        self.assertEqual(body["error"]["code"], "invalid_json")
        status, _, body = post(url + "/v1/chat/completions", {"messages": "hello"})
        self.assertEqual(status, 422)
        self.assertEqual(set(body["error"]), {"message", "type", "param", "code"})
        status, _, body = post(url + "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
        self.assertEqual((status, body["error"]["code"]), (404, "model_not_found"))
        status, _, body = post(url + "/v1/completions", {"prompt": "hi", "temperature": -1})
        self.assertEqual((status, body["error"]["param"]), (400, "temperature"))
        status, _, body = post(url + "/v1/completions", {"prompt": "word " * 9000})
        self.assertEqual((status, body["error"]["code"]), (400, "context_length_exceeded"))
        status, _, body = post(url + "/v1/completions", {"prompt": "x" * (2 << 20)})
        self.assertEqual(status, 413)
        self.assertIn("error", body)
        status, _, body = post(url + "/v1/completions", {"prompt": "hi", "stop": ["x" * 2000]})
        self.assertEqual((status, body["error"]["param"]), (400, "stop"))
        status, _, body = post(url + "/v1/nothing", {})
        self.assertEqual(status, 404)
        with self.assertRaises(openai.BadRequestError):
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=7)


class CapacityTest(unittest.TestCase):
    def test_full_server_answers_429_and_sigterm_ends_streams(self):
        server = Server("--max-batch", "1", "--max-queue", "1")
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
            # One running, one waiting: the third is refused at once.
            streams = []
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", server.port))
                data = json.dumps(body).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                s.settimeout(120)
                streams.append(s)
                time.sleep(0.5)
            first = streams[0].recv(4096).decode()
            self.assertIn("200 OK", first)
            status, headers, err = post(server.url + "/v1/completions", {**body, "stream": False})
            self.assertEqual(status, 429)
            self.assertEqual(err["error"]["type"], "rate_limit_error")
            self.assertTrue(int(headers.get("retry-after") or headers.get("Retry-After")) >= 1)
            server.proc.send_signal(signal.SIGTERM)
            rest = first
            streams[0].settimeout(60)
            while True:
                chunk = streams[0].recv(65536).decode(errors="replace")
                if not chunk:
                    break
                rest += chunk
            self.assertIn("shutting_down", rest)
            self.assertEqual(server.proc.wait(timeout=60), 0)
            for s in streams:
                s.close()
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
