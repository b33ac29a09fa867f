"""serve-commands: every generated command parses with the pinned engine's own argument parser, and the
parsed values are the layout and the flags the pair needs.

The parsers are SGLang 0.5.23's `ServerArgs.add_cli_args`, vLLM 0.33.0's `make_arg_parser` and
sglang-router 0.3.2's `RouterArgs`, built from the release wheels (quantkit.serving.engines.cli_source,
fetched once; skipped offline with the reason). vLLM ships no prefill/decode router, so its router
line is a comment, not a command.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quantkit.serving.commands import check_commands, serve_commands
from quantkit.serving.layout import Layout

LAYOUTS = [Layout(1), Layout(8), Layout(8, 8), Layout(8, 8, True), Layout(4, 2)]


@pytest.fixture(scope="module")
def parsers():
    from quantkit.serving.engines import EngineUnavailable, cli_source

    try:
        return {e: cli_source(e) for e in ("sglang", "vllm", "sglang-router")}
    except EngineUnavailable as e:
        pytest.skip(f"engine parsers unavailable: {e}")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """GLM with MTP and KV scales (calibrated), Kimi with a tokenizer that needs its own code."""
    from quantkit.conversion.pipeline import convert

    root = tmp_path_factory.mktemp("cmds")
    glm = convert("tiny:glm-5.2", root / "glm", method="gptq", num_samples=4, seq_len=32, validate=False, progress=False)
    kimi = convert("tiny:kimi-k2.6", root / "kimi", method="rtn", validate=False, progress=False)
    return {"glm": glm.out, "kimi": kimi.out}


def _by_role(parsed):
    return {p["role"]: p for p in parsed}


@pytest.fixture(scope="module")
def parsed(pairs, parsers):
    """Every layout's commands for both engines, parsed in one process per parser."""
    cmds = {(e, lay): serve_commands(pairs["glm"], e, lay)[0] for e in ("sglang", "vllm") for lay in LAYOUTS}
    flat = [c for cs in cmds.values() for c in cs]
    results = iter(check_commands(flat, download=False))
    by_parser = {}
    for r in results:  # check_commands answers grouped by parser, in the order given within each group
        by_parser.setdefault(r["parser"].split()[0], []).append(r)
    out = {}
    for key, cs in cmds.items():
        out[key] = {c.role: by_parser[c.parser].pop(0) for c in cs if c.parser} | {"_commands": cs}
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.flags().replace(" ", ""))
def test_sglang_commands_parse_as_the_layout(parsed, layout):
    got = parsed["sglang", layout]
    for role in ("prefill", "decode", "router"):
        assert got[role]["ok"], (role, got[role]["error"])
    for role in ("prefill", "decode"):
        a = got[role]["args"]
        assert a["tp_size"] == str(layout.tp) and a["disaggregation_mode"] == role
        assert a["ep_size"] == str(layout.ep)
        assert a["attn_dp_size"] == (str(layout.tp) if layout.dp_attention else a["attn_dp_size"])
        assert a["kv_cache_dtype"] == "fp8_e4m3" and a["page_size"] == "64"  # the pair carries KV scales
        assert a["speculative_algorithm"] == "EAGLE" and a["model_path"] == "/models/tiny-glm-5.2"  # MTP, one path
    assert got["prefill"]["args"]["disaggregation_bootstrap_port"] == "8998"
    r = got["router"]["args"]
    assert r["pd_disaggregation"] == "True" and "8998" in r["prefill_urls"] and "DECODE_HOST" in r["decode_urls"]


@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=lambda lay: lay.flags().replace(" ", ""))
def test_vllm_commands_parse_as_the_layout(parsed, layout):
    got = parsed["vllm", layout]
    cmds = got["_commands"]
    assert cmds[2].parser == "" and "no prefill/decode router" in cmds[2].comment
    for role in ("prefill", "decode"):
        a = got[role]["args"]
        assert got[role]["ok"], got[role]["error"]
        assert a["tensor_parallel_size"] == ("1" if layout.dp_attention else str(layout.tp))
        assert a["data_parallel_size"] == (str(layout.tp) if layout.dp_attention else "1")
        assert a["enable_expert_parallel"] == str(layout.ep > 1)
        assert a["kv_cache_dtype"] == "fp8_e4m3" and a["block_size"] == "64"
        assert "kv_connector='NixlConnector'" in a["kv_transfer_config"]  # validated into KVTransferConfig
        assert json.loads(a["speculative_config"].replace("'", '"'))["method"] == "mtp"
        assert a["served_model_name"] == "['tiny-glm-5.2']"
    assert got["prefill"]["args"] == got["decode"]["args"] | {k: got["prefill"]["args"][k] for k in ("kv_transfer_config",)}


def test_pair_specific_flags(pairs, parsers):
    """Kimi: --trust-remote-code on both pools, no MTP; --no-mtp drops speculative decoding; a flag the
    parser does not know is refused by it (the check can fail)."""
    cmds, _ = serve_commands(pairs["kimi"], "sglang", Layout(8))
    got = _by_role(check_commands(cmds, download=False))
    assert got["decode"]["args"]["trust_remote_code"] == "True" and got["decode"]["args"]["speculative_algorithm"] == "None"
    cmds, _ = serve_commands(pairs["glm"], "vllm", Layout(8), mtp=False)
    assert _by_role(check_commands(cmds, download=False))["decode"]["args"]["speculative_config"] == "None"
    cmds[1].args.append("--disagregation-mode")  # a typo
    bad = _by_role(check_commands(cmds, download=False))["decode"]
    assert not bad["ok"] and "unrecognized arguments: --disagregation-mode" in bad["error"]


def test_cli_prints_checked_commands_and_refuses_a_broken_layout(pairs, parsers):
    run = [sys.executable, "-m", "quantkit", "serve-commands", str(pairs["glm"])]
    ok = subprocess.run(run + ["--tp", "1", "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("python -m sglang.launch_server") == 2 and "sglang_router.launch_router" in ok.stdout
    assert ok.stderr.count("parses") == 3
    bad = subprocess.run(run + ["--tp", "2", "--engine", "vllm"], capture_output=True, text=True, check=False)
    err = " ".join(bad.stderr.split())
    assert bad.returncode == 2 and "rule fp8-linear-block" in err and "a layout that works: --tp 2 --ep 2 --dp-attention" in err


def test_presets_give_the_shipped_pairs_commands(parsers):
    """From a preset: the pair convert would write. GLM-5.2 at TP 8 on H200 parses on all three parsers,
    with SGLang's shared-expert fusion turned off on the decode side only (256 experts, FP8 shared
    expert beside INT4 routed ones); Qwen3-30B-A3B at TP 8 is refused with EP 8 as the way out."""
    run = [sys.executable, "-m", "quantkit", "serve-commands"]
    glm = subprocess.run(run + ["glm-5.2", "--tp", "8", "--check"], capture_output=True, text=True, check=False)
    assert glm.returncode == 0 and glm.stderr.count("parses") == 3, glm.stderr
    prefill, decode = glm.stdout.split("# decode:")[0], glm.stdout.split("# decode:")[1].split("# router:")[0]
    assert "--disable-shared-experts-fusion" in decode and "--disable-shared-experts-fusion" not in prefill
    kimi = subprocess.run(run + ["kimi-k2.6", "--tp", "8", "--engine", "vllm", "--check"], capture_output=True,
                          text=True, check=False)
    assert kimi.returncode == 0 and kimi.stdout.count("--trust-remote-code") == 2, kimi.stderr
    qwen = subprocess.run(run + ["qwen3-30b-a3b", "--tp", "8", "--engine", "vllm"], capture_output=True, text=True,
                          check=False)
    assert qwen.returncode == 2 and "a layout that works: --tp 8 --ep 8" in " ".join(qwen.stderr.split())
