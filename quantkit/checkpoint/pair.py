"""The pair's contract: `pair.json`, what prefill/ and decode/ must share for a KV cache written by one
to be read by the other.

In disaggregated serving a prefill pool computes the KV cache of a prompt and hands its pages to a
decode pool, each pool loading its own checkpoint. vLLM's KV-transfer handshake compares the model
name, dtype, heads, layers, cache dtype and the speculative config, but neither the quantization nor
the KV scales; SGLang's compares less. So two checkpoints that disagree on a KV projection's bytes,
a KV scale, the RoPE or the tokenizer pass the handshake and decode garbage. What must agree:

    attention   every self_attn tensor (the KV projections write the cache; q, kv_b and o read it
                in the absorbed MLA form) of every layer, the MTP layer's included
    indexer     the DSA lightning indexer (its keys are cached beside the latent: GLM-5.x)
    kv_scales   self_attn.k_scale / v_scale (an FP8 cache is written and read with them)
    mtp         the MTP layer's own tensors (eh_proj, enorm, hnorm, shared head): its draft KV is
                cached by prefill and extended by decode under speculative decoding
    config      the RoPE and cache fields of config.json (CONFIG_FIELDS and the family's cache_config)
                and the MTP depth
    tokenizer   the tokenizer files (token ids cross the pools)

`write_contract(out)` builds pair.json from the two manifests (their per-tensor sha256, no second
read) at the end of convert, with each item's digest, and says whether it holds: a
`--decode-rest bf16` pair does not (its attention is BF16 in decode), and pair.json records the first
difference rather than hiding it. `check_contract(out, actual)` (in `quantkit verify`) compares the
tensors as re-hashed, the configs and the tokenizer files as they are now, and names the first
difference.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from quantkit.model.families import find_family
from quantkit.runtime.files import atomic_write_text

PAIR_JSON = "pair.json"
FORMAT = "quantkit-pair/1"
# every family's; a family's own cache fields (its attention's heads or ranks, its indexer's) are its
# definition's `cache_config` (quantkit.model.family)
CONFIG_FIELDS = (
    "model_type", "architectures", "hidden_size", "vocab_size", "num_hidden_layers", "num_nextn_predict_layers",
    "num_attention_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
    "max_position_embeddings", "torch_dtype", "bos_token_id", "eos_token_id",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "tiktoken.model")
GROUPS = ("attention", "indexer", "kv_scales", "mtp", "config", "tokenizer")
WHY = {
    "attention": "the KV projections write the cache and q/kv_b/o read it: a KV page from prefill is read by "
                 "decode's attention",
    "indexer": "the DSA indexer's keys are cached beside the latent",
    "kv_scales": "an FP8 KV cache is written with prefill's scales and read with decode's",
    "mtp": "under speculative decoding the MTP layer's draft KV crosses the pools too",
    "config": "RoPE and the cache geometry decide what a cached page means",
    "tokenizer": "token ids cross the pools",
}


def _group(name: str, mtp_layers: set[int]) -> str | None:
    """Which contract group a stored tensor belongs to; None for the rest (experts, MLP, norms, head)."""
    if ".self_attn.indexer." in name:
        return "indexer"
    if re.search(r"\.self_attn\.[kv]_scale$", name):
        return "kv_scales"
    if ".self_attn." in name:
        return "attention"
    m = re.search(r"layers\.(\d+)\.", name)
    if m and int(m.group(1)) in mtp_layers and ".mlp." not in name:
        return "mtp"
    return None


def _decode_name(name: str) -> str:
    """The decode twin of a prefill tensor name (the FP8 block multiplier: weight_scale_inv -> weight_scale)."""
    return name[: -len("weight_scale_inv")] + "weight_scale" if name.endswith(".weight_scale_inv") else name


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _mtp_layers(config: dict) -> set[int]:
    t = _text(config)
    n = int(t.get("num_hidden_layers") or 0)
    return set(range(n, n + int(t.get("num_nextn_predict_layers") or 0)))


def config_view(config: dict) -> dict:
    """The fields of config.json the KV cache depends on (those present): every family's, then the
    family's own (`Family.cache_config`; none for a model_type quantkit does not know)."""
    t = _text(config)
    fam = find_family(config.get("model_type", ""))
    return {k: t[k] for k in CONFIG_FIELDS + (fam.cache_config if fam else ()) if k in t}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_digests(folder: Path) -> dict[str, str]:
    return {f: _sha((folder / f).read_bytes()) for f in TOKENIZER_FILES if (folder / f).is_file()}


def items(prefill: dict[str, dict], decode: dict[str, dict], configs: dict[str, dict],
          tokenizers: dict[str, dict[str, str]]) -> dict[str, list[dict]]:
    """Every contract item: {"name", "prefill", "decode"} with each side's digest (None: absent)."""
    mtp = _mtp_layers(configs["prefill"])
    out: dict[str, list[dict]] = {g: [] for g in GROUPS}
    names = sorted(set(prefill) | {_prefill_name(n, prefill) for n in decode})
    for name in names:
        g = _group(name, mtp)
        if g is None:
            continue
        dname = _decode_name(name)
        out[g].append({"name": name, "prefill": (prefill.get(name) or {}).get("sha256"),
                       "decode": (decode.get(dname) or {}).get("sha256")})
    views = {w: config_view(configs[w]) for w in ("prefill", "decode")}
    for k in sorted(set(views["prefill"]) | set(views["decode"])):
        out["config"].append({"name": f"config.json:{k}", "prefill": _value_digest(views["prefill"].get(k)),
                              "decode": _value_digest(views["decode"].get(k)), "value": views["prefill"].get(k)})
    for f in sorted(set(tokenizers["prefill"]) | set(tokenizers["decode"])):
        out["tokenizer"].append({"name": f, "prefill": tokenizers["prefill"].get(f), "decode": tokenizers["decode"].get(f)})
    return out


def _prefill_name(dname: str, prefill: dict) -> str:
    if dname.endswith(".weight_scale"):
        inv = dname + "_inv"
        if inv in prefill or dname not in prefill:
            return inv
    return dname


def _value_digest(v) -> str | None:
    return None if v is None else _sha(json.dumps(v, sort_keys=True).encode())


def first_difference(groups: dict[str, list[dict]]) -> str | None:
    for g in GROUPS:
        for it in groups[g]:
            if it["prefill"] != it["decode"]:
                side = "missing from decode/" if it["decode"] is None else (
                    "missing from prefill/" if it["prefill"] is None else "differs between prefill/ and decode/")
                return f"{g}: {it['name']} {side} ({WHY[g]})"
    return None


def build_contract(out: Path) -> dict:
    """pair.json's content for a finished output (prefill/, decode/ with their manifests)."""
    out = Path(out)
    tensors = {w: json.loads((out / w / "manifest.json").read_text())["tensors"] for w in ("prefill", "decode")}
    configs = {w: json.loads((out / w / "config.json").read_text()) for w in ("prefill", "decode")}
    groups = items(tensors["prefill"], tensors["decode"], configs,
                   {w: tokenizer_digests(out / w) for w in ("prefill", "decode")})
    diff = first_difference(groups)
    return {
        "format": FORMAT,
        "holds": diff is None,
        "first_difference": diff,
        "why": WHY,
        "counts": {g: len(v) for g, v in groups.items()},
        "groups": {g: [{"name": it["name"], "sha256": it["prefill"], **({"decode_sha256": it["decode"]}
                                                                       if it["decode"] != it["prefill"] else {}),
                        **({"value": it["value"]} if "value" in it else {})} for it in v]
                   for g, v in groups.items()},
    }


def write_contract(out: Path) -> dict:
    """Write pair.json at the top of a finished output; returns what convert-report.json records of it."""
    contract = build_contract(out)
    text = json.dumps(contract, indent=1) + "\n"
    atomic_write_text(Path(out) / PAIR_JSON, text)
    return {"file": PAIR_JSON, "sha256": _sha(text.encode()), "holds": contract["holds"],
            "first_difference": contract["first_difference"], "counts": contract["counts"]}


def _report_digest(out: Path) -> str | None:
    try:
        return json.loads((out / "convert-report.json").read_text())["pair_contract"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_contract(out: Path, actual: dict[str, dict[str, dict]]) -> tuple[dict | None, list[str]]:
    """pair.json against the output as it is now (`actual`: each folder's re-hashed tensors, as
    `quantkit verify` found them). Returns (a summary, problems): a problem names the first item
    whose bytes differ between the phases, or from what pair.json recorded."""
    out = Path(out)
    path = out / PAIR_JSON
    stated_sha = _report_digest(out)
    if not path.is_file():
        if stated_sha is None:  # an output from before the contract: nothing recorded to check against
            return {"holds": None, "note": f"no {PAIR_JSON} (converted before quantkit wrote one)"}, []
        return None, [f"{path}: missing, though convert-report.json records it; the pair's contract (what prefill/ "
                      "and decode/ must share for a KV cache to cross them) is gone: reconvert, or restore it"]
    try:
        recorded = json.loads(path.read_text())
        if recorded.get("format") != FORMAT:
            raise ValueError
    except (ValueError, AttributeError):
        return None, [f"{path}: not a {FORMAT} file (damaged); reconvert"]
    if stated_sha is not None and _sha(path.read_bytes()) != stated_sha:
        return None, [f"{path}: sha256 differs from the one convert-report.json states (replaced or edited)"]
    configs = {w: json.loads((out / w / "config.json").read_text()) for w in ("prefill", "decode")}
    now = items(actual["prefill"], actual["decode"], configs, {w: tokenizer_digests(out / w) for w in ("prefill", "decode")})
    problems = []
    diff = first_difference(now)
    if diff and recorded.get("holds"):
        problems.append(f"pair contract ({PAIR_JSON}): {diff}")
    stated = {(g, it["name"]): it for g in GROUPS for it in recorded.get("groups", {}).get(g, [])}
    for g in GROUPS:
        for it in now[g]:
            want = stated.get((g, it["name"]))
            if want is None:
                problems.append(f"pair contract ({PAIR_JSON}): {g}: {it['name']} is not in it (a tensor or file added after convert)")
            elif want["sha256"] != it["prefill"] or want.get("decode_sha256", want["sha256"]) != it["decode"]:
                which = "prefill" if want["sha256"] != it["prefill"] else "decode"
                problems.append(f"pair contract ({PAIR_JSON}): {which}/: {g}: {it['name']} differs from the digest "
                                f"convert recorded ({WHY[g]})")
            if problems:
                break
        if problems:
            break
    summary = {"holds": recorded.get("holds") and not problems, "recorded_holds": recorded.get("holds"),
               "first_difference": diff or recorded.get("first_difference"),
               "counts": {g: len(now[g]) for g in GROUPS}}
    return summary, problems[:1]
