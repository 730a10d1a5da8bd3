"""`webgpu-llm serve` end to end, with the official `openai` client (PyPI) and raw HTTP.

Starts the release binary on the tiny committed model tests/data/arch/llama3/model.gguf (1 MB,
random F32 weights, a 512-token byte-level BPE with ChatML tokens and no chat template, so the
engine's built-in ChatML applies) on the GPU (lavapipe where there is none). The expected outputs
come from independent truths on the same file:
  - the crate's CPU reference (`webgpu-llm generate --backend cpu`, one prompt alone through
    `Engine::generate`, f32 KV cache) for every greedy text, finish reason and token count;
  - transformers' reference.json (tests/data/arch/llama3) for greedy ids and log-probabilities of
    token-id prompts;
  - a hand-written ChatML prompt for the chat template, and the GGUF's own vocabulary for token
    texts.
It checks:
  - chat and text completions, streamed and whole, through `openai`, give the CPU reference's
    text, finish reason and usage; /v1/models lists the model;
  - logprobs (completions' tokens/token_logprobs/top_logprobs, chat's content/top_logprobs)
    against transformers' log-softmax;
  - `curl -N` shows the server-sent events;
  - 32 concurrent streams each give what the prompt gives alone;
  - a reader that stops reading is paused (not decoded) without holding up the others, then ended
    past --pause-timeout; one that disconnects is freed at once; the others' inter-token latency
    is printed before/after;
  - bad requests get OpenAI-style JSON errors (400/404/413/422), a full server 429 with
    Retry-After, and SIGTERM ends the running and the waiting stream with a final event.
Usage: python tests/server/test_server.py  (scripts/test runs it in its virtual environment).
"""
import asyncio
import concurrent.futures
import json
import math
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "target" / "release" / "webgpu-llm"
MODEL_FILE = ROOT / "tests" / "data" / "arch" / "llama3" / "model.gguf"
REFERENCE = json.loads((MODEL_FILE.parent / "reference.json").read_text())
# The server names its model by the file's stem.
MODEL = MODEL_FILE.stem
# Tokens per streamed request: the tiny model decodes ~500x faster than SmolLM2, so each stream
# runs long enough that a wrong token anywhere in it shows.
MAX_TOKENS = 32
# Tokens per whole request: past the EOS of raw_haiku (44 tokens on the CPU reference).
WHOLE_TOKENS = 48
# GPU log-probabilities (f16 KV cache) against transformers' float32: 6e-3 at most seen on
# lavapipe. (SmolLM2's Q4_1 test allowed 0.1.)
LOGPROB_TOL = 0.03

# Prompts whose greedy paths have a top-1/top-2 logprob margin of at least 0.028 at every one of 48
# steps (the server's top_logprobs on lavapipe; over 4x the largest GPU error above, so the f16 KV
# cache flips no token); between them both finishes: EOS within MAX_TOKENS
# (chat_sky, chat_once), EOS only within WHOLE_TOKENS (raw_haiku) and none.
CASES = {
    "chat_sky": ("chat", "Why is the sky blue?"),
    "chat_once": ("chat", "Once upon a time, there was a"),
    "chat_capital": ("chat", "What is the capital of France?"),
    "chat_hi": ("chat", "hi"),
    "raw_primes": ("raw", "The first five prime numbers are"),
    "raw_count": ("raw", "Count to ten."),
    "raw_haiku": ("raw", "Write a haiku about the sea."),
    "raw_the": ("raw", "the"),
}


def chatml(text):
    """The ChatML prompt of one user message, written out by hand (no default system prompt)."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def cpu_reference(prompt, max_tokens, chat=False):
    """Starts the crate's CPU reference on `prompt` alone: greedy, EOS a stop, --json lines."""
    cmd = [str(BINARY), "generate", "--backend", "cpu", "--model", str(MODEL_FILE), "--prompt", prompt,
           "--temperature", "0", "--max-tokens", str(max_tokens), "--json", *(["--chat"] if chat else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def reference_result(proc):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(l) for l in out.decode().splitlines() if l]
    stats = lines[-1]["stats"]
    finish = {"Eos": "stop", "MaxTokens": "length"}[stats["stop_reason"]]
    ids = [l["id"] for l in lines[:-1]]
    assert len(ids) == stats["generated_tokens"]
    return dict(ids=ids, text="".join(l["text"] for l in lines[:-1]), finish=finish,
                prompt_tokens=stats["prompt_tokens"], completion_tokens=stats["generated_tokens"])


def gguf_vocabulary(path):
    """tokenizer.ggml.tokens of a GGUF, read from its header by hand (not through the crate)."""
    data = Path(path).read_bytes()
    assert data[:4] == b"GGUF"
    pos = 16
    (n_kv,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(t):
        nonlocal pos
        if t == 8:
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
            return data[pos - n:pos].decode()
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            return [value(et) for _ in range(n)]
        pos += sizes[t]
        return None

    for _ in range(n_kv):
        key = value(8)
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        v = value(t)
        if key == "tokenizer.ggml.tokens":
            return v
    raise KeyError("tokenizer.ggml.tokens")


def gpt2_byte_decoder():
    """GPT-2's byte-level BPE alphabet: the character each byte is written as, inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


VOCAB = gguf_vocabulary(MODEL_FILE)
BYTES = gpt2_byte_decoder()


def token_text(i):
    """One token's text as an API shows it alone: its bytes, invalid UTF-8 replaced."""
    t = VOCAB[i]
    if t.startswith("<|") and t.endswith("|>"):
        return t
    return bytes(BYTES[c] for c in t).decode("utf-8", "replace")


def log_softmax(xs):
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - z for x in xs]


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
            [str(BINARY), "serve", "--model", str(MODEL_FILE), "--port", str(self.port), *args],
            stdout=self.log, stderr=self.log, env=env,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.1)
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


def start_long_stream(server):
    """A 2000-token greedy stream on a raw socket (never read: it runs until closed), once the
    server says it is running."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                       "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.time() + 60
    while server.metrics()["webgpu_llm_running_requests"] != 1:
        assert time.time() < deadline, "the long stream never started"
        time.sleep(0.01)
    return sock


def request_for(name, max_tokens, **extra):
    kind, text = CASES[name]
    if kind == "chat":
        return "chat", dict(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
                            **extra)
    return "completions", dict(prompt=text, max_tokens=max_tokens, temperature=0, **extra)


class ServerTest(unittest.TestCase):
    server = None

    @classmethod
    def setUpClass(cls):
        # The CPU reference's answers, each prompt alone, before the server takes the adapter:
        # every case at MAX_TOKENS and WHOLE_TOKENS; each chat case also as its hand-written
        # ChatML text (raw), to check the template the CLI applies.
        procs = {}
        for name, (kind, text) in CASES.items():
            for n in (MAX_TOKENS, WHOLE_TOKENS):
                procs[name, n] = cpu_reference(text, n, chat=kind == "chat")
            if kind == "chat":
                procs[name, "chatml"] = cpu_reference(chatml(text), MAX_TOKENS)
        cls.expected = {k: reference_result(p) for k, p in procs.items()}
        # The model's whole context (2048 tokens, 128 KV blocks) for the streams (test_0 checks
        # the 32 of test 4 fit at once); a small stream buffer so a reader that stops reading is
        # paused soon. A pause timeout of 10 s: test 5 waits it out once; the four streams beside
        # the stalled reader take well under a second, and no reader of tests 1 and 4 lags so long.
        cls.server = Server("--max-batch", "32", "--context-length", "2048", "--stream-buffer", "2",
                            "--send-buffer", "4096", "--prefill-chunk", "512", "--pause-timeout", "10")
        cls.client = openai.AsyncOpenAI(base_url=cls.server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def check(self, name, max_tokens, text, finish, tokens=None):
        want = self.expected[name, max_tokens]
        self.assertEqual(text, want["text"], name)
        self.assertEqual(finish, want["finish"], name)
        if tokens is not None:
            self.assertEqual(tokens, want["completion_tokens"], name)

    async def stream(self, name, max_tokens, times=None):
        kind, args = request_for(name, max_tokens)
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

    def test_0_the_cases_mean_something(self):
        # The CLI's --chat is the hand-written ChatML prompt (the file has no template; its
        # vocabulary has <|im_start|>/<|im_end|>): same prompt tokens, same greedy ids.
        for name, (kind, _) in CASES.items():
            if kind == "chat":
                self.assertEqual(self.expected[name, "chatml"], self.expected[name, MAX_TOKENS], name)
        # Both endings within MAX_TOKENS, and a stop only WHOLE_TOKENS reaches; texts that differ.
        finishes = {n: self.expected[n, MAX_TOKENS]["finish"] for n in CASES}
        self.assertEqual({n for n, f in finishes.items() if f == "stop"}, {"chat_sky", "chat_once"})
        self.assertEqual(self.expected["raw_haiku", WHOLE_TOKENS]["finish"], "stop")
        self.assertEqual(len({self.expected[n, MAX_TOKENS]["text"] for n in CASES}), len(CASES))
        # Test 4's 32 streams fit the KV pool at once (each reserves its prompt and MAX_TOKENS, in
        # blocks of 16): none waits for another to end.
        blocks = sum(-(-(self.expected[n, MAX_TOKENS]["prompt_tokens"] + MAX_TOKENS) // 16) for n in CASES)
        self.assertLessEqual(4 * blocks, 2048 // 16)

    def test_1_openai_client_streams_the_cpu_reference_text(self):
        # Every prompt at once: chat through chat.completions, raw through completions.
        async def go():
            return await asyncio.gather(*(self.stream(n, MAX_TOKENS) for n in CASES))

        for n, (text, finish, tokens) in zip(CASES, asyncio.run(go())):
            self.check(n, MAX_TOKENS, text, finish, tokens)

    def test_2_whole_responses_and_usage(self):
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        cached = self.server.metrics()["webgpu_llm_prompt_tokens_cached_total"]
        want = self.expected["chat_sky", WHOLE_TOKENS]
        r = sync.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CASES["chat_sky"][1]}],
                                         temperature=0, max_tokens=WHOLE_TOKENS)
        self.assertEqual(r.choices[0].message.content, want["text"])
        # Its prompt ran before (test 1): all but the block holding its last token came from the
        # prefix cache, and the text is still the reference's.
        reused = self.server.metrics()["webgpu_llm_prompt_tokens_cached_total"] - cached
        self.assertEqual(reused, (want["prompt_tokens"] - 1) // 16 * 16)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.prompt_tokens, want["prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, want["completion_tokens"])
        self.assertEqual(r.usage.total_tokens, want["prompt_tokens"] + want["completion_tokens"])
        # The server's chat template is ChatML too: the hand-written prompt through completions
        # gives the same text and prompt tokens.
        r = sync.completions.create(model=MODEL, prompt=chatml(CASES["chat_sky"][1]), temperature=0,
                                    max_tokens=WHOLE_TOKENS)
        self.assertEqual((r.choices[0].text, r.usage.prompt_tokens), (want["text"], want["prompt_tokens"]))
        want = self.expected["raw_haiku", WHOLE_TOKENS]
        r = sync.completions.create(model=MODEL, prompt=CASES["raw_haiku"][1], temperature=0, max_tokens=WHOLE_TOKENS)
        self.assertEqual(r.choices[0].text, want["text"])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.prompt_tokens, want["prompt_tokens"])
        self.assertEqual(r.usage.completion_tokens, want["completion_tokens"])
        models = sync.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])

    def check_top(self, got, ref_ids, ref_logprobs, context):
        """`got` ({text: logprob}, at most 20) against transformers' 20 most likely tokens and
        their logprobs: the same tokens (one per text, the API's dict keeps one) with the same
        values, except a swap at the 20th place within the tolerance."""
        texts = [token_text(i) for i in ref_ids]
        unique = {t: lp for t, lp in zip(texts, ref_logprobs) if texts.count(t) == 1}
        last = ref_logprobs[-1]
        for t, lp in unique.items():
            if lp > last + LOGPROB_TOL:
                self.assertIn(t, got, f"{context}: {got}")
        for t, lp in got.items():
            self.assertLessEqual(lp, 0, context)
            if t in unique:
                self.assertLess(abs(lp - unique[t]), LOGPROB_TOL, f"{context}: {t!r}")
            elif t not in texts:
                self.assertLess(lp, last + LOGPROB_TOL, f"{context}: {t!r} is not in transformers' top 20")
        self.assertLessEqual(sum(math.exp(lp) for lp in got.values()), 1 + 1e-4, context)

    def test_2b_logprobs_match_transformers(self):
        # Token-id prompts of reference.json: 16 greedy tokens each (EOS ignored, as
        # transformers' generate ran); the chosen tokens are transformers' greedy ids, and at
        # every step the 20 most likely tokens and their logprobs are transformers' log-softmax
        # (at the first step of all of the logits; later, where only the 20 largest logits are
        # recorded, relative to the chosen token's).
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        for c, case in enumerate(REFERENCE["cases"]):
            r = sync.completions.create(model=MODEL, prompt=case["prompt_ids"], temperature=0, max_tokens=16,
                                        logprobs=20, extra_body={"ignore_eos": True})
            lp = r.choices[0].logprobs
            self.assertEqual(r.usage.prompt_tokens, len(case["prompt_ids"]))
            self.assertEqual(lp.tokens, [token_text(i) for i in case["greedy_ids"]], f"case {c}")
            self.assertEqual("".join(lp.tokens), r.choices[0].text)
            self.assertEqual(len(lp.token_logprobs), 16)
            full = log_softmax(case["logits_step0"])
            self.assertLess(abs(lp.token_logprobs[0] - full[case["greedy_ids"][0]]), LOGPROB_TOL)
            for step, top in enumerate(case["top20"]):
                self.assertEqual(top["ids"][0], case["greedy_ids"][step])
                if step == 0:
                    ref = [full[i] for i in top["ids"]]
                else:
                    ref = [l - top["logits"][0] + lp.token_logprobs[step] for l in top["logits"]]
                # The greedy token is the most likely (where its text is no other's, the entry's
                # value is its logprob; the API's dict keeps one value per text).
                chosen = lp.tokens[step]
                self.assertLessEqual(max(lp.top_logprobs[step].values()), lp.token_logprobs[step] + 1e-6)
                if [token_text(i) for i in top["ids"]].count(chosen) == 1:
                    self.assertLess(abs(lp.top_logprobs[step][chosen] - lp.token_logprobs[step]), 1e-6)
                self.check_top(lp.top_logprobs[step], top["ids"], ref, f"case {c} step {step}")
        # Every prefix of the 40-token prompt: its next token's distribution is the full
        # log-softmax of transformers' logits at that position.
        case = REFERENCE["cases"][2]

        async def prefixes():
            client = openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
            return await asyncio.gather(*(
                client.completions.create(model=MODEL, prompt=case["prompt_ids"][:i + 1], temperature=0, max_tokens=1,
                                          logprobs=20, extra_body={"ignore_eos": True})
                for i in range(len(case["prompt_ids"]))))

        for i, (r, logits) in enumerate(zip(asyncio.run(prefixes()), case["all_positions_logits"])):
            full = log_softmax(logits)
            order = sorted(range(len(full)), key=lambda j: -full[j])[:20]
            lp = r.choices[0].logprobs
            self.assertEqual(lp.tokens, [token_text(order[0])], f"position {i}")
            self.assertLess(abs(lp.token_logprobs[0] - full[order[0]]), LOGPROB_TOL, f"position {i}")
            self.check_top(lp.top_logprobs[0], order, [full[j] for j in order], f"position {i}")
        # Chat's shape: content entries with top_logprobs (as many as asked, most likely first,
        # the greedy token first), tokens = the CPU reference's greedy ids, values = those of the
        # same ChatML prompt through completions.
        want = self.expected["chat_capital", MAX_TOKENS]
        r = sync.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CASES["chat_capital"][1]}],
                                         temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5)
        content = r.choices[0].logprobs.content
        self.assertEqual([e.token for e in content], [token_text(i) for i in want["ids"]])
        r2 = sync.completions.create(model=MODEL, prompt=chatml(CASES["chat_capital"][1]), temperature=0,
                                     max_tokens=MAX_TOKENS, logprobs=5)
        for step, e in enumerate(content):
            tops = [t.logprob for t in e.top_logprobs]
            self.assertEqual(len(tops), 5)
            self.assertEqual(tops, sorted(tops, reverse=True))
            self.assertEqual((e.top_logprobs[0].token, tops[0]), (e.token, e.logprob))
            self.assertEqual(e.bytes, list(e.token.encode()))
            self.assertLessEqual(tops[0], 0)
            self.assertLessEqual(sum(math.exp(t) for t in tops), 1 + 1e-4)
            self.assertLess(abs(e.logprob - r2.choices[0].logprobs.token_logprobs[step]), LOGPROB_TOL, step)

    def test_2c_structured_output_validates(self):
        # response_format json_schema through the openai client: greedy and sampled answers of the
        # random-weight model are JSON the schema validates (Python's jsonschema); a regex (the
        # engine's extension, in extra_body) streams text the regex matches; a schema llguidance
        # refuses is a 400 naming response_format.
        import jsonschema
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        schema = {"type": "object",
                  "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                 "color": {"enum": ["red", "green", "blue"]}},
                  "required": ["name", "age", "color"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}}
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        hi = [{"role": "user", "content": CASES["chat_sky"][1]}]
        for temperature, seed in [(0, 0), (0.8, 1), (0.8, 2)]:
            r = sync.chat.completions.create(model=MODEL, messages=hi, temperature=temperature, seed=seed,
                                             max_tokens=120, response_format=fmt)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        text = ""
        for chunk in sync.chat.completions.create(model=MODEL, messages=hi, temperature=0.8, seed=3, max_tokens=60,
                                                  stream=True, extra_body={"regex": "(yes|no): [0-9]{1,3}"}):
            for c in chunk.choices:
                text += c.delta.content or ""
        self.assertRegex(text, r"^(yes|no): [0-9]{1,3}$")
        status, _, body = post(self.server.url + "/v1/chat/completions",
                               {"messages": hi, "response_format": {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "strin"}}}})
        self.assertEqual((status, body["error"]["param"]), (400, "response_format"), body)

    def test_2d_tool_calls(self):
        # tools through the openai client. tool_choice "required" (whole and streamed) and a named
        # function return calls whose arguments the function's schema validates (jsonschema),
        # finish_reason "tool_calls". The call and a role "tool" result go back: the model's
        # answer (tool_choice "auto", streamed, so text held back while it might be a call comes
        # out) is the CPU reference's on the prompt written by hand as the engine renders tools
        # for a template without them (this model's built-in ChatML): the functions in a system
        # turn, the call as a <tool_call> block, the result as a <tool_response> block.
        import jsonschema
        sync = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}}
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                                   "parameters": params}},
                 {"type": "function", "function": {"name": "get_time", "parameters": {
                     "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                     "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}]
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = sync.chat.completions.create(model=MODEL, messages=question, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=120)
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")
        calls = r.choices[0].message.tool_calls
        self.assertEqual(len(calls), 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
        self.assertTrue(calls[0].id)
        # Streamed, sampled, a named function: the call comes as delta.tool_calls.
        streamed, finish = {}, None
        for chunk in sync.chat.completions.create(
                model=MODEL, messages=question, tools=tools, temperature=0.8, seed=5, max_tokens=120, stream=True,
                tool_choice={"type": "function", "function": {"name": "get_time"}}):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    s = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                    s["name"] += d.function.name or ""
                    s["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
        self.assertEqual(finish, "tool_calls")
        self.assertEqual([s["name"] for s in streamed.values()], ["get_time"])
        jsonschema.validate(json.loads(streamed[0]["arguments"]), schemas["get_time"])

        # The call and its result go back.
        call = calls[0]
        result = '{"forecast": "sunny", "celsius": 21}'
        history = question + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}]
        text, finish = "", None
        for chunk in sync.chat.completions.create(model=MODEL, messages=history, tools=tools, temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                self.assertFalse(c.delta.tool_calls)
                finish = c.finish_reason or finish
        compact = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False)
        system = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
                  + "".join("\n" + compact(t) for t in tools)
                  + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}\n</tool_call>")
        call_text = compact({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
        prompt = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question[0]['content']}<|im_end|>\n"
                  f"<|im_start|>assistant\n<tool_call>\n{call_text}\n</tool_call><|im_end|>\n"
                  f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        want = reference_result(cpu_reference(prompt, MAX_TOKENS))
        self.assertEqual((text, finish), (want["text"], want["finish"]))
        # Refused by name: an unknown named function, tools on /v1/completions.
        status, _, body = post(self.server.url + "/v1/chat/completions", {
            "messages": question, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "rm"}}})
        self.assertEqual((status, body["error"]["param"]), (400, "tool_choice"), body)
        status, _, body = post(self.server.url + "/v1/completions", {"prompt": "x", "tools": tools})
        self.assertEqual((status, body["error"]["param"]), (400, "tools"), body)

    def test_3_curl_shows_the_events(self):
        want = self.expected["raw_haiku", WHOLE_TOKENS]
        body = json.dumps({"prompt": CASES["raw_haiku"][1], "temperature": 0, "max_tokens": WHOLE_TOKENS,
                           "stream": True})
        out = subprocess.run(
            ["curl", "-sN", self.server.url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout
        lines = [l for l in out.split("\n") if l]
        self.assertTrue(all(l.startswith("data: ") for l in lines), lines[:3])
        self.assertEqual(lines[-1], "data: [DONE]")
        chunks = [json.loads(l[6:]) for l in lines[:-1]]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), want["text"])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")

    def test_4_thirty_two_concurrent_streams_match_each_alone(self):
        names = [n for n in CASES for _ in range(4)]

        async def go():
            return await asyncio.gather(*(self.stream(n, MAX_TOKENS) for n in names))

        start = time.perf_counter()
        results = asyncio.run(go())
        secs = time.perf_counter() - start
        for n, (text, finish, tokens) in zip(names, results):
            self.check(n, MAX_TOKENS, text, finish, tokens)
        total = sum(r[2] for r in results)
        print(f"\n  32 concurrent streams: {total} tokens in {secs:.1f} s ({total / secs:.1f} tok/s aggregate)",
              file=sys.stderr)

    def test_5_a_stalled_reader_and_a_disconnect_do_not_hold_up_the_others(self):
        cases = ["chat_sky", "chat_capital", "raw_primes", "raw_count"]

        async def others(times):
            return await asyncio.gather(*(self.stream(c, MAX_TOKENS, times[i]) for i, c in enumerate(cases)))

        def gaps(times):
            return [b - a for t in times for a, b in zip(t, t[1:])]

        before = [[] for _ in cases]
        for c, (text, finish, tokens) in zip(cases, asyncio.run(others(before))):
            self.check(c, MAX_TOKENS, text, finish, tokens)

        # A reader that sends a long request and never reads (a tiny receive buffer, so the
        # server's side fills soon), and one that reads three events and hangs up.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", self.server.port))
        # Long enough to fill its buffers many times over (it is paused after about 60 tokens);
        # with the one that hangs up, within the pool (a request reserves its longest).
        body = json.dumps({"prompt": "Once upon a time, there was a", "max_tokens": 1000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

        async def hang_up():
            async with httpx.AsyncClient(timeout=600) as h:
                async with h.stream("POST", self.server.url + "/v1/completions", json={
                    "prompt": "def fibonacci(n):", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            return

        asyncio.run(hang_up())
        # The stalled stream fills its buffers and is paused: it stops taking decode rows. Its
        # channel can be full for a moment while the socket still has room (the connection's
        # writer task not yet run, on a busy machine), and then it runs on until the socket is
        # full too: wait until it has been paused with the token count unchanged for a second
        # (nothing else runs, so that count is the stalled stream's).
        deadline = time.time() + 60
        settled, last = None, None
        while True:
            m = self.server.metrics()
            now = time.time()
            self.assertLess(now, deadline, f"the stalled stream was never paused: {m}")
            count = m["webgpu_llm_generated_tokens_total"]
            if m.get("webgpu_llm_paused_streams", 0) < 1 or count != last:
                settled, last = None, count
            elif settled is None:
                settled = now
            elif now - settled >= 1.0:
                break
            time.sleep(0.05)
        # The hung-up request is gone; only the stalled one runs.
        self.assertEqual(m["webgpu_llm_running_requests"], 1)
        generated = m["webgpu_llm_generated_tokens_total"]
        after = [[] for _ in cases]
        for c, (text, finish, tokens) in zip(cases, asyncio.run(others(after))):
            self.check(c, MAX_TOKENS, text, finish, tokens)
        m = self.server.metrics()
        # The stalled stream took no tokens while the others ran (their own tokens, not more):
        # it stayed paused, or (where the four outlast --pause-timeout, on a slow CPU adapter) it
        # was ended by the timeout, never resumed.
        self.assertEqual(m["webgpu_llm_generated_tokens_total"] - generated,
                         sum(self.expected[c, MAX_TOKENS]["completion_tokens"] for c in cases))
        p50 = lambda xs: statistics.median(xs) * 1e3
        print(f"\n  inter-token p50 of 4 streams: {p50(gaps(before)):.1f} ms alone, "
              f"{p50(gaps(after)):.1f} ms beside a stalled reader (one hung up)", file=sys.stderr)
        # A reader paused past --pause-timeout (10 s) has its request ended and its blocks freed,
        # its connection still open.
        deadline = time.time() + 120
        while self.server.metrics()["webgpu_llm_running_requests"] != 0:
            self.assertLess(time.time(), deadline, "the stalled request was not ended after the pause timeout")
            time.sleep(0.1)
        self.assertEqual(self.server.metrics()["webgpu_llm_paused_streams"], 0)
        # Its stream ends with an error event that says why (code stream_ended), then [DONE].
        stalled.settimeout(30)
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = stalled.recv(65536)
            if not chunk:
                break
            seen += chunk
        self.assertIn(b'"code":"stream_ended"', seen)
        self.assertIn(b"data: [DONE]", seen)
        stalled.close()

    def test_5b_a_beam_search_runs_in_the_batch_beside_streams(self):
        """`beams` is a request of the batch: its hypotheses are the CLI's `--beams` on the CPU
        reference (ids and scores), while four greedy streams and a speculative one (prompt
        lookup) sent with it each give the CPU reference's tokens; a beam search whose client hangs up is ended (the server is then
        idle, every KV block free but the prefix cache's)."""
        url = self.server.url
        prompt, beams, tokens = "Once upon a time", 3, 8
        cmd = [str(BINARY), "generate", "--backend", "cpu", "--model", str(MODEL_FILE), "--prompt", prompt,
               "--beams", str(beams), "--max-tokens", str(tokens), "--ignore-eos", "--json"]
        want = json.loads(subprocess.run(cmd, capture_output=True, check=True, timeout=120).stdout)["beams"]
        names = ["raw_primes", "chat_capital", "raw_count", "chat_once"]
        refs = {n: reference_result(cpu_reference(CASES[n][1], MAX_TOKENS, CASES[n][0] == "chat")) for n in names}
        body = {"prompt": prompt, "beams": beams, "max_tokens": tokens, "ignore_eos": True}

        def text(n):
            kind, req = request_for(n, MAX_TOKENS)
            status, _, r = post(url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions"), req)
            self.assertEqual(status, 200, r)
            c = r["choices"][0]
            return c["message"]["content"] if kind == "chat" else c["text"]

        def speculative(n):
            kind, req = request_for(n, MAX_TOKENS, speculate="lookup", draft_tokens=3)
            status, _, r = post(url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions"), req)
            self.assertEqual(status, 200, r)
            c = r["choices"][0]
            return c["message"]["content"] if kind == "chat" else c["text"]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            search = pool.submit(post, url + "/v1/completions", body)
            streams = [pool.submit(text, n) for n in names]
            # Speculation by prompt lookup is a request of the batch too: greedy, its text is
            # the reference's.
            spec = pool.submit(speculative, "raw_count")
            status, _, got = search.result()
            self.assertEqual(status, 200, got)
            self.assertEqual(len(got["choices"]), beams)
            for choice, w in zip(got["choices"], want):
                self.assertEqual(choice["ids"], w["ids"])
                self.assertEqual(choice["text"], w["text"])
                self.assertAlmostEqual(choice["score"], w["score"], delta=1e-3)
            for n, f in zip(names, streams):
                self.assertEqual(f.result(), refs[n]["text"], n)
            self.assertEqual(spec.result(), refs["raw_count"]["text"], "speculative")
        # A client that hangs up on a long search (500 steps, 3 beams: 96 of the pool's 128
        # blocks; no hypothesis finishes before the last without a stop id): the search is ended,
        # never finished (a finished request adds its prompt tokens to the metrics; an ended one
        # does not), and the server goes idle.
        before = self.server.metrics()["webgpu_llm_prompt_tokens_total"]
        long = {"prompt": prompt, "beams": 3, "max_tokens": 500, "ignore_eos": True}
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=json.dumps(long).encode(),
                                                          headers={"Content-Type": "application/json"}), timeout=0.3)
        except (TimeoutError, urllib.error.URLError, socket.timeout):
            pass
        deadline = time.time() + 60
        while json.loads(urllib.request.urlopen(url + "/health").read())["running"] > 0:
            self.assertLess(time.time(), deadline, "the beam search of a client that hung up still runs")
            time.sleep(0.1)
        self.assertEqual(self.server.metrics()["webgpu_llm_prompt_tokens_total"], before,
                         "the beam search of a client that hung up ran to its end")

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
        # Nothing a client sends is silently ignored (the reliability probe's #6): a field the
        # server does not honour is a 400 naming it (src/openai.rs, which the package shares),
        # and null is "not given", as OpenAI's clients send it.
        hi = [{"role": "user", "content": "hi"}]
        for field, value in [("tools", []), ("tool_choice", "auto"),
                             ("echo", True), ("suffix", "x"), ("best_of", 2), ("frobnicate", 1)]:
            status, _, body = post(url + "/v1/chat/completions", {"messages": hi, "max_tokens": 1, field: value})
            self.assertEqual((status, body["error"]["param"]), (400, field), body)
            self.assertIn(field, body["error"]["message"])
        broken_call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]
        status, _, body = post(url + "/v1/chat/completions",
                               {"messages": [{"role": "assistant", "content": "", "tool_calls": broken_call}],
                                "max_tokens": 1})
        self.assertEqual((status, body["error"]["param"]), (400, "messages[0].tool_calls"), body)
        status, _, body = post(url + "/v1/chat/completions",
                               {"messages": hi, "max_tokens": 1, "stream": None, "tools": None, "user": "u"})
        self.assertEqual(status, 200, body)
        # logit_bias, OpenAI's semantics: +100 on a token makes greedy decoding repeat it; -100
        # on greedy's first token bans it; a key that is not a token id is a 400 naming it.
        plain = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        status, _, one = post(url + "/v1/completions", {**plain, "max_tokens": 1, "logit_bias": {"100": 100}})
        self.assertEqual(status, 200, one)
        status, _, four = post(url + "/v1/completions", {**plain, "logit_bias": {"100": 100}})
        self.assertEqual(four["choices"][0]["text"], one["choices"][0]["text"] * 4)
        first = reference_result(cpu_reference("Once upon a time", 1))["ids"][0]
        status, _, free = post(url + "/v1/completions", {**plain, "max_tokens": 1, "logprobs": 1})
        status, _, banned = post(url + "/v1/completions", {**plain, "max_tokens": 1, "logprobs": 1,
                                                            "logit_bias": {str(first): -100}})
        self.assertEqual(status, 200, banned)
        self.assertNotEqual(banned["choices"][0]["logprobs"]["tokens"][0], free["choices"][0]["logprobs"]["tokens"][0])
        status, _, body = post(url + "/v1/completions", {**plain, "logit_bias": {"x": 1}})
        self.assertEqual((status, body["error"]["param"]), (400, "logit_bias"), body)
        # Beam search: stop strings are refused (they are not applied to beams), a length
        # penalty whose scores would not be finite is refused, and a hypothesis that ran out of
        # tokens says "length".
        beam = {"prompt": "Once upon a time", "beams": 2, "max_tokens": 3, "ignore_eos": True}
        status, _, body = post(url + "/v1/completions", {**beam, "stop": "x"})
        self.assertEqual((status, body["error"]["param"]), (400, "stop"), body)
        for penalty in [1e308, -1e308, 51]:
            status, _, body = post(url + "/v1/completions", {**beam, "length_penalty": penalty})
            self.assertEqual((status, body["error"]["param"]), (400, "length penalty"), body)
        status, _, body = post(url + "/v1/completions", beam)
        self.assertEqual(status, 200, body)
        self.assertEqual([c["finish_reason"] for c in body["choices"]], ["length", "length"])
        # A method a route does not take: 405 with an OpenAI error body, counted in /metrics.
        before = self.server.metrics().get('webgpu_llm_requests_total{endpoint="other",status="405"}', 0)
        req = urllib.request.Request(url + "/v1/chat/completions", method="GET")
        with self.assertRaises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        self.assertEqual(caught.exception.code, 405)
        self.assertEqual(json.loads(caught.exception.read())["error"]["code"], "method_not_allowed")
        after = self.server.metrics()['webgpu_llm_requests_total{endpoint="other",status="405"}']
        self.assertEqual(after, before + 1)


class PoolTest(unittest.TestCase):
    def test_a_request_that_could_fill_the_pool_does_not_hold_up_the_next(self):
        """max_tokens is a bound, not a reservation (the reliability probe's #13): beside a
        stream that may grow to the whole 2048-token pool, a short request is served at once,
        while the long one still runs."""
        server = Server("--context-length", "2048")
        try:
            held = start_long_stream(server)
            start = time.time()
            status, _, body = post(server.url + "/v1/completions",
                                   {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
            self.assertEqual(status, 200, body)
            self.assertEqual(body["usage"]["completion_tokens"], 8)
            # The short request's last event can reach the client before the runtime retires it
            # (the gauge drops at the next round): wait for that, with the long stream running.
            deadline = time.time() + 5
            while server.metrics()["webgpu_llm_running_requests"] != 1 and time.time() < deadline:
                time.sleep(0.02)
            self.assertEqual(server.metrics()["webgpu_llm_running_requests"], 1, "the long stream still runs")
            print(f"\n  a short request beside one that may fill the pool: {(time.time() - start) * 1e3:.0f} ms",
                  file=sys.stderr)
            held.close()
        finally:
            server.stop()


BIG_PROMPT_SENDER = """
import asyncio, json, sys
import httpx
url = sys.argv[1]
body = json.dumps({"prompt": "word " * 180_000, "max_tokens": 1}).encode()

async def big(h):
    r = await h.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    return r.status_code, r.json()["error"]["code"]

async def main():
    async with httpx.AsyncClient(timeout=600) as h:
        return await asyncio.gather(*[big(h) for _ in range(20)])

sys.stdin.read()
print(json.dumps(asyncio.run(main())))
"""


class BigPromptTest(unittest.TestCase):
    def test_refused_big_prompts_do_not_stall_a_running_stream(self):
        """Twenty 900 KB prompts, too long for the context, are refused by their length in the
        HTTP handlers (400 context_length_exceeded, nothing tokenized on the engine thread)
        while a stream runs: the stream's longest gap between events while they are in flight
        stays short. (Only that window counts: the tiny random model's text holds back bytes
        that are not yet a whole character, so its events have gaps of their own elsewhere.)"""
        server = Server("--context-length", "2048")
        # The big prompts are sent from a process of their own: encoding and uploading 18 MB in
        # this one would hold the interpreter that times the stream, and its gaps would be ours.
        sender = subprocess.Popen([sys.executable, "-c", BIG_PROMPT_SENDER, server.url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            events = []

            async def stream():
                async with httpx.AsyncClient(timeout=600) as h:
                    async with h.stream("POST", server.url + "/v1/completions", json={
                            "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                events.append(time.perf_counter())

            async def main():
                task = asyncio.create_task(stream())
                while len(events) < 2 and not task.done():
                    await asyncio.sleep(0.01)
                go = time.perf_counter()
                sender.stdin.close()  # the stream runs: go
                out = await asyncio.get_running_loop().run_in_executor(None, sender.stdout.read)
                answered = time.perf_counter()
                await task
                return [tuple(x) for x in json.loads(out)], go, answered

            refused, go, answered = asyncio.run(main())
            self.assertEqual(refused, [(400, "context_length_exceeded")] * 20)
            self.assertGreater(len(events), 50)
            self.assertLess(answered, events[-1], "the refusals came while the stream ran")
            window = [b - a for a, b in zip(events, events[1:]) if b >= go and a <= answered]
            print(f"\n  20 refused 900 KB prompts answered in {(answered - go) * 1e3:.0f} ms; the stream's longest gap"
                  f" meanwhile {max(window) * 1e3:.0f} ms ({len(window)} gaps)", file=sys.stderr)
            self.assertLess(max(window), 2.0)
        finally:
            sender.kill()
            sender.stdout.close()
            server.stop()


class ProcessTest(unittest.TestCase):
    def test_a_taken_port_is_refused_before_loading_with_exit_code_2(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            start = time.time()
            out = subprocess.run([str(BINARY), "serve", "--model", str(MODEL_FILE), "--port", str(port)],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--host/--port", out.stderr.splitlines()[-1])
        self.assertNotIn("loading", out.stderr)
        self.assertLess(time.time() - start, 10)

    def test_shutdown_is_bounded_and_a_second_signal_exits_at_once(self):
        """A client holding a half-sent request keeps a graceful shutdown waiting: a second
        SIGTERM ends it at once, and --shutdown-timeout bounds it without one."""
        for timeout, second in [("60", True), ("2", False)]:
            server = Server("--shutdown-timeout", timeout)
            try:
                held = socket.create_connection(("127.0.0.1", server.port))
                held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
                time.sleep(0.3)
                server.proc.send_signal(signal.SIGTERM)
                start = time.time()
                if second:
                    time.sleep(1.5)
                    self.assertIsNone(server.proc.poll(), "the shutdown waits for the held connection")
                    server.proc.send_signal(signal.SIGTERM)
                server.proc.wait(timeout=20)
                self.assertLess(time.time() - start, 10 if second else 15)
                held.close()
            finally:
                server.stop()


class ConnectionTest(unittest.TestCase):
    def test_slow_and_idle_connections_are_closed_and_connections_are_capped(self):
        """A request head that never ends (slowloris) and a keep-alive connection left idle are
        closed after --header-timeout; a body that never ends is answered 408 after
        --body-timeout; past --max-connections a connection is answered 503 and closed, and
        once the idle ones are gone the server answers again."""
        server = Server("--header-timeout", "1", "--body-timeout", "1", "--max-connections", "4")

        def closed_within(sock, seconds):
            sock.settimeout(seconds + 10)
            start, data = time.time(), b""
            while chunk := sock.recv(4096):
                data += chunk
            return time.time() - start, data

        try:
            slow = socket.create_connection(("127.0.0.1", server.port))
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            took, _ = closed_within(slow, 1)
            slow.close()
            self.assertLess(took, 6, "a head that never ends is closed")
            body = socket.create_connection(("127.0.0.1", server.port))
            body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            body.settimeout(15)
            self.assertIn(b" 408 ", body.recv(4096))
            body.close()
            idle = socket.create_connection(("127.0.0.1", server.port))
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            took, data = closed_within(idle, 1)
            idle.close()
            self.assertIn(b"200 OK", data)
            self.assertLess(took, 6, "an idle keep-alive connection is closed")
            held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
            time.sleep(0.2)
            extra = socket.create_connection(("127.0.0.1", server.port))
            _, data = closed_within(extra, 1)
            extra.close()
            self.assertIn(b"503", data)
            self.assertIn(b"too_many_connections", data)
            for h in held:
                h.close()
            deadline = time.time() + 20
            while True:
                try:
                    urllib.request.urlopen(server.url + "/health", timeout=5).read()
                    break
                except (OSError, urllib.error.HTTPError):
                    self.assertLess(time.time(), deadline)
                    time.sleep(0.2)
            self.assertGreaterEqual(server.metrics()['webgpu_llm_requests_total{endpoint="connection",status="503"}'], 1)
        finally:
            server.stop()


class CapacityTest(unittest.TestCase):
    def test_full_server_answers_429_and_sigterm_ends_streams(self):
        server = Server("--max-batch", "1", "--max-queue", "1")
        try:
            # As long as the model's context (2048) allows: the stream still runs when SIGTERM
            # comes, on a fast GPU too.
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
            # One running, one waiting: the third is refused at once. Each stream is read as it
            # comes (a reader that keeps up is not paused).
            received = [[], []]
            readers = []
            for i in range(2):
                s = socket.create_connection(("127.0.0.1", server.port))
                data = json.dumps(body).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                s.settimeout(60)

                def read(s=s, into=received[i]):
                    while chunk := s.recv(65536):
                        into.append(chunk)

                readers.append((s, threading.Thread(target=read, daemon=True)))
                readers[-1][1].start()
                deadline = time.time() + 60
                while True:
                    m = server.metrics()
                    if (m["webgpu_llm_running_requests"], m["webgpu_llm_queue_depth"]) == (1, i):
                        break
                    self.assertLess(time.time(), deadline, m)
                    time.sleep(0.01)
            status, headers, err = post(server.url + "/v1/completions", {**body, "stream": False})
            self.assertEqual(status, 429)
            self.assertEqual(err["error"]["type"], "rate_limit_error")
            self.assertTrue(int(headers.get("retry-after") or headers.get("Retry-After")) >= 1)
            server.proc.send_signal(signal.SIGTERM)
            for s, t in readers:
                t.join(60)
                self.assertFalse(t.is_alive())
                s.close()
            running, waiting = (b"".join(r).decode(errors="replace") for r in received)
            self.assertIn("200 OK", running)
            self.assertIn('"text"', running)
            self.assertNotIn('"finish_reason":"length"', running)
            self.assertIn("shutting_down", running)
            self.assertIn("shutting_down", waiting)
            self.assertEqual(server.proc.wait(timeout=60), 0)
        finally:
            server.stop()


    def test_a_request_that_waits_past_the_queue_timeout_gets_503(self):
        """A request waiting for a place in the batch longer than --queue-timeout leaves the
        queue with 503 (code queue_timeout) while the one ahead of it runs on; the places at the
        door are given back (the next request is taken)."""
        server = Server("--max-batch", "1", "--max-queue", "1", "--queue-timeout", "1")
        try:
            running = start_long_stream(server)
            start = time.time()
            status, headers, body = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            waited = time.time() - start
            self.assertEqual((status, body["error"]["code"]), (503, "queue_timeout"), body)
            self.assertGreaterEqual(waited, 0.9)
            self.assertLess(waited, 30)
            self.assertEqual(server.metrics()["webgpu_llm_running_requests"], 1, "the running one goes on")
            running.close()
            # Its place and the running one's are given back: a request is taken again.
            deadline = time.time() + 60
            while True:
                status, _, body = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
                if status == 200:
                    break
                self.assertLess(time.time(), deadline, body)
                time.sleep(0.1)
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
