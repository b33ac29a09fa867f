"""The docs as a reader meets them: no tracker numbers anywhere, links and section references that
resolve, every `quantkit CMD --flag` a page names accepted by that command, a benchmarks page a user
reads in minutes, and a quickstart whose shown outputs are what a real tiny convert prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".json", ".txt", ".ipynb", ".cfg", ".ini"}
# A tracker reference ("issue" or "round" followed by a number) means nothing to a reader; say the behaviour.
TRACKER = re.compile(r"issue #?[0-9]+|round [0-9]", re.IGNORECASE)


def _text_files():
    for top in ("docs", "quantkit", "tests", "scripts", "recipes"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                yield p
    yield ROOT / "README.md"


def test_no_tracker_numbers_in_docs_code_tests_or_scripts():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for p in _text_files() for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if TRACKER.search(line)]
    assert not found, "tracker numbers (write the behaviour they protect instead):\n" + "\n".join(found)


def test_tracker_pattern_catches_what_the_merge_grep_catches():
    n = "3"  # built here, so that this file holds no tracker number itself
    assert TRACKER.search("see Issue " + n) and TRACKER.search("issue #" + n) and TRACKER.search("Round " + n)
    assert TRACKER.search("centred a" + "round " + n)  # the merge grep has no word boundary either
    assert not TRACKER.search("rounded to even") and not TRACKER.search("the issue's acceptance")


def test_benchmarks_page_is_a_user_page():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 350
    assert not re.search(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)  # no dated journal entries
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (ROOT / "docs" / image).is_file(), image


# ---- links and section references ----------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' inside a code block is no heading
    return [m.group(1) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.M)]


def test_slug_matches_github():
    assert slug("5. `quantkit validate`") == "5-quantkit-validate"
    assert slug("6. `--decode-rest bf16`: Kimi's official layout") == "6---decode-rest-bf16-kimis-official-layout"
    assert slug("Why dampening 0.01") == "why-dampening-001"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve_to_a_file_and_a_heading(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not bad, f"{doc.name}:\n" + "\n".join(bad)


SECTION_REF = re.compile(r"(?:docs/)?\b(\w+)\.md[,:]? \(?\"([^\"]{3,80})\"")


def test_quoted_section_references_name_an_existing_heading():
    """`docs/recipes.md, "The random share"` in a comment or a page must still find that section."""
    bad = []
    for p in [*DOCS, *_text_files()]:
        for m in SECTION_REF.finditer(p.read_text(errors="replace")):
            target = ROOT / "docs" / f"{m.group(1)}.md"
            if not target.is_file():
                continue
            want = " ".join(m.group(2).strip("`").lower().split())
            if not any(want in re.sub(r"`", "", h).lower() for h in headings(target)):
                bad.append(f"{p.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, "section references without such a heading:\n" + "\n".join(sorted(set(bad)))


# ---- the commands the pages show ------------------------------------------------------------------
def _command_options() -> dict[str, set[str]]:
    import typer

    from quantkit.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for name, cmd in group.commands.items()}


def test_every_flag_a_page_names_is_accepted_by_its_command():
    """Each `quantkit CMD ... --flag` on a page (code blocks and inline code, up to the end of the
    command) names an option `quantkit CMD --help` lists."""
    options = _command_options()
    command = re.compile(r"quantkit\s+([a-z][a-z-]*)((?:[^`\n;|&#]|\\\n)*)")
    bad, checked = [], 0
    for doc in DOCS:
        text = doc.read_text()
        for m in command.finditer(text):
            if m.group(1) not in options:
                continue
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                checked += 1
                if flag not in options[m.group(1)]:
                    bad.append(f"{doc.name}:{text[:m.start()].count(chr(10)) + 1}: quantkit {m.group(1)} {flag}")
    assert checked > 60  # the pattern still finds the commands
    assert not bad, "flags the command does not take:\n" + "\n".join(bad)


def test_serving_page_shows_the_commands_serve_commands_prints():
    """docs/serving.md's launch commands are generated, not written by hand: each block that opens like
    serve-commands' output is what the `quantkit serve-commands ...` quoted just before it prints now
    (--check only adds the parsers' verdicts on stderr)."""
    import shlex

    from typer.testing import CliRunner

    from quantkit.cli import app

    text = (ROOT / "docs" / "serving.md").read_text()
    blocks = list(re.finditer(r"```bash\n(# (?:sglang|vllm): .*?)```", text, flags=re.S))
    assert len(blocks) >= 2
    start = 0
    for b in blocks:
        asked = re.findall(r"`quantkit (serve-commands [^`]+)`", text[start:b.start()])
        assert asked, f"docs/serving.md: the block at line {text[:b.start()].count(chr(10)) + 1} names no command"
        argv = [a for a in shlex.split(asked[-1]) if a != "--check"]
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 0, res.output
        assert res.stdout.strip() == b.group(1).strip(), (
            f"docs/serving.md: the commands shown for `quantkit {asked[-1]}` are stale; paste its output:\n{res.stdout}")
        start = b.end()


# ---- the quickstart against a real convert --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_glm):
    import quantkit as qk

    return qk.convert("tiny:glm-5.2", tmp_path_factory.mktemp("quickstart") / "glm", progress=False)


def _rendered(table) -> str:
    import io

    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_quickstart_shows_what_a_real_tiny_convert_prints(tiny_pair):
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    assert "quantkit convert tiny:glm-5.2 --out out/glm" in quick
    caption = " ".join(_rendered(tiny_pair.table()).split())
    counts = re.search(r"\d+ routed experts: [^;]+", caption).group(0)  # "80 routed experts: 80 GPTQ"
    assert counts + ";" in quick, f"the quickstart's expert counts are stale: a real convert prints {counts!r}"
    gates = re.search(r"(PASSED|FAILED): \d+/\d+ gate checks", _rendered(tiny_pair.validation.table())).group(0)
    assert gates in quick, f"the quickstart's gate line is stale: a real convert prints {gates!r}"
    for name in ("prefill", "decode", "convert-report.json", "validation.json", "validation.md", "validation.png",
                 "validation-experts.png"):
        assert (tiny_pair.out / name).exists() and name.split(".")[0] in quick


def test_quickstart_card_rows_and_serve_commands_are_the_cards(tiny_pair):
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    card = (tiny_pair.decode / "README.md").read_text()
    for row in re.findall(r"^\| ([a-zA-Z][^|]+?) \|", quick, flags=re.M):
        if row not in ("path", "tensor class"):
            assert f"| {row} |" in card, f"the quickstart shows a card row the card does not have: {row}"
    serve = [ln for block in re.findall(r"```bash\n(.*?)```", quick, flags=re.S) for ln in block.splitlines()
             if ln.startswith(("python -m sglang", "vllm serve", "  --"))]
    assert len(serve) >= 8
    for line in serve:
        assert line in card, f"the quickstart's serve command differs from the card's: {line}"
    from typer.testing import CliRunner

    from quantkit.cli import app

    printed = "".join(CliRunner().invoke(app, ["serve-commands", str(tiny_pair.out), "--engine", e, "--tp", "1"]).output
                      for e in ("sglang", "vllm"))
    for line in serve:  # "serve-commands prints the commands ... the card carries the same commands"
        assert line in printed, f"serve-commands prints other commands than the card and the quickstart: {line}"


def test_every_flag_a_page_gives_a_script_is_one_it_defines():
    """`python scripts/X.py ... --flag` on a page: X.py defines that option (argparse, read statically:
    some scripts start work when run)."""
    script = re.compile(r"python (scripts/[\w-]+\.py)((?:[^`\n;|&#]|\\\n)*)")
    bad, checked = [], 0
    for doc in DOCS:
        for m in script.finditer(doc.read_text()):
            path = ROOT / m.group(1)
            assert path.is_file(), f"{doc.name}: {m.group(1)} does not exist"
            source = path.read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                checked += 1
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    bad.append(f"{doc.name}: {m.group(1)} {flag}")
    assert checked > 15
    assert not bad, "flags the script does not define:\n" + "\n".join(bad)


def test_every_script_parses_its_arguments_so_help_does_no_work():
    """`python scripts/X.py --help` prints the usage and exits: a script that read sys.argv by hand once
    took `--help` for its output folder and converted two models into a folder named `--help`."""
    bare = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if "ArgumentParser(" not in p.read_text()]
    assert not bare, f"scripts without an argparse parser (add one; `--help` must not start work): {bare}"


def test_the_repository_tracks_no_checkpoint_outside_the_tests():
    """A convert output committed by accident (weights under a stray top-level folder) is caught here."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.safetensors"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    stray = [f for f in tracked.stdout.splitlines() if not f.startswith("tests/")]
    assert not stray, f"weights tracked outside tests/ (git rm them): {stray[:3]}"


# ---- defaults and figures a page states, against the code ------------------------------------------
def _cli_defaults() -> dict[str, dict[str, object]]:
    import typer

    from quantkit.cli import app

    group = typer.main.get_command(app)
    return {name: {o: p.default for p in cmd.params for o in p.opts} for name, cmd in group.commands.items()}


# (page, text the page states, command, option, the default that text claims)
STATED_DEFAULTS = [
    ("serving.md", "**Engine numerics (`--numerics engine`, validate's default;", "validate", "--numerics", "engine"),
    ("serving.md", "under engine numerics, validate's default", "validate", "--numerics", "engine"),
    ("recipes.md", "measured under engine numerics (validate's default)", "validate", "--numerics", "engine"),
    ("serving.md", "By default (`--numerics auto`) `quantkit probe`", "probe", "--numerics", "auto"),
    ("serving.md", "`--concurrency` (4) at a time", "probe", "--concurrency", 4),
    ("serving.md", "each with a `--timeout` (60 s)", "probe", "--timeout", 60.0),
    ("serving.md", "retried `--retries` (4)", "probe", "--retries", 4),
    ("serving.md", "[--requests 4] [--rounds 6] [--seed 0]", "probe", "--requests", 4),
    ("serving.md", "[--requests 4] [--rounds 6] [--seed 0]", "probe", "--rounds", 6),
    ("serving.md", "[--requests 4] [--rounds 6] [--seed 0]", "probe", "--seed", 0),
    ("distributed.md", "`--weights auto` (the default)", "validate", "--weights", "auto"),
    ("planner.md", "| gpus | 8 |", "plan", "--gpus", 8),
    ("planner.md", "| gpu | h200 |", "plan", "--gpu", "h200"),
    ("planner.md", "| context | 21,400 |", "plan", "--context", 21400),
    ("planner.md", "| mem_fraction | 0.90 |", "plan", "--mem-fraction", 0.9),
    ("planner.md", "| overhead_gib | 12.0 |", "plan", "--overhead-gib", 12.0),
]


@pytest.mark.parametrize("page,text,command,option,claimed", STATED_DEFAULTS,
                         ids=[f"{c} {o} {v}" for _, _, c, o, v in STATED_DEFAULTS])
def test_a_default_a_page_states_is_the_commands_default(page, text, command, option, claimed):
    doc = ROOT / "docs" / page
    assert text in " ".join(doc.read_text().split()), f"{page} no longer says {text!r}: update this table"
    assert _cli_defaults()[command][option] == claimed, f"{page} says {command} {option} defaults to {claimed!r}"


def test_the_recipe_settings_the_pages_state_are_the_recipes():
    """benchmarks.md's "shipped" settings and recipes.md's table of shipped recipes against recipes/*.yaml."""
    from quantkit.recipe import load_recipe

    real = {n: load_recipe(n) for n in ("glm-5.2", "kimi-k2.6", "deepseek-v3", "qwen3-moe")}
    for r in real.values():
        g, c = r.gptq, r.calibration
        assert (g.actorder, g.dampening, g.observer, c.extra_random) == (True, 0.01, "hessian", 0.25), r.name
        assert (c.num_samples, c.seq_len, c.random_windows()) == (410, 2048, 102), r.name
        assert (r.validate.dataset, r.validate.num_samples, r.validate.seq_len) == (
            "hf:HuggingFaceH4/ultrachat_200k@test_sft", 8, 512), r.name
    bench = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert ("GPTQ with act-order, dampening 0.01, group scales from the Hessian observer, and a quarter more "
            "calibration windows of uniform random token ids (`calibration.extra_random: 0.25`)") in bench
    table = (ROOT / "docs" / "recipes.md").read_text()
    for name, group in (("kimi-k2.6", 32), ("glm-5.2", 128), ("deepseek-v3", 128), ("qwen3-moe", 128)):
        assert real[name].group_size == group
        assert re.search(rf"^\| `{re.escape(name)}` \| [^|]+ \| {group} \|", table, flags=re.M), name
    assert "| 32, 128, 128 | `synthetic:train`, 64 x 64 | `synthetic:heldout`, 8 x 64 |" in table
    for name, group in (("tiny-kimi-k2.6", 32), ("tiny-glm-5.2", 128), ("tiny-qwen3-moe", 128)):
        r = load_recipe(name)
        assert (r.group_size, r.calibration.num_samples, r.calibration.seq_len) == (group, 64, 64), name
        assert (r.validate.dataset, r.validate.num_samples, r.validate.seq_len) == ("synthetic:heldout", 8, 64), name
    assert f"fewer than `gptq.min_tokens` ({load_recipe('tiny-glm-5.2').gptq.min_tokens})" in (
        ROOT / "docs" / "quickstart.md").read_text()
    for spec, windows in real["glm-5.2"].calibration.sources():  # recipes.md, "The shipped mix"
        assert re.search(rf"^\| `{re.escape(spec)}`[^\n]*\| {windows} \|", table, flags=re.M), (spec, windows)
    # the gates recipes.md states ("The real recipes' gates", "Gates for the tiny models")
    gates = {n: (real[n].validate.gates if n in real else load_recipe(n).validate.gates)
             for n in (*real, "tiny-glm-5.2", "tiny-kimi-k2.6")}
    assert {k: gates["kimi-k2.6"][k] for k in ("kl_max", "ppl_delta_max", "kv_delta_max")} == {
        "kl_max": 0.03, "ppl_delta_max": 0.02, "kv_delta_max": 0.01}
    assert gates["glm-5.2"]["kv_delta_max"] == 0.02 and gates["deepseek-v3"]["kv_delta_max"] == 0.01
    assert all(gates[n]["kl_max"] == 0.05 and gates[n]["ppl_delta_max"] == 0.03 and gates[n]["top1_min"] == 0.9
               for n in ("glm-5.2", "deepseek-v3", "qwen3-moe"))
    assert gates["glm-5.2"]["indexer_overlap_min"] == 0.9 and gates["tiny-glm-5.2"]["indexer_overlap_min"] == 0.95
    assert gates["tiny-glm-5.2"]["decode.layer_rel_err_max"] == 0.06
    assert gates["tiny-kimi-k2.6"]["kl_max"] == 0.03 and gates["tiny-kimi-k2.6"]["cross_phase.kl_max"] == 0.1


def test_the_full_scale_predictions_the_pages_state_are_the_planners():
    """The disk and device figures of `quantkit plan MODEL --convert --gpu h200 --max-host-memory 1000GB`
    as benchmarks.md's table and the quickstart state them (the planner changed under them once)."""
    from quantkit.planner.cost import plan_convert_for

    bench = (ROOT / "docs" / "benchmarks.md").read_text().split("## Full-scale predictions", 1)[1].split("\n## ", 1)[0]
    quick = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    for model in ("glm-5.2", "kimi-k2.6"):
        c = plan_convert_for(model, gpu="h200", max_host_memory="1000GB")
        disk = " + ".join(f"{c.disk[k] / 1e9:.1f}" for k in ("prefill", "decode", "resume_state")) + " GB |"
        row = next(ln for ln in bench.splitlines() if ln.startswith(f"| {model} |"))
        assert disk in row, f"benchmarks.md's {model} disk figures: the planner says {disk}"
        assert f"{c.peak_device / 1e9:.1f} GB" in row, f"benchmarks.md's {model} peak device: {c.peak_device / 1e9:.1f} GB"
        if model == "glm-5.2":
            total = sum(c.disk[k] for k in ("prefill", "decode", "resume_state")) / 1e12
            assert (f"{total:.2f} TB of disk ({c.disk['prefill'] / 1e9:.1f} GB prefill, {c.disk['decode'] / 1e9:.1f} GB "
                    f"decode, {c.disk['resume_state'] / 1e9:.1f} GB resume state at its peak)") in quick


def test_the_tiny_numbers_pages_quote_are_one_run():
    """The quickstart's printed table, its card excerpt, benchmarks.md's quality table and serving.md's
    reading table quote the same tiny GLM run (each CPU trains its own tiny model, so they are not
    checked against a new run, only against each other)."""
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    printed = re.search(r"│ decode INT4 │ prompts │ +([0-9.e-]+) │ ([0-9.]+) │ ([+-][0-9.]+)% │", quick)
    kl, top1, ppl = float(printed.group(1)), float(printed.group(2)), float(printed.group(3))
    card = re.search(r"^\| this checkpoint on prompts \| ([0-9.e-]+) \| ([0-9.]+) \| ([+-][0-9.]+)% \|", quick, flags=re.M)
    assert abs(float(card.group(1)) - kl) <= 0.005 * kl + 1e-5 and abs(float(card.group(2)) - top1) < 1e-3
    assert card.group(3).startswith(printed.group(3))
    bench = re.search(r"^\| tiny GLM 5.2 \(GPTQ experts\) \| [^|]+ \| ([0-9.e-]+) / ([0-9.]+) / ([+-][0-9.]+)% \|",
                      (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.M)
    assert abs(float(bench.group(1)) - kl) <= 0.005 * kl + 1e-5 and abs(float(bench.group(2)) - top1) < 1e-3
    assert abs(float(bench.group(3)) - ppl) < 0.01
    serving = re.search(r"^\| decode: KL / top-1 / ppl delta \| ([0-9.e-]+) / ([0-9.]+) / ([+-][0-9.]+)% \(GPTQ\)",
                        (ROOT / "docs" / "serving.md").read_text(), flags=re.M)
    assert abs(float(serving.group(1)) - kl) <= 0.05 * kl and abs(float(serving.group(2)) - top1) < 1e-3


def test_the_kv_capacity_the_pages_state_is_the_planners():
    """serving.md's and planner.md's FP8 KV capacity of Kimi K2.6's decode checkpoint on 8xH200."""
    from quantkit.planner.capacity import plan

    tokens = plan("kimi-k2.6").checkpoints["decode"].kv["fp8"].tokens
    short = f"{tokens / 1e6:.2f}M"
    assert f"{short}\nFP8 for the decode checkpoint" in (ROOT / "docs" / "serving.md").read_text()
    planner = (ROOT / "docs" / "planner.md").read_text()
    assert f"# FP8 KV: {short} tokens (2.0x) on decode" in planner and f"| {tokens:,} |" in planner


SOURCES = {"the article": "article", "the facts sheet": "facts sheet"}
DEFINED = "planner.md#7-quantkit-vs-the-published-figures"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_article_and_the_facts_sheet_are_linked_where_first_named(doc):
    """A page that names "the article" or "the facts sheet" links, at its first mention, to where
    planner.md says what they are (they were named and never linked)."""
    lines = doc.read_text().split("\n")
    for phrase, word in SOURCES.items():
        first = next((i for i, line in enumerate(lines) if re.search(rf"\b{phrase}\b|\b{word}'s\b", line, re.I)), None)
        if first is None:
            continue
        line = lines[first]
        here = doc.name == "planner.md"
        linked = (f"(#{DEFINED.split('#')[1]})" if here else DEFINED) in line
        defines = here and line.lstrip().startswith(f'"{phrase.capitalize()}"')
        assert linked or defines, f"{doc.name}:{first + 1}: {phrase!r} named without a link to {DEFINED}: {line}"


def test_the_pages_agree_on_whether_the_gpu_check_has_run():
    """benchmarks.md's GPU check section says whether it has run on a GPU; the quickstart says the same
    (a quickstart that still says "not run" after a run, or claims a GPU time before one, is stale)."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    status = re.search(r"^## GPU check: (.+)$", bench, flags=re.M).group(1)
    not_run = "not yet run" in status
    quick = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    says_not_run = re.search(r"not run on a GPU yet|not yet run on a GPU|never run on a GPU", quick) is not None
    assert says_not_run == not_run, f"benchmarks.md: 'GPU check: {status}'; the quickstart says otherwise"
    assert "gpu_check.sh" in quick
    if not_run:  # nothing measured on a GPU: no page states a GPU time for the check
        for doc in DOCS:
            text = " ".join(doc.read_text().split())
            assert not re.search(r"gpu_check\.sh[^.]*\b(under|about|in) \d+ min", text), doc.name
