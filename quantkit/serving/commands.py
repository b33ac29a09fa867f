"""Launch commands for a converted pair: the prefill pool, the decode pool and the router, for one
engine at one parallel layout, with the flags this pair needs.

What each flag is for (the pair decides, not the user's memory):
  - the same model path on both pools (`--mount`): vLLM's NIXL handshake hashes the model path with
    the dtype, KV dtype and attention backend, so both checkpoints are mounted at one path;
  - `--kv-cache-dtype fp8_e4m3` on both pools when the pair carries KV scales (pair.json's
    kv_scales): the decode pool reads the cache the prefill pool wrote, with the same dtype;
  - the same page size on both (SGLang `--page-size`, vLLM `--block-size`);
  - SGLang `--disable-shared-experts-fusion` on the decode side when check-serving says SGLang
    would fuse a shared expert stored differently from the routed experts;
  - speculative MTP identically on both sides when the checkpoint has an MTP layer (vLLM hashes the
    speculative config into the handshake);
  - `--trust-remote-code` where the family's tokenizer ships code (Kimi);
  - the layout (`--tp`, `--ep`, `--dp-attention`), checked first with check-serving's per-rank
    kernel rules (quantkit.serving.layout): a layout that breaks one is refused with one that works.

Each command is an argument list; `quantkit serve-commands` prints them, and the tests parse every
one with the pinned engine's own parser (quantkit.serving.cliparse).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import ConfigError
from quantkit.serving.layout import Layout

PROGRAM = {"sglang": ["python", "-m", "sglang.launch_server"], "vllm": ["vllm", "serve"],
           "sglang-router": ["python", "-m", "sglang_router.launch_router"]}
PAGE_SIZE = 64
BOOTSTRAP_PORT = 8998


@dataclass
class Command:
    role: str  # prefill | decode | router
    parser: str  # which parser takes `args`: sglang | vllm | sglang-router | "" (no parser: a comment)
    args: list[str]  # the arguments after the program
    comment: str = ""

    @property
    def argv(self) -> list[str]:
        return PROGRAM.get(self.parser, []) + self.args

    def text(self) -> str:
        head = f"# {self.role}: {self.comment}\n" if self.comment else f"# {self.role}\n"
        if not self.parser:
            return head.rstrip("\n")
        lines: list[list[str]] = [[]]
        for a in self.argv:  # one option (with its values) per line
            if a.startswith("--") and any(t.startswith("--") for t in lines[-1]):
                lines.append([])
            lines[-1].append(shlex.quote(a))
        return head + " \\\n  ".join(" ".join(line) for line in lines)


@dataclass
class PairFacts:
    """What the commands depend on, read from the convert output."""

    name: str
    kv_scales: bool
    mtp: int
    trust_remote_code: bool
    fusion_flag: bool
    notes: list[str] = field(default_factory=list)


def pair_facts(out: Path) -> PairFacts:
    from quantkit.model.families import family_of
    from quantkit.serving.checks import fusion_flag
    from quantkit.serving.stored import inventory, read_stored

    out = Path(out)
    if not all((out / w / "config.json").is_file() for w in ("prefill", "decode")):
        raise ConfigError(f"{out}: not a convert output (prefill/ and decode/ with config.json); serve-commands "
                          "launches a pair")
    decode = read_stored(out / "decode")
    report = _json(out / "convert-report.json")
    spec = ((report.get("source") or {}).get("spec") or out.name).removeprefix("hf://").split("@")[0]
    # the model cards' name (quantkit.validation.card.serving_section): tiny:glm-5.2 mounts at /models/tiny-glm-5.2
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in spec.rstrip("/").split("/")[-1].lower()) or "model"
    pair = _json(out / "pair.json")
    kv = bool((pair.get("counts") or {}).get("kv_scales")) if pair else any(
        n.endswith((".k_scale", ".v_scale")) for n in decode.tensors)
    fam = family_of(decode.config.get("model_type"))
    facts = PairFacts(name=name, kv_scales=kv, mtp=int(decode.text.get("num_nextn_predict_layers") or 0),
                      trust_remote_code=bool(getattr(fam, "trust_remote_code", False)),
                      fusion_flag=bool(fusion_flag("sglang", decode, inventory(decode, "sglang"), None)))
    if pair and not pair.get("holds"):
        facts.notes.append(f"pair.json: the pair's contract does not hold ({pair.get('first_difference')}): a KV "
                           "cache from the prefill pool is not what this decode checkpoint would write")
    return facts


def predicted_facts(config: dict, name: str, group_size: int) -> tuple[PairFacts, list]:
    """PairFacts of the pair `quantkit convert` would write for a config (a preset): KV scales (convert
    calibrates them), the MTP depth, the fusion flag from the predicted decode checkpoint; and the
    predicted (prefill, decode) for the layout check."""
    from quantkit.model.families import family_of
    from quantkit.serving.checks import fusion_flag
    from quantkit.serving.layout import predicted_stored
    from quantkit.serving.stored import inventory

    stored = [predicted_stored(config, w, group_size=group_size) for w in ("prefill", "decode")]
    decode = stored[1]
    fam = family_of(decode.config.get("model_type"))
    facts = PairFacts(name=name, kv_scales=True, mtp=int(decode.text.get("num_nextn_predict_layers") or 0),
                      trust_remote_code=bool(getattr(fam, "trust_remote_code", False)),
                      fusion_flag=bool(fusion_flag("sglang", decode, inventory(decode, "sglang"), None)),
                      notes=[f"predicted from the {name} config: the pair `quantkit convert` writes (INT4 group "
                             f"{group_size}); run it on the converted DIR to use the pair's own facts"])
    return facts, stored


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def serve_commands(out: str | Path, engine: str, layout: Layout, *, mount: str | None = None, mtp: bool = True,
                   port: int = 30000, router_port: int = 8000,
                   facts: PairFacts | None = None) -> tuple[list[Command], PairFacts]:
    """The prefill, decode and router commands for the pair in `out` (see the module docstring);
    `facts`: given instead of read from `out` (`predicted_facts` for a preset)."""
    if engine not in ("sglang", "vllm"):
        raise ConfigError(f"--engine {engine}: choose sglang or vllm")
    facts = facts or pair_facts(Path(out))
    path = mount or f"/models/{facts.name}"
    spec = facts.mtp > 0 and mtp
    if engine == "sglang":
        cmds = _sglang(path, facts, layout, spec, port, router_port)
    else:
        cmds = _vllm(path, facts, layout, spec, port)
    for c, which in zip(cmds, ("prefill", "decode")):
        where = Path(out) / which if Path(out).is_dir() else f"DIR/{which}"  # a preset: the pair convert writes
        c.comment = f"on the {which} nodes, {where} mounted at {path}"
    return cmds, facts


def _sglang(path: str, f: PairFacts, lay: Layout, spec: bool, port: int, router_port: int) -> list[Command]:
    common = ["--model-path", path, "--tp", str(lay.tp)]
    if lay.ep > 1:
        common += ["--ep-size", str(lay.ep)]
    if lay.dp_attention:
        common += ["--attn-dp-size", str(lay.tp)]
    if f.kv_scales:
        common += ["--kv-cache-dtype", "fp8_e4m3"]
    common += ["--page-size", str(PAGE_SIZE), "--disaggregation-transfer-backend", "mooncake"]
    if spec:
        common += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", "2"]
    if f.trust_remote_code:
        common += ["--trust-remote-code"]
    net = ["--host", "0.0.0.0", "--port", str(port)]
    prefill = Command("prefill", "sglang", common + ["--disaggregation-mode", "prefill",
                                                     "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)] + net)
    decode = Command("decode", "sglang", common + ["--disaggregation-mode", "decode"] + net
                     + (["--disable-shared-experts-fusion"] if f.fusion_flag else []))
    router = Command("router", "sglang-router", ["--pd-disaggregation", "--prefill", f"http://PREFILL_HOST:{port}",
                                                 str(BOOTSTRAP_PORT), "--decode", f"http://DECODE_HOST:{port}",
                                                 "--host", "0.0.0.0", "--port", str(router_port)],
                     "one entry point: each request is prefilled on the prefill pool, decoded on the decode pool")
    return [prefill, decode, router]


def _vllm(path: str, f: PairFacts, lay: Layout, spec: bool, port: int) -> list[Command]:
    common = [path, "--served-model-name", f.name]
    if lay.dp_attention:  # attention data-parallel: one attention replica per GPU, experts over all of them
        common += ["--tensor-parallel-size", "1", "--data-parallel-size", str(lay.tp)]
    else:
        common += ["--tensor-parallel-size", str(lay.tp)]
    if lay.ep > 1:
        common += ["--enable-expert-parallel"]
    if f.kv_scales:
        common += ["--kv-cache-dtype", "fp8_e4m3"]
    common += ["--block-size", str(PAGE_SIZE)]
    if spec:
        common += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1},
                                                      separators=(",", ":"))]
    if f.trust_remote_code:
        common += ["--trust-remote-code"]
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))
    common += ["--kv-transfer-config", kv, "--port", str(port)]
    return [Command("prefill", "vllm", list(common)), Command("decode", "vllm", list(common)),
            Command("router", "", [], "vLLM's wheel ships no prefill/decode router: put a proxy in front that sends "
                                      "each request to the prefill pool with max_tokens=1, then to the decode pool "
                                      "with the returned kv_transfer_params (vLLM's disaggregated-serving example "
                                      "proxy does this)")]


def render(cmds: list[Command], facts: PairFacts, engine: str, layout: Layout) -> str:
    head = [f"# {engine}: {facts.name} pair at {layout.flags()} (checked: every rank's shards keep the kernel rules)"]
    head += [f"# note: {n}" for n in facts.notes]
    return "\n".join(head) + "\n" + "\n\n".join(c.text() for c in cmds) + "\n"


def layout_refusal(out: Path, engine: str, layout: Layout, stored: list | None = None) -> str | None:
    """Why `engine` would refuse this pair at `layout` (check-serving's per-rank rules), with a layout
    that works; None when every rank's shards pass. `stored`: the pair's tensors when not read from `out`."""
    from quantkit.serving.layout import check_layout, working_layout
    from quantkit.serving.stored import read_stored

    stored = stored or [read_stored(Path(out) / w) for w in ("prefill", "decode")]
    problems = [p.text(engine) for st in stored for p in check_layout(st, layout, engine).problems]
    if not problems:
        return None
    found = working_layout(stored, layout, (engine,))
    works = f"a layout that works: {found.flags()}" if found else "no layout of these GPUs passes"
    return f"{engine} refuses this pair at {layout.flags()}: {problems[0]}; {works}"


def check_commands(cmds: list[Command], *, download: bool = True) -> list[dict]:
    """Every command parsed by its engine's own pinned parser: [{"role", "parser", "ok", "error", "args"}]."""
    from quantkit.serving.engines import cli_source, parse_commands

    out = []
    for parser in sorted({c.parser for c in cmds if c.parser}):
        group = [c for c in cmds if c.parser == parser]
        src = cli_source(parser, download=download)
        for c, r in zip(group, parse_commands(src, [c.args for c in group])):
            out.append({"role": c.role, "parser": f"{parser} {src.version}", **r})
    return out
