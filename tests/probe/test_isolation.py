"""`quantkit probe URL --isolation` against loopback servers on 127.0.0.1.

Two servers, both greedy over the tiny GLM's transformers model:
  - a correct one: transformers' own `transformers serve` (requests never see each other);
  - a leaky one: it batches requests that arrive together (within 50 ms) and, in half of the batches
    of two or more (seeded), computes one request on another request's context: the bug where a
    KV page or prefix-cache entry is handed to the wrong request.
Over 20 seeded runs each (the probe's defaults: 4 requests, 6 rounds), the probe must flag the leaky
server in at least 19 and stay quiet on the correct one in at least 19; the measured counts are the
ones quantkit.probe.isolation.MEASURED states.
"""

from __future__ import annotations

import json
import random
import threading
import time

import torch
from test_probe import JSONHandler, Loopback, TransformersServe

from quantkit.probe.isolation import cases, isolation_probe

SEEDS = range(20)


class LeakyServer(Loopback):
    """/v1/completions, greedy, from a transformers model; requests arriving together form a batch, and
    with probability `leak` a batch hands one request's context to another."""

    def __init__(self, folder, leak: float, seed: int, name: str = "tiny"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.leak, self.rng, self.name = leak, random.Random(seed), name
        self.pending: list[dict] = []
        self.cv = threading.Condition()
        self.leaks = 0
        outer = self

        class Handler(JSONHandler):
            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": outer.name, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self._send(200, outer.submit(body))

        from http.server import ThreadingHTTPServer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self._batcher, daemon=True).start()

    def submit(self, body: dict) -> dict:
        job = {"body": body, "context": body["prompt"], "done": threading.Event()}
        with self.cv:
            self.pending.append(job)
            self.cv.notify()
        job["done"].wait()
        return {"object": "text_completion", "model": self.name,
                "choices": [{"index": 0, "text": job["text"], "finish_reason": "length"}]}

    def _batcher(self):
        while True:
            with self.cv:
                while not self.pending:
                    self.cv.wait()
            time.sleep(0.05)  # requests arriving together share a batch (and its pages)
            with self.cv:
                batch, self.pending = self.pending, []
            if len(batch) > 1 and self.rng.random() < self.leak:  # the bookkeeping bug
                victim, source = self.rng.sample(batch, 2)
                victim["context"] = source["body"]["prompt"]
                self.leaks += 1
            for job in batch:
                job["text"] = self._greedy(job["context"], job["body"]["max_tokens"])
                job["done"].set()

    def _greedy(self, prompt: str, n: int) -> str:
        ids = self.tok.encode(prompt)
        out = []
        with torch.no_grad():
            for _ in range(n):
                tok = int(self.model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(tok)
        return self.tok.decode(out)


def test_canaries_are_distinct_words_every_tokenizer_has(tiny_glm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_glm)
    cs = cases(4, seed=0)
    assert len({c.canary for c in cs}) == 4 and len({c.prompt[: -len(c.canary)] for c in cs}) == 1
    assert tok.unk_token_id not in tok.encode(cs[0].prompt)  # plain words: the tiny vocabulary has them all


def test_leaky_server_is_flagged_in_at_least_19_of_20_seeded_runs(tiny_glm):
    flagged, example = 0, None
    for seed in SEEDS:
        with LeakyServer(tiny_glm, leak=0.5, seed=seed) as srv:
            res = isolation_probe(srv.url, seed=seed)
        flagged += not res.isolated
        example = example or (res.leaks[0] if res.leaks else None)
    assert flagged >= 19, flagged
    assert example and example["request"] != example["conditioned_on"]  # names both requests


def test_correct_server_stays_quiet_in_at_least_19_of_20_seeded_runs(tiny_glm, tmp_path):
    quiet = 0
    with TransformersServe(tmp_path, tiny_glm) as srv:
        for seed in SEEDS:
            res = isolation_probe(srv.url, model=str(tiny_glm), seed=seed)
            assert res.distinguishable_pairs >= 3, res.cases  # the test could see a leak here
            quiet += res.isolated
    assert quiet >= 19, quiet


def test_cli_exit_status(tiny_glm):
    import subprocess
    import sys

    with LeakyServer(tiny_glm, leak=1.0, seed=0) as srv:
        r = subprocess.run([sys.executable, "-m", "quantkit", "probe", srv.url, "--isolation", "--json"],
                           capture_output=True, text=True, check=False)
    assert r.returncode == 2, r.stderr
    d = json.loads(r.stdout)
    assert not d["isolated"] and d["leaks"] and "false alarms in 0 of 20" in d["measured_rates"]
