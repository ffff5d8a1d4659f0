"""Claims the README, `--help` texts and configs/*.yaml make that code can check: each test names the claim."""
from __future__ import annotations

import re
from pathlib import Path

from splash.engine.sampling import SamplingParams

README = Path(__file__).resolve().parents[1] / "README.md"


def _sampled(seed: int) -> list[list[int]]:
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=32, seed=seed)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)   # no per-request seed
    return [out.token_ids for out in llm.generate([[5, 6, 7], [8, 9]], params)]


def test_the_seed_seeds_sampling_of_unseeded_requests():
    """`--seed N`: "random seed (preset weights, sampling)" (configs/cpu.yaml: "seeds the preset's weights and
    sampling"), as vLLM's --seed: the same seed samples the same tokens for requests that bring no seed."""
    assert _sampled(3) == _sampled(3)
    assert _sampled(3) != _sampled(4)


def _exported_metric_names() -> set[str]:
    """Every sample name GET /metrics renders, for a snapshot with a scheduler that has switched once."""
    from splash.server.engine_loop import EngineSnapshot
    from splash.server.metrics import Metrics

    model = {lay: {"last_predicted_s": 1e-3, "factor": 1.0, "last_measured_s": 1e-3, "median_error": 0.1}
             for lay in ("tp", "dp_attn", "cp", "dop")}
    direction = {"ratio": 1.0, "observed": 1, "last_predicted_s": 1e-3, "last_corrected_s": 1e-3,
                 "last_measured_s": 1e-3, "median_error": 0.1}
    snap = EngineSnapshot("tp", "auto", None, ("tp", "dop"), {("dop", "tp"): 1}, {"tp": 100}, 0, [0, 0], 8, 0, 0,
                          3, 5, scheduler={"model": model, "decisions": {"stay": 1},
                                           "switch_cost": {"directions": {"dop->tp": direction}}},
                          weight_bytes={0: 1, 1: 1}, prefix_cached_blocks=[0, 0])
    metrics = Metrics(lambda: snap)
    metrics.steps.inc()
    metrics.requests.labels("completions", "200").inc()
    metrics.step_time.observe(0.01)
    names = set()
    for line in metrics.render().decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("splash_") and not name.endswith("_created"):
            names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def test_the_readme_names_every_metric_the_server_exports_and_no_other():
    """README: `GET /metrics` and the auto paragraph list the metric names; a metric added or renamed without the
    README, or a name the README keeps after the code dropped it, fails here."""
    readme = set(re.findall(r"\bsplash_[a-z0-9_]+[a-z0-9]", README.read_text()))
    exported = _exported_metric_names()
    assert exported - readme == set(), "exported but not in the README"
    assert readme - exported == set(), "in the README but not exported"


def _help_text(words: list[str], capsys) -> str | None:
    """The --help text of the command a documented line runs (`words` from its program on), or None for a command
    that is not SPLASH's (make, curl, pip, ...)."""
    import runpy
    import sys

    import pytest

    if words[0].rsplit("/", 1)[-1].startswith("python") and words[1].endswith(".py"):
        words = words[1:]   # python scripts/NAME.py ...
    prog, rest = words[0].rsplit("/", 1)[-1], words[1:]
    sub = [rest[0]] if rest and not rest[0].startswith("-") else []
    if prog == "splash-sim":
        from splash.sim.cli import main
        call = lambda: main(sub + ["--help"])   # noqa: E731
    elif prog == "splash-bench":
        from splash.bench.cli import main
        call = lambda: main(sub + ["--help"])   # noqa: E731
    elif prog == "splash-serve":
        from splash.cli.args import build_parser
        return build_parser().format_help()
    elif prog == "python" and rest[:1] == ["-m"] and rest[1].startswith("splash.bench."):
        from splash.bench.cli import main
        call = lambda: main([rest[1].rsplit(".", 1)[-1], "--help"])   # noqa: E731
    elif prog == "load_test.py":
        def call():
            argv, sys.argv = sys.argv, [words[0], "--help"]
            try:
                runpy.run_path(str(README.parent / "scripts" / "load_test.py"), run_name="__main__")
            finally:
                sys.argv = argv
    else:
        return None
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:
        call()
    assert ex.value.code == 0, words
    return capsys.readouterr().out


def _command_words(lines: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(where, words) of each command in `lines` (continuations joined, comments, environment assignments,
    mpirun/mpiexec and their -n N stripped; the `[ ]` of optional parts dropped)."""
    import shlex

    out, pending = [], ""
    for where, line in lines:
        line = pending + line.split(" #")[0].split("\t#")[0]
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        words = [w for w in shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
                 if w not in ("...", "…")]
        while words and ("=" in words[0] and not words[0].startswith("-")):
            words = words[1:]
        if words and words[0].rsplit("/", 1)[-1] in ("mpirun", "mpiexec"):
            words = words[3:] if words[1:2] == ["-n"] else words[1:]
        if words:
            out.append((where, words))
    return out


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every command line in the README's bash blocks and configs/*.yaml headers."""
    lines = []
    block = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            block = line.startswith("```bash")
        elif block:
            lines.append(("README.md", line))
    for path in sorted((README.parent / "configs").glob("*.yaml")):
        lines += [(path.name, ln[1:]) for ln in path.read_text().splitlines() if re.match(r"#\s+(mpirun|splash-)", ln)]
    return _command_words(lines)


def _help_examples(capsys) -> list[tuple[str, list[str]]]:
    """Every example command line in the --help texts of splash-serve, splash-sim (and its subcommands) and every
    splash-bench subcommand."""
    from splash.bench.cli import SUBCOMMANDS

    commands = [["splash-serve"], ["splash-sim"], *(["splash-sim", s] for s in ("paper", "mechanisms", "gap")),
                *(["splash-bench", s] for s in SUBCOMMANDS)]
    lines = []
    example = re.compile(r"^\s+(OMP_NUM_THREADS=\S+\s+)?(\S*/)?(mpirun|mpiexec|splash-(serve|sim|bench))\s")
    for cmd in commands:
        text = _help_text(cmd, capsys)
        pending = False
        for line in text.splitlines():
            if example.match(line) or pending:
                lines.append((" ".join(cmd) + " --help", line))
                pending = line.rstrip().endswith("\\")
    return _command_words(lines)


def test_every_documented_command_takes_the_flags_it_is_shown_with(capsys):
    """README: "every command it shows must run as shown" — at least, each SPLASH command line of the README, of
    configs/*.yaml and of the commands' own --help examples names a subcommand and flags that command has, and the
    input files it names exist."""
    seen = 0
    for where, words in _documented_commands() + _help_examples(capsys):
        text = _help_text(words, capsys)
        if text is None:
            continue
        seen += 1
        for flag in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{where}: {' '.join(words)}: {flag}"
        for opt, value in zip(words, words[1:]):
            if opt in ("--config", "--workload", "--trace") and value.endswith((".yaml", ".json")):
                assert (README.parent / value).exists(), f"{where}: {' '.join(words)}: {value}"
    assert seen >= 20


def test_the_python_floor_pyproject_declares_runs_the_code():
    """pyproject's `requires-python` is a promise: vermin (the minimum-version detector) finds nothing in splash/,
    backends/ or scripts/ that needs a newer Python than its floor."""
    import subprocess
    import sys
    import tomllib

    floor = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor.startswith(">="), floor
    res = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--violations", "--eval-annotations",
                          f"-t={floor[2:].strip()}-", "splash", "backends", "scripts"],
                         cwd=README.parent, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


def test_the_fields_without_a_flag_are_the_ones_configs_cpu_yaml_names():
    """configs/cpu.yaml: "Every field but parallel.world_size and cache.layout_kv_dtypes can be overridden by the
    matching flag" (it said every field)."""
    from splash.cli.args import FLAGS
    from splash.config.serve_config import FIELD_SECTION

    without = {f"{FIELD_SECTION[name]}.{name}" for name in set(FIELD_SECTION) - {f[1] for f in FLAGS}}
    header = (README.parent / "configs" / "cpu.yaml").read_text().split("\n\n")[0]
    named = set(re.findall(r"\b(?:model|parallel|layout|cache|scheduler|server)\.[a-z_]+", header))
    assert without == named == {"parallel.world_size", "cache.layout_kv_dtypes"}


# Names the docs give that are not SPLASH's code, each with why it is named.
NOT_OURS = {
    "CUDA_HOME": "flashinfer's nvcc lookup", "CUDA_PATH": "flashinfer's nvcc lookup",
    "FLASHINFER_CUBIN_DIR": "flashinfer's cubin folder", "repack_fp8_kv_to_bf16": "flashinfer's FP8 dequantiser",
    "moe_combine": "a CPU kernel named as removed", "in_r": "notation", "used_r": "notation", "total_": "notation",
}
_CODE_DIRS = ("splash", "backends", "scripts", "tests", "benchmarks")


def _docs_and_helps(capsys) -> dict[str, str]:
    """Every text whose claims are promises: README, docs/*.md but the historical record (benchmarks.md), the
    comments of configs/**/*.yaml, and the --help of every command."""
    from splash.bench.cli import SUBCOMMANDS

    root = README.parent
    texts = {str(p.relative_to(root)): p.read_text() for p in [README, *sorted((root / "docs").glob("*.md"))]
             if p.name != "benchmarks.md"}
    for p in sorted((root / "configs").rglob("*.yaml")):
        texts[str(p.relative_to(root))] = "\n".join(ln.split("#", 1)[1] for ln in p.read_text().splitlines()
                                                     if "#" in ln)
    commands = [["splash-serve"], ["splash-sim"], *(["splash-sim", s] for s in ("paper", "mechanisms", "gap")),
                *(["splash-bench", s] for s in SUBCOMMANDS)]
    for cmd in commands:
        texts[" ".join(cmd) + " --help"] = _help_text(cmd, capsys)
    return texts


def _named(text: str) -> tuple[set[str], set[str], set[str], set[str]]:
    """(paths, test names, identifiers, dotted names) a text names: repository paths; test_... names (a trailing
    `*` kept as a prefix); backticked identifiers with an underscore or in CamelCase; backticked dotted names."""
    paths = {p.rstrip(".,;:)") for p in re.findall(r"(?<![\w/.-])((?:%s|configs)/[\w./-]++)(?!`? at commit)"
                                                   % "|".join(_CODE_DIRS), text) if "test_X" not in p}
    tests = {m.group(1) + m.group(2) for m in re.finditer(r"\b(test_\w+)(\*?)", text)
             if not re.fullmatch(r"test_[A-Z]", m.group(1))}
    idents = {n for n in re.findall(r"`([A-Za-z_]\w*)(?:\(|`)", text)
              if ("_" in n.strip("_") or n.startswith("_") or re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", n))
              and not n.startswith("splash_")}   # metric names: test_the_readme_names_every_metric_...
    dotted = set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(|`)", text))
    return paths, tests, idents, dotted


def test_every_file_and_name_the_docs_give_is_in_the_code(capsys):
    """A doc that names a file, a test, a function, class or constant promises it is there: each path the README,
    docs/*.md (not the historical record), the configs' comments and every --help name exists; each test name is a
    test (or a test file); each backticked identifier (snake_case with an underscore, CamelCase, `_private`) and the
    last part of each backticked dotted name is a name in splash/, backends/, scripts/, tests/ or benchmarks/ —
    or one of NOT_OURS (another project's, or notation). (backends.md named `_load_queries` after the Triton
    kernels' refactor had made it `_start_rows`.)"""
    root = README.parent
    code = "\n".join(p.read_text() for d in _CODE_DIRS for ext in ("py", "sh") for p in (root / d).rglob(f"*.{ext}")
                     if p.name != "test_claims.py")   # this file quotes names the docs got wrong
    words = set(re.findall(r"\w+", code)) | set(re.findall(r"\w+", (root / ".importlinter").read_text()))
    tests = set(re.findall(r"def (test_\w+)", code)) | {p.stem for p in (root / "tests").rglob("test_*.py")}
    missing = []
    for where, text in _docs_and_helps(capsys).items():
        paths, named_tests, idents, dotted = _named(text)
        missing += [(where, p) for p in paths if not (root / p).exists() and not (root / f"{p}.py").exists()]
        missing += [(where, t) for t in named_tests
                    if not (any(n.startswith(t[:-1]) for n in tests) if t.endswith("*") else t in tests)]
        missing += [(where, n) for n in idents if n not in words and n not in NOT_OURS]
        missing += [(where, d) for d in dotted if d.rsplit(".", 1)[1] not in words and d not in NOT_OURS]
    assert missing == [], missing


def _parsers() -> list[tuple[str, object]]:
    """(command, argparse parser) of splash-sim, its subcommands and every splash-bench subcommand (splash-serve's
    help prints its defaults from ServeConfig itself)."""
    import argparse

    from splash.bench.cli import build_parser as bench_parser
    from splash.sim.cli import build_parser as sim_parser
    from splash.sim.cli import main as sim_main

    class Built(Exception):
        pass

    out = [("splash-sim", sim_parser())]
    parse = argparse.ArgumentParser.parse_args

    def built(self, *args, **kwargs):
        raise Built(self)
    argparse.ArgumentParser.parse_args = built   # each subcommand builds its parser in its main
    try:
        for sub in ("paper", "mechanisms", "gap"):
            try:
                sim_main([sub])
            except Built as b:
                out.append((f"splash-sim {sub}", b.args[0]))
    finally:
        argparse.ArgumentParser.parse_args = parse
    bench, _ = bench_parser()
    subs = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return out + [(f"splash-bench {name}", p) for name, p in subs.choices.items()]


def test_every_default_a_help_text_states_is_the_flags_default():
    """`--output-len ... (default 1024)`, `--repeats N ... [3]`: where a splash-sim or splash-bench help text
    states a literal default (a number, a word, a comma list), it is the value the flag takes when not given."""
    literal = re.compile(r"[\w.]+(,[\w.]+)*")
    seen = 0
    for prog, parser in _parsers():
        for action in parser._actions:
            text = " ".join((action.help or "").split())
            for m in re.finditer(r"(?:\(|\[|; )default:? ([^)\];,]+(?:,[^)\];, ]+)*)[)\]]|\[([^\]]+)\]$", text):
                claim = (m.group(1) or m.group(2)).split(" = ")[0].split(":")[0].strip()
                if not literal.fullmatch(claim):
                    continue   # "the preset's", "3.2 GiB", "DeepSeek-V3's 129280": described, not a literal
                value = action.default
                shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
                assert claim == shown, f"{prog} {action.option_strings}: help says {claim!r}, default is {shown!r}"
                seen += 1
    assert seen >= 10
