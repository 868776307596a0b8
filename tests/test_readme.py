"""The README as a newcomer follows it: its shell commands and Python snippets run on the
CPU, in a folder of their own, as written; the names its tables and synopsis give exist;
and every relative link in README.md and docs/*.md resolves, #anchors included."""
import concurrent.futures
import os
import re
import shlex
import subprocess
import sys

import pytest

import onnx_offload
from onnx_offload.config import OffloadConfig, ENV_FIELDS, parse_bytes
from onnx_offload.session import OffloadSession
from onnx_offload.tools import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
NOT_RUN = "<!-- test_readme: not run"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.M | re.S)


def text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def blocks(md: str):
    """(language, body, run) for each fenced block; run is False where the comment line
    before it says the test does not run it."""
    out = []
    for m in FENCE.finditer(md):
        before = md[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), m.group(2), not before.startswith(NOT_RUN)))
    return out


def shell_commands(md: str):
    return [line for lang, body, run in blocks(md) if lang == "sh" and run
            for line in body.splitlines() if line.strip()]


def child_env():
    """The children import the package this test imported, and keep their optimized models in
    the tests' cache folder (conftest)."""
    env = dict(os.environ)
    where = os.path.dirname(os.path.dirname(os.path.abspath(onnx_offload.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([where] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def argv_of(command: str):
    """A README command as a process's arguments: `onnx-offload` is `python -m onnx_offload`
    (the same entry point), `python` this interpreter, and the repository's scripts are named
    from the repository."""
    args = shlex.split(command)
    if args[0] == "onnx-offload":
        return [sys.executable, "-m", "onnx_offload"] + args[1:]
    if args[0] == "python":
        return [sys.executable] + [os.path.join(ROOT, a) if os.path.exists(os.path.join(ROOT, a)) else a
                                   for a in args[1:]]
    raise AssertionError(f"the README's command {command!r} is not one this test knows how to run")


def run(argv, cwd, timeout=300, input=None):
    p = subprocess.run(argv, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout,
                       input=input if input is not None else "")
    assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def test_the_readme_s_commands_and_snippets_run_on_the_cpu(tmp_path):
    md = text(README)
    commands = shell_commands(md)
    installs = [c for c in commands if c.startswith("pip ")]
    others = [c for c in commands if not c.startswith("pip ")]
    assert len(installs) == 2 and others, commands

    # The test command is the one CI runs from a clean clone (.ci/run): its pip steps are
    # there as written, and so is the suite. The demo command installs an extra that
    # pyproject.toml declares, and its demo runs here.
    ci = text(os.path.join(ROOT, ".ci", "run"))
    pyproject = text(os.path.join(ROOT, "pyproject.toml"))
    after = {}
    for c in installs:
        pips, rest = c.split(" && ", 1)
        after[rest] = pips.split("; ")
    assert sorted(after) == ["onnx-offload demo", "pytest -q"], installs
    for step in after["pytest -q"]:
        assert step in ci, f"the README's {step!r} is not what .ci/run runs"
    assert 'pytest -q "$@"' in ci
    uninstall, install = after["onnx-offload demo"]
    assert uninstall in ci
    for extra in re.fullmatch(r'pip install "\.\[([\w,]+)\]"', install).group(1).split(","):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    demo = ["onnx-offload demo"]

    makes = [c for c in others if c.startswith("python models/make_model.py")]
    generates = [c for c in others if c.startswith("onnx-offload generate")]
    chats = [c for c in others if c.startswith("onnx-offload chat")]
    assert len(makes) == 1 and len(generates) >= 2 and len(chats) == 1, others
    assert len(makes) + len(generates) + len(chats) == len(others), others
    assert any("--prompt " in g for g in generates), "the quick start runs generate --prompt"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        demo_run = pool.submit(run, argv_of(demo[0]), str(tmp_path))
        run(argv_of(makes[0]), str(tmp_path))
        folder = tmp_path / shlex.split(makes[0])[-1]
        # With tokenizers installed (the [test] extra), the script writes the tokenizer.json
        # that --prompt reads.
        pytest.importorskip("tokenizers", reason="--prompt needs the 'tokenizers' package")
        assert (folder / "tokenizer.json").is_file()
        # The folder is larger than every budget the quick start gives it.
        weights = sum(os.path.getsize(folder / f) for f in os.listdir(folder) if f.endswith(".data"))
        for g in generates:
            args = shlex.split(g)
            assert parse_bytes(args[args.index("--vram-limit") + 1]) < weights, g
        gen_runs = [pool.submit(run, argv_of(g), str(tmp_path)) for g in generates]
        # A chat read from standard input: a line a turn, the end of input ends it.
        chat_run = pool.submit(run, argv_of(chats[0]), str(tmp_path), input="w1 w2\nw3\n")
        # The Python blocks run in order in one process, as a reader pastes them.
        # (The one unrun block needs a running server: see the test below.)
        snippets = [body for lang, body, run_it in blocks(md) if lang == "python" and run_it]
        assert snippets
        script = tmp_path / "readme_snippets.py"
        script.write_text("\n".join(snippets))
        out = run([sys.executable, str(script)], str(tmp_path)).stdout
        assert "ms a token against a link bound of" in out and "byte hit rate" in out, out
        for g, r in zip(generates, gen_runs):
            assert r.result().stdout.strip(), g
        assert "demo passed" in demo_run.result().stdout
        assert chat_run.result().stdout.count("> ") >= 2, chat_run.result().stdout


def test_only_the_commands_that_need_the_network_or_a_running_server_go_unrun():
    unrun = [body.split("\n")[0] for lang, body, run_it in blocks(text(README)) if not run_it]
    assert unrun == ["python -m onnxruntime_genai.models.builder -m Qwen/Qwen2.5-0.5B-Instruct -o qwen -p fp16 -e cuda",
                     "onnx-offload serve my-llm --vram-limit 12MiB --port 8000", "from openai import OpenAI"]


def help_of(capsys, *command):
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    return capsys.readouterr().out


def test_the_configuration_table_names_variables_keywords_and_flags_that_exist(capsys):
    md = text(README)
    table = md[md.index("| variable | keyword | flag | values |"):]
    rows = [r.split("|")[1:4] for r in table.split("\n\n")[0].splitlines()[2:]]
    assert len(rows) >= 12
    variables = {v for v, _, _ in ENV_FIELDS}
    keywords = {f.name for f in OffloadConfig.__dataclass_fields__.values()}
    import inspect
    keywords |= set(inspect.signature(OffloadSession.__init__).parameters)
    flags = help_of(capsys, "generate") + help_of(capsys, "run")
    for var, kw, flag in rows:
        var, kw, flag = (x.strip().strip("`") for x in (var, kw, flag))
        assert var == "-" or var in variables, var
        assert kw == "-" or kw in keywords, kw
        assert flag == "-" or re.search(rf"{re.escape(flag)}\b", flags), flag
        # The table says which variable each keyword reads: the config's own pairing.
        if var != "-":
            assert (var, kw) in {(v, f) for v, f, _ in ENV_FIELDS}, (var, kw)


def test_the_command_synopsis_names_commands_and_flags_that_exist(capsys):
    (synopsis,) = [body for lang, body, _ in blocks(text(README)) if lang == "text"]
    for line in synopsis.splitlines():
        words = line.split()
        assert words[0] == "onnx-offload", line
        help_text = help_of(capsys, words[1])
        for flag in re.findall(r"--[a-z][a-z-]*", line):
            assert re.search(rf"{flag}\b", help_text), (flag, line)
        if words[1] == "bench":
            for name in words[2].split("|"):
                assert name in help_text, name


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text, lower case, with everything but
    letters, digits, spaces, '-' and '_' dropped and spaces made '-'."""
    t = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    t = t.replace("`", "").replace("*", "").strip().lower()
    t = re.sub(r"[^\w\- ]", "", t)
    return t.replace(" ", "-")


def anchors(md: str) -> set:
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6} (.+?)\s*$", FENCE.sub("", md), re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def markdown_files():
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(path):
    md = FENCE.sub("", text(path))
    links = re.findall(r"\]\(([^)\s]+)\)", md)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(file):
            broken.append(link)
        elif anchor and (not file.endswith(".md") or anchor not in anchors(text(file))):
            broken.append(link)
    assert not broken, f"{os.path.relpath(path, ROOT)}: {broken}"


def test_the_readme_is_short_and_links_every_docs_page():
    md = text(README)
    assert len(md.splitlines()) <= 250
    for f in os.listdir(DOCS):
        if f.endswith(".md"):
            assert f"(docs/{f})" in md or f"(docs/{f}#" in md, f
