"""quantkit probe against real servers on 127.0.0.1, started and stopped inside the tests: transformers'
own `transformers serve` (source vs decode must be told apart), a loopback server whose logits come
from transformers' model classes (the logprobs path), and the bad-input failures (one line, exit 1)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from quantkit.conversion.pipeline import convert
from quantkit.probe.client import Endpoint, ProbeError
from quantkit.probe.compare import Observed, score, topk_kl, verdict
from quantkit.probe.pipeline import probe
from quantkit.probe.reference import Continuation

# Three prompts (a plain completion, two chats), 6 tokens: the shipped set's shape, small enough for the
# shared CPU, and short enough (prompt + max_tokens <= the tiny GLM's index_topk, 16) that DSA attends to
# every token: past index_topk the indexer's exact ties are broken however each implementation's top-k
# breaks them, so two correct forwards can part there (quantkit.probe.pipeline._dsa_warnings).
PROMPTS = {"name": "test", "max_tokens": 6, "top_logprobs": 5, "prompts": [
    {"id": "recall", "kind": "completion", "prompt": "ada has a fox . what does ada have ?"},
    {"id": "chat-cat", "kind": "chat", "messages": [{"role": "user", "content": "the quick cat chases the"}]},
    {"id": "chat-owl", "kind": "chat", "messages": [{"role": "user", "content": "the dark owl helps"}]}]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_glm):
    out, prompts = rtn_pair(tmp_path_factory.mktemp("probe"), PROMPTS)
    return out, prompts, tiny_glm


def rtn_pair(root, prompts: dict):
    """The tiny GLM converted with RTN under `root` and `prompts` written beside it: (output folder,
    prompt file). Shared with test_tools."""
    res = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False)
    (root / "prompts.json").write_text(json.dumps(prompts))
    return res.out, root / "prompts.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransformersServe:
    """`transformers serve` on 127.0.0.1, CPU, fp32, serving the model each request names (one server
    for every folder a test asks about: a start is a transformers import and a FastAPI app, the largest
    part of the test); stopped (its process group) on exit."""

    def __init__(self, tmp: Path, *folders: Path):
        self.folders, self.port = [str(f) for f in folders], _port()
        self.folder = self.folders[0] if self.folders else None  # the first: a one-model caller's
        env = dict(os.environ, HF_HUB_CACHE=str(tmp / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        (tmp / "hf").mkdir(exist_ok=True)
        exe = Path(sys.executable).with_name("transformers")
        self.log = open(tmp / f"serve-{self.port}.log", "w")
        self.proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                                      "--dtype", "float32"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        import httpx

        deadline = time.time() + 240
        waiting = list(self.folders)
        while waiting and time.time() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-2000:]
            try:  # each model loads with its first request
                if httpx.post(self.url + "/completions", json={"model": waiting[0], "prompt": "the", "max_tokens": 1},
                              timeout=60, trust_env=False).status_code == 200:
                    waiting.pop(0)
                    continue
            except httpx.TransportError:
                pass
            time.sleep(1)
        if waiting:
            raise AssertionError("transformers serve did not answer in 240 s: " + Path(self.log.name).read_text()[-2000:])
        return self

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=30)
        self.log.close()


def _fp32_copy(folder: Path, dst: Path) -> Path:
    """`folder` as a plain fp32 checkpoint: its weights dequantized by the oracle (tests/oracle.py:
    compressed-tensors' own INT4 unpacking, the 128x128 FP8 block formula), quantization_config dropped,
    tokenizer and generation config kept. transformers' CPU paths do not compute the stored checkpoints
    as the engines do: FP8 blocks are dequantized with a block inferred from the scale grid (wrong for
    the 160-row kv_a_proj_with_mqa: test_transformers_cpu_fp8_reads_partial_blocks_wrong below), and
    compressed-tensors FP8 layers fake-quantize activations (W8A8), which quantkit's weight-only
    candidates do not model; either moves greedy tokens on the tiny GLM as much as INT4 does."""
    from oracle import dequantized_state_dict
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (folder / name).is_file():
            (dst / name).write_bytes((folder / name).read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(dequantized_state_dict(folder), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _parting_prompts(out: Path, source: Path, tmp: Path, max_tokens: int = 4, want: int = 2) -> Path:
    """A prompt set on which quantkit's source and decode references part at the first generated token:
    held-out text windows (corpus seed 5000, never trained on) teacher-forced through both, cut where
    their greedy tokens differ (widest margin first), short enough to stay dense under DSA. Chosen on
    this machine with quantkit's forward; the servers that must then be told apart are transformers'."""
    from transformers import AutoTokenizer

    from quantkit.synthetic.tiny import corpus
    from quantkit.validation.forward import logits

    tok = AutoTokenizer.from_pretrained(str(out / "decode"))
    words, n = corpus(3000, seed=5000).split(), 16 - max_tokens
    windows = [words[i * n:(i + 1) * n] for i in range(256)]
    ids = torch.tensor([tok.encode(" ".join(w))[:n] for w in windows])  # (256, n)
    ls = torch.log_softmax(logits(source, ids, device="cpu").float(), -1)  # (256, n, V)
    ld = torch.log_softmax(logits(out / "decode", ids, device="cpu").float(), -1)
    a, b = ls.argmax(-1), ld.argmax(-1)
    parts = []
    for s, j in (a[:, 3:] != b[:, 3:]).nonzero().tolist():
        j += 3
        margin = min(ls[s, j, a[s, j]] - ls[s, j, b[s, j]], ld[s, j, b[s, j]] - ld[s, j, a[s, j]])
        text = " ".join(windows[s][:j + 1])
        if tok.encode(text) == ids[s, :j + 1].tolist():
            parts.append((float(margin), s, text))
    parts = sorted(parts, reverse=True)[:want]
    assert parts and parts[-1][0] > 1e-3, f"no prompt parts source from decode with a margin here: {parts}"
    prompts = [{"id": f"part-{s}", "kind": "completion", "prompt": text} for _, s, text in parts]
    prompts.append({"id": "chat-owl", "kind": "chat", "messages": [{"role": "user", "content": "the dark owl helps"}]})
    path = tmp / "parting.json"
    path.write_text(json.dumps({"name": "parting", "max_tokens": max_tokens, "top_logprobs": 5, "prompts": prompts}))
    return path


def test_transformers_serve_source_and_decode_are_told_apart(pair, tmp_path):
    """Dequantized copies served by `transformers serve` (greedy only): six prompts chosen to part source from
    decode/ at the first token give decode/ six decisive votes (p = 1/64) and it is named; for the source's
    copy the probe cannot tell: prefill/'s dequantized copy is the same weights (GLM's prefill/ holds the
    source's FP8 bytes), and it says so rather than naming one."""
    out, _, source = pair
    prompts = _parting_prompts(out, source, tmp_path, want=6)
    kw = dict(prompts=prompts, kv_cache_dtype="bf16", device="cpu", concurrency=2, numerics="weights")  # fp32 copies
    src, dec = _fp32_copy(source, tmp_path / "source"), _fp32_copy(out / "decode", tmp_path / "decode")
    with TransformersServe(tmp_path, src, dec) as srv:  # one server, the model by name in each request
        r_src = probe(srv.url, out, model=str(src), **kw).data
        r_dec = probe(srv.url, out, model=str(dec), **kw).data
    n = r_src["prompt_set"]["prompts"]
    assert not r_src["logprobs"] and not r_dec["logprobs"]  # transformers serve ignores `logprobs`
    v = r_src["verdict"]
    assert v["match"] is None and v["ties"] == ["prefill"] and v["line"].startswith("cannot tell"), v
    assert v["candidates"][0] == "source" and set(v["candidates"]) <= {"source", "cross_phase"}, v
    # told from decode/ (six votes); the hand-over's first token is prefill/'s, so it parts from the source only
    # where decode/ does so by its second token: too few prompts here, and the verdict leaves it in play
    assert next(c for c in v["contest"] if c["against"] == "decode")["p"] <= 0.05, v
    assert r_src["candidates"]["source"]["prompts_exact"] == n
    assert r_dec["verdict"]["match"] == "decode", r_dec["verdict"]
    assert r_dec["candidates"]["decode"]["prompts_exact"] == n
    assert r_src["candidates"]["decode"]["greedy_agree"] < 1 and r_dec["candidates"]["source"]["greedy_agree"] < 1
    assert not r_src["warnings"], r_src["warnings"]  # dense under DSA: no tie-breaking caveat


ALLOWED = {"decode": {"decode"}, "source": {"source", "prefill"}, "fp32 source": {"source"}}  # None (cannot tell) too


def test_transformers_serve_as_stored_is_named_or_cannot_tell(pair, tmp_path):
    """`transformers serve` (CPU, fp32) serving decode/ as stored, the source as stored (native FP8: dequantized
    on load with the block transformers infers from the scale grid) and an fp32 dequantized copy of the source:
    the default probe (candidates in every numerics) names decode/, source (or prefill/, its bytes on GLM) and
    source, or says it cannot tell; never another checkpoint. The served computations are the candidates'
    decode@engine, source@transformers and source@weights, and each of those follows its endpoint exactly."""
    out, _, source = pair
    prompts = _parting_prompts(out, source, tmp_path, want=6)
    copy = _fp32_copy(source, tmp_path / "source-fp32")
    served = {"decode": out / "decode", "source": source, "fp32 source": copy}
    with TransformersServe(tmp_path, *served.values()) as srv:
        got = {k: probe(srv.url, out, model=str(f), prompts=prompts, kv_cache_dtype="bf16", device="cpu", concurrency=2).data
               for k, f in served.items()}
    for k, d in got.items():
        v = d["verdict"]
        print(k, "->", v["line"])
        assert v["match"] in ALLOWED[k] or (v["match"] is None and set(v.get("candidates") or []) & ALLOWED[k]), (k, v)
    # the served computation is the candidate that follows the endpoint on every prompt (others may tie with it)
    for k, variant in (("decode", "decode@engine"), ("source", "source@transformers"), ("fp32 source", "source@weights")):
        c = got[k]["candidates"][variant]
        assert c["prompts_exact"] == c["prompts"], (k, c)
    # prefill/ holds the source's FP8 bytes: their dequantized copies are one computation, which no endpoint
    # can tell apart; the verdict says so rather than picking one
    assert "prefill" in got["fp32 source"]["verdict"]["ties"]
    for k, d in got.items():  # and the evidence never sides with a wrong checkpoint
        assert all(c["wins"] >= c["losses"] for c in d["verdict"]["contest"]), (k, d["verdict"]["contest"])


def test_transformers_cpu_fp8_reads_partial_blocks_wrong(tiny_glm):
    """What the probe's `transformers` numerics models: transformers (5.17) dequantizes FP8 on CPU with the
    block inferred from the scale grid (rows // grid rows), so the tiny GLM's 160-row kv_a_proj_with_mqa
    (grid 2 x 2) is read with 80-row blocks: rows 80-127 take the second block's scale. If this fails,
    transformers reads partial blocks right, and quantkit.model.numerics.transformers_cpu_dequantize must follow."""
    from oracle import dequantize_fp8_blocks
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    index = json.loads((tiny_glm / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tiny_glm / index[name]), framework="pt") as f:
        q, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    assert q.shape[0] == 160 and s.shape[0] == 2
    ours = dequantize_fp8_blocks(q, s)
    model = AutoModelForCausalLM.from_pretrained(tiny_glm, dtype=torch.float32)
    theirs = model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.detach().float()
    assert torch.equal(theirs[:80], ours[:80]) and torch.equal(theirs[128:], ours[128:])
    assert not torch.allclose(theirs[80:128], ours[80:128])
    # and the probe's `transformers` numerics computes that weight as transformers does, bit for bit
    from quantkit.model.numerics import transformers_cpu_dequantize

    assert torch.equal(transformers_cpu_dequantize(q, s), theirs)


# ---- (b) the logprobs path: a loopback server running transformers' own model classes -------------------
def _hf_model(folder: Path, as_stored: bool = False):
    """transformers' model of `folder`: `as_stored`, as compressed-tensors runs it (FP8 layers W8A8, INT4
    experts dequantized: quantkit's engine numerics), else on its dequantized weights (weights numerics)."""
    from compressed_tensors.quantization import disable_quantization
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, CompressedTensorsConfig

    # Kimi keeps its kimi_k25 wrapper: transformers' Kimi_K25ForConditionalGeneration (tests/conversion/test_convert.py)
    auto = AutoModelForImageTextToText if json.loads((folder / "config.json").read_text())["model_type"] == "kimi_k25" \
        else AutoModelForCausalLM
    if as_stored:
        model = auto.from_pretrained(folder, dtype=torch.float32)
    else:
        model = auto.from_pretrained(folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
        model.apply(disable_quantization)  # as tests/conversion/test_convert.py: the dequantized INT4 weights, no fake-quant pass
    for p in model.parameters():
        p.data = p.data.float()
    return model.eval(), AutoTokenizer.from_pretrained(folder)


class Loopback:
    """A ThreadingHTTPServer on 127.0.0.1 (self.httpd), served from a thread while in `with`."""

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet request handler that answers JSON (the loopback servers' base)."""

    def log_message(self, *a):
        pass

    def _send(self, code: int, d: dict):
        b = json.dumps(d).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)


class LogprobServer(Loopback):
    """OpenAI-format /v1/completions and /v1/chat/completions with top_logprobs, greedy, from a transformers model."""

    def __init__(self, folder: Path, name: str = "tiny-decode", as_stored: bool = False):
        self.model, self.tok = _hf_model(folder, as_stored)
        self.name, self.requests = name, []
        self.lock = threading.Lock()
        outer = self

        class Handler(JSONHandler):
            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": outer.name, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(body)
                if body.get("model") != outer.name:
                    return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                with outer.lock:
                    self._send(200, outer.answer(body, self.path.endswith("/chat/completions")))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, body: dict, chat: bool) -> dict:
        if chat:
            ids = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = self.tok.encode(body["prompt"])
        k = body.get("top_logprobs") if chat else body.get("logprobs")
        out, tops = [], []
        with torch.no_grad():
            for _ in range(body["max_tokens"]):
                lp = torch.log_softmax(self.model(torch.tensor([ids + out])).logits[0, -1].float(), -1)
                tok = int(lp.argmax())
                if tok == 2:  # </s>
                    break
                v, i = lp.topk(k)
                tops.append({self.tok.decode([int(t)]): float(x) for x, t in zip(v, i)})
                out.append(tok)
        strs = [self.tok.decode([t]) for t in out]
        text = self.tok.decode(out)
        if chat:
            lps = {"content": [{"token": s, "logprob": tops[j][s], "top_logprobs": [{"token": a, "logprob": b} for a, b in tops[j].items()]}
                               for j, s in enumerate(strs)]}
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": {"tokens": strs, "top_logprobs": tops}, "finish_reason": "length"}
        return {"object": "chat.completion" if chat else "text_completion", "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}



def test_logprobs_path_names_decode_with_topk_kl(pair, tmp_path):
    out, prompts, _ = pair
    with LogprobServer(out / "decode") as srv:
        res = probe(srv.url, out, prompts=prompts, kv_cache_dtype="bf16", device="cpu", write_card=True, numerics="weights")
        sent = list(srv.requests)
    d = res.data
    assert d["logprobs"] and d["model"] == "tiny-decode"
    dec = d["candidates"]["decode"]
    assert d["verdict"]["match"] == "decode", d["verdict"]
    assert dec["prompts_exact"] == 3 and dec["kl_steps"] >= 12
    assert dec["topk_kl"] < 1e-3 and dec["topk_kl"] < d["candidates"]["source"]["topk_kl"]
    # nothing sent but the recorded prompts, greedy
    assert sorted(b.get("prompt") or b["messages"][0]["content"] for b in sent) == sorted(
        p.get("prompt") or p["messages"][0]["content"] for p in PROMPTS["prompts"])
    assert all(b["temperature"] == 0 and b["max_tokens"] == 6 for b in sent)
    card = (out / "decode" / "README.md").read_text()
    assert f"endpoint {srv.url} (model tiny-decode) probed on {d['date']}: consistent with decode/ INT4" in card
    assert "## Endpoint probes" in (out / "prefill" / "README.md").read_text()
    # validate rewrites both cards from its JSON; the probe's record is carried over
    from quantkit.validation.pipeline import validate

    validate(out, num_samples=2, seq_len=16, gen_tokens=2, device="cpu", progress=False)
    for which in ("prefill", "decode"):
        card = (out / which / "README.md").read_text()
        assert "## Precision per tensor class" in card, which
        assert f"endpoint {srv.url} (model tiny-decode) probed on {d['date']}: consistent with decode/ INT4" in card, which


def test_logprobs_path_names_decode_served_as_stored(pair):
    """transformers running decode/ as stored (compressed-tensors: FP8 layers W8A8) is named decode/, by its
    engine-numerics variant (the default computes every candidate in each numerics that computes it
    differently), with a top-k KL as small as the dequantized copy's under weight numerics; the weights
    variant of decode/ fits worse."""
    out, prompts, _ = pair
    with LogprobServer(out / "decode", as_stored=True) as srv:
        r = probe(srv.url, out, prompts=prompts, kv_cache_dtype="bf16", device="cpu")
    d = r.data
    print("\n".join(r.lines()))
    assert d["numerics"]["mode"] == "auto"
    assert d["verdict"]["match"] == "decode" and d["verdict"]["best_variant"] == "decode@engine", d["verdict"]
    assert set(d["groups"]["decode"]) == {"decode@engine", "decode@weights"}  # transformers computes it as engine does
    assert set(d["groups"]["source"]) == {"source@engine", "source@transformers", "source@weights"}
    dec = d["candidates"]["decode@engine"]
    assert dec["prompts_exact"] == 3 and dec["topk_kl"] < 1e-3 and dec["topk_kl"] < d["candidates"]["source@engine"]["topk_kl"]
    assert dec["topk_kl"] < d["candidates"]["decode@weights"]["topk_kl"]


def _kv_lora_64(dst: Path, tiny_glm: Path, rank: int = 64) -> Path:
    """The tiny GLM cut to kv_lora_rank 64: kv_a_proj_with_mqa keeps its first 64 latent rows and its rope
    rows, kv_a_layernorm its first 64 weights, kv_b_proj its first 64 input columns (FP8 blocks re-made
    for the new shapes: kv_b_proj [256, 64] is half a block wide, as GLM-5.2 would store it). Damaged as a
    model, but trained everywhere else, so its logits are peaked enough for greedy tokens to mean something."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quantkit.formats import fp8

    shutil.copytree(tiny_glm, dst)
    cfg = json.loads((dst / "config.json").read_text())
    old, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    (dst / "config.json").write_text(json.dumps(dict(cfg, kv_lora_rank=rank), indent=2))
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            meta, t = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - a safetensors handle
        cut = {k for k in t if k.endswith(("kv_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight"))}
        for k in cut:
            if k.endswith("kv_a_layernorm.weight"):
                t[k] = t[k][:rank].clone()
                continue
            w = fp8.dequantize(t[k], t[k + "_scale_inv"])
            w = w[:, :rank] if k.endswith("kv_b_proj.weight") else torch.cat([w[:rank], w[old:old + rope]])
            t[k], t[k + "_scale_inv"] = fp8.quantize(w)
        if cut:
            save_file({k: v.contiguous() for k, v in t.items()}, str(f), metadata=meta)
    return dst


def test_decode_of_a_kv_lora_64_model_runs_as_stored_and_is_named(pair, tmp_path, tiny_glm):
    """kv_lora_rank 64: convert stores kv_b_proj BF16 (tests/planner/test_precision.py), so transformers
    runs decode/ as stored, and the probe names it decode/, by its engine-numerics variant."""
    _, prompts, _ = pair
    out = convert(_kv_lora_64(tmp_path / "src", tiny_glm), tmp_path / "out", method="rtn", validate=False,
                  progress=False)
    assert out.report["decisions"]["model.layers.0.self_attn.kv_b_proj.weight"]["decode"] == "bf16"
    with LogprobServer(out.decode, as_stored=True) as srv:
        d = probe(srv.url, out.out, prompts=prompts, kv_cache_dtype="bf16", device="cpu").data
    assert d["verdict"]["match"] == "decode" and d["verdict"]["best_variant"] == "decode@engine", d["verdict"]
    dec = d["candidates"]["decode@engine"]
    assert dec["prompts_exact"] == 3 and dec["topk_kl"] < 1e-3 and dec["topk_kl"] < d["candidates"]["source@engine"]["topk_kl"]


def test_byte_identical_candidates_cannot_be_told(pair, tmp_path):
    """decode/ replaced by a copy of prefill/: decode, prefill and the hand-over are one computation (and, on
    GLM, the source's in engine numerics), so no endpoint can tell them apart; the probe says cannot tell."""
    out, prompts, _ = pair
    same = tmp_path / "same"
    shutil.copytree(out, same)
    shutil.rmtree(same / "decode")
    shutil.copytree(out / "prefill", same / "decode")
    with LogprobServer(same / "decode", as_stored=True) as srv:
        d = probe(srv.url, same, prompts=prompts, kv_cache_dtype="bf16", device="cpu").data
    v = d["verdict"]
    assert v["match"] is None and v["line"].startswith("cannot tell"), v
    assert {"prefill", "decode", "cross_phase"} <= set(v["candidates"]), v
    assert all(x["differ"] == 0 for x in d["power"]["pairs"] if {x["a"], x["b"]} <= {"prefill", "decode", "cross_phase"})


def _random_prompts(tmp: Path, seed: int, n: int = 8, words: int = 8, max_tokens: int = 6) -> Path:
    """`n` completion prompts of held-out text (corpus seed 6000 + seed: never trained on), short enough that
    prompt + max_tokens stays within the tiny GLM's index_topk (dense DSA)."""
    from quantkit.synthetic.tiny import corpus

    ws = corpus(n * words * 3, seed=6000 + seed).split()
    prompts = [{"id": f"s{seed}-{i}", "kind": "completion", "prompt": " ".join(ws[i * words:(i + 1) * words])} for i in range(n)]
    path = tmp / f"random-{seed}.json"
    path.write_text(json.dumps({"name": f"random-{seed}", "max_tokens": max_tokens, "top_logprobs": 5, "prompts": prompts}))
    return path


# what each served checkpoint may be named as (or listed among when the probe cannot tell): on GLM prefill/
# holds the source's FP8 bytes, so the two are one computation; on Kimi the source's attention is BF16
SERVED_TRUTH = {"glm": {"source": {"source", "prefill"}, "prefill": {"prefill", "source"}, "decode": {"decode"}},
                "kimi": {"source": {"source"}, "prefill": {"prefill"}, "decode": {"decode"}}}


def confusion(out: Path, source: Path, tmp: Path, seeds) -> dict:
    """{served: {verdict: count}} over prompt sets drawn with `seeds`, each checkpoint run by transformers'
    model classes as stored on this CPU (native FP8 dequantized on load with the block transformers infers;
    compressed-tensors FP8 W8A8, INT4 dequantized) behind the logprobs loopback server."""
    folders = {"source": source, "prefill": out / "prefill", "decode": out / "decode"}
    table: dict[str, dict[str, int]] = {k: {} for k in folders}
    for k, f in folders.items():
        with LogprobServer(f, as_stored=True) as srv:
            for seed in seeds:
                v = probe(srv.url, out, prompts=_random_prompts(tmp, seed), kv_cache_dtype="bf16", device="cpu").data["verdict"]
                name = v["match"] or "cannot tell: " + "|".join(sorted(v.get("candidates") or []))
                table[k][name] = table[k].get(name, 0) + 1
    return table


@pytest.fixture(scope="module")
def kimi_pair(tmp_path_factory, tiny_kimi):
    return convert("tiny:kimi-k2.6", tmp_path_factory.mktemp("probe-kimi") / "kimi", method="rtn", validate=False,
                   progress=False).out, tiny_kimi


@pytest.mark.parametrize("family", ["glm", "kimi"])
def test_probe_names_the_right_checkpoint_over_seeded_prompt_sets(family, pair, kimi_pair, tmp_path):
    """The probe's rate of naming the right checkpoint, where it names one, over prompt sets drawn with several
    seeds (QUANTKIT_PROBE_SEEDS=N for more: docs/serving.md's confusion matrix)."""
    out, source = (pair[0], pair[2]) if family == "glm" else kimi_pair
    seeds = range(int(os.environ.get("QUANTKIT_PROBE_SEEDS", "2")))
    table = confusion(out, source, tmp_path, seeds)
    print(f"\n{family} served -> verdicts:", json.dumps(table))
    truth = SERVED_TRUTH[family]
    named = sum(n for k, row in table.items() for v, n in row.items() if not v.startswith("cannot tell"))
    right = sum(n for k, row in table.items() for v, n in row.items() if v in truth[k])
    assert named and right >= 0.95 * named, table
    # where it cannot tell, the checkpoint served is among the ones it names as still in play
    assert all(truth[k] & set(v.split(": ")[1].split("|")) for k, row in table.items() for v in row if v.startswith("cannot tell")), table
    assert table["decode"].get("decode"), table  # decode/ is told from the rest on both families


# ---- the comparison, on numbers worked by hand ---------------------------------------------------------
def test_score_stops_at_first_divergence_and_kl_is_zero_for_proportional_topk():
    ref = [Continuation([5, 6, 7], False, [{5: -0.1, 9: -2.0}, {6: -0.2, 8: -3.0}, {7: -0.5}])]
    s = score([Observed([5, 6, 9], [{5: -1.1, 9: -3.0}, {6: -0.2, 8: -1.0}, {9: -0.1}])], ref)
    assert s["greedy_agree"] == pytest.approx(2 / 3) and s["first_divergence"] == [2] and s["prompts_exact"] == 0
    assert topk_kl({5: -1.1, 9: -3.0}, {5: -0.1, 9: -2.0}) == pytest.approx(0.0, abs=1e-12)  # same ratio
    assert topk_kl({6: -0.2, 8: -1.0}, {6: -0.2, 8: -3.0}) > 0.1
    v = verdict({"a": {"greedy_agree": 0.5, "topk_kl": None}, "b": {"greedy_agree": 0.4, "topk_kl": None}},
                {"a": "A", "b": "B"}, min_agree=0.9)
    assert v["match"] is None and v["line"].startswith("differs from every checkpoint quantkit made")


def test_verdict_names_only_on_separating_evidence():
    """Worked by hand: the sign test over decisive votes, ties for identical candidates, and the residual rule
    (an endpoint nearer neither candidate than they are to each other decides nothing by its logprobs)."""
    from quantkit.probe.compare import power, sign_p

    assert sign_p(5, 0) == 1 / 32 and sign_p(4, 0) == 1 / 16 and sign_p(0, 0) == 1.0
    a = [Continuation([1, 2], False, [{1: -0.1, 7: -2.5}, {2: -0.1, 8: -2.5}]) for _ in range(6)]
    b = [Continuation([1, 3], False, [{1: -0.1, 7: -2.5}, {3: -0.3, 2: -1.5}]) for _ in range(6)]
    same = [Continuation(list(c.tokens), False, [dict(x) for x in c.logprobs]) for c in a]
    conts, labels = {"A": a, "B": b, "C": same}, {"A": "A", "B": "B", "C": "C"}

    def judge(observed, keys=("A", "B")):
        sc = {k: score(observed, conts[k]) for k in keys}
        return verdict(sc, labels, 0.5, observed=observed, conts=conts, groups={k: [k] for k in keys})

    like_a = [Observed([1, 2], None)] * 6  # greedy only: six prompts side with A
    assert judge(like_a)["match"] == "A"
    assert judge(like_a[:4])["match"] is None  # four votes: p = 1/16, cannot tell
    v = judge(like_a, ("A", "B", "C"))
    assert v["match"] is None and v["line"].startswith("cannot tell which of") and set(v["candidates"]) == {"A", "C"}
    # logprobs: the endpoint at step 0 is as far from A as B is (residual >= half of A-B): its votes count for
    # nothing there, and the greedy votes alone decide
    far = [Observed([1, 2], [{1: -0.5, 7: -1.0}, {2: -0.1, 8: -2.5}])] * 3
    assert judge(far)["match"] is None
    pw = power(conts, {"A": ["A"], "B": ["B"], "C": ["C"]}, labels, 2)
    ab = next(x for x in pw["pairs"] if (x["a"], x["b"]) == ("A", "B"))
    assert ab["differ"] == 6 and ab["separable_greedy"] and pw["votes_needed"] == 5
    ac = next(x for x in pw["pairs"] if (x["a"], x["b"]) == ("A", "C"))
    assert ac["differ"] == 0 and ac["kl"] == 0 and not ac["separable"] and ac["tokens_for"] is None


# ---- (c) bad input: one line, non-zero exit ----------------------------------------------------------------
def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", "probe", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


class Canned(Loopback):
    """A loopback server answering every request with the same status and body."""

    def __init__(self, status: int, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _go(self):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _go

        self.hits = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"



def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_unreachable_url_is_one_line(pair):
    out, prompts, _ = pair
    r = _cli(f"http://127.0.0.1:{_port()}/v1", "--pair", out, "--prompts", prompts, "--retries", "1")
    _one_line_error(r, "cannot connect", "is the server running")


def test_server_without_the_model_is_one_line(pair):
    out, prompts, _ = pair
    body = json.dumps({"object": "list", "data": [{"id": "someone-else"}]}).encode()
    with Canned(200, body) as srv:
        r = _cli(srv.url, "--pair", out, "--prompts", prompts, "--model", "tiny-decode")
    _one_line_error(r, "does not serve model 'tiny-decode'", "someone-else", "--model")


def test_malformed_json_is_one_line(pair):
    out, prompts, _ = pair
    with Canned(200, b"{not json") as srv:
        r = _cli(srv.url, "--pair", out, "--prompts", prompts)
    _one_line_error(r, "malformed JSON", "not an OpenAI-compatible server")


def test_non_compatible_server_is_one_line(pair):
    out, prompts, _ = pair
    with Canned(404, b"<html>nothing here</html>") as srv:
        r = _cli(srv.url, "--pair", out, "--prompts", prompts)
    _one_line_error(r, "404", "not an OpenAI-compatible server")


def test_retries_429_with_backoff_then_one_line():
    with Canned(429, b'{"error": {"message": "slow down"}}') as srv:
        ep = Endpoint(srv.url, retries=2, backoff=0.05)
        t = time.time()
        with pytest.raises(ProbeError, match="429 slow down after 3 tries"):
            ep.models()
        assert time.time() - t >= 0.05 + 0.1


def test_api_key_comes_from_the_named_variable(monkeypatch):
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.headers.get("authorization"))
            b = b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("content-length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("MY_PROVIDER_KEY", "sk-test")
        assert Endpoint(f"http://127.0.0.1:{httpd.server_address[1]}", api_key_env="MY_PROVIDER_KEY").models() == ["m"]
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert seen == ["Bearer sk-test"]


def test_dsa_prompts_past_index_topk_are_warned():
    from types import SimpleNamespace

    from quantkit.probe.pipeline import _dsa_warnings
    from quantkit.probe.prompts import Prompt, PromptSet

    ps = PromptSet("t", "0" * 64, 6, 5, [Prompt("short", "completion", "a", [1] * 10), Prompt("long", "completion", "b", [1] * 11)])
    w = _dsa_warnings(SimpleNamespace(has_dsa=True, index_topk=16), ps)
    assert len(w) == 1 and w[0].startswith("prompts long:") and "index_topk (16)" in w[0]
    assert _dsa_warnings(SimpleNamespace(has_dsa=False, index_topk=0), ps) == []
