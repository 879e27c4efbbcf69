"""Run TRL's own GRPO tests against TRL and against grpo-ascend, offline, and compare.

    python bench/trl_tests_harness.py /tmp/trl/tests/test_grpo_trainer.py [--workers 2] [-k EXPR] [pytest args]

It copies the given test file (from a TRL checkout; nothing of TRL's ships here), the helpers it imports from its
folder (``from .testing_utils import ...``) and that folder's ``conftest.py`` into a temporary package twice:
as is, and with only the import of ``GRPOTrainer`` / ``GRPOConfig`` changed to ``grpo_ascend``'s. Both copies run
under pytest with the installed trl on the same machine, fully offline: the tiny hub models and datasets the
tests load are stand-ins built here (``trl_standin_models.py``, cached under ``--cache``) and served from a
Hugging Face cache folder (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``) and, for datasets, by the pytest plugin
``trl_harness_plugin.py``. It prints each test's outcome on both sides and the counts (tests TRL passes; how
many of those pass with grpo-ascend; vision-language and tool-calling subsets), and writes
``bench/results/trl_tests_<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SIDES = ("trl", "ours")
PACKAGE = "trl_tests"  # not ``tests``: our own tests folder is on the path of the "ours" run
TRAINER_NAMES = {"GRPOTrainer", "GRPOConfig"}
#: ``trl.import_utils.is_<name>_available`` checks the helpers may import that an older trl lacks.
AVAILABILITY = ("joblib", "harbor", "openreward", "mergekit", "math_verify", "jmespath", "liger_kernel", "vllm")


def swap_import(source: str, module: str = "grpo_ascend") -> str:
    """``source`` with ``GRPOTrainer`` / ``GRPOConfig`` imported from ``module`` instead of ``trl`` (other names
    of the same ``from trl import`` line stay imported from trl); an error if no such import exists."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "trl" and node.level == 0:
            names = {alias.name for alias in node.names}
            moved = names & TRAINER_NAMES
            if not moved:
                continue
            kept = [alias for alias in node.names if alias.name not in TRAINER_NAMES]
            new = f"from {module} import {', '.join(sorted(moved))}\n"
            if kept:
                new += "from trl import " + ", ".join(
                    a.name + (f" as {a.asname}" if a.asname else "") for a in kept) + "\n"
            return "".join(lines[: node.lineno - 1]) + new + "".join(lines[node.end_lineno:])
    raise SystemExit(f"no `from trl import GRPOTrainer/GRPOConfig` line in the test file; expected TRL's "
                     f"tests/test_grpo_trainer.py (names searched: {sorted(TRAINER_NAMES)})")


def helper_modules(test_file: Path) -> list[Path]:
    """The files of the test file's folder it imports relatively, transitively, plus the folder's conftest."""
    folder, found, todo = test_file.parent, [], [test_file]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                path = folder / f"{node.module.replace('.', '/')}.py"
                if path.exists() and path not in found:
                    found.append(path)
                    todo.append(path)
    conftest = folder / "conftest.py"
    return found + ([conftest] if conftest.exists() else [])


def hub_ids(source: str) -> tuple[list[str], list[str]]:
    """(model ids, dataset ids) of the stand-ins the test file names and the harness can build."""
    from trl_standin_models import STANDINS

    named = set(re.findall(r'"([\w.-]+/[\w.-]+)"', source))
    models = sorted(named & set(STANDINS))
    datasets = sorted(i for i in named if i.startswith("trl-internal-testing/zen"))
    return models, datasets


def with_config_defaults(source: str, defaults: dict) -> str:
    """``source`` (its import already swapped) with ``GRPOConfig`` replaced by a subclass whose unset ``defaults``
    fields take the given values: our config run with TRL's choice where our defaults differ on purpose."""
    if not defaults:
        return source
    tree = ast.parse(source)
    line = next(node.end_lineno for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "grpo_ascend" and any(a.name == "GRPOConfig" for a in node.names))
    lines = source.splitlines(keepends=True)
    shim = (f"\n\nclass GRPOConfig(GRPOConfig):  # trl_tests_harness --ours-defaults\n"
            f"    def __init__(self, *args, **kwargs):\n"
            f"        super().__init__(*args, **{{**{defaults!r}, **kwargs}})\n\n\n")
    return "".join(lines[:line]) + shim + "".join(lines[line:])


def prepare(test_file: Path, workdir: Path, side: str, ours_defaults: dict | None = None) -> Path:
    """The test package of ``side`` under ``workdir``; returns the copied test file."""
    package = workdir / side / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for helper in helper_modules(test_file):
        shutil.copy(helper, package / helper.name)
    source = test_file.read_text()
    if side == "ours":
        source = with_config_defaults(swap_import(source), ours_defaults or {})
    (package / test_file.name).write_text(source)
    return package / test_file.name


def environment(cache: Path, datasets: dict[str, str], outcomes: Path, side: str, workers: int,
                timeout: int) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(BENCH)] + ([str(ROOT)] if side == "ours" else [])
    env.update(
        PYTHONPATH=os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]),
        HF_HUB_CACHE=str(cache / "hub"), HF_HOME=str(cache / "hf_home"), HF_DATASETS_CACHE=str(cache / "hf_datasets"),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        TRL_HARNESS_DATASETS=json.dumps(datasets), TRL_HARNESS_OUTCOMES=str(outcomes),
        TRL_HARNESS_TEST_TIMEOUT=str(timeout), TRL_HARNESS_AVAILABILITY=",".join(AVAILABILITY),
        TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // max(workers, 1))),
    )
    if side == "trl":  # TRL loads processors with AutoProcessor: the image-only ones where torchvision is missing
        env["TRL_HARNESS_IMAGE_ONLY_FROM"] = str(ROOT)
    if side != "ours":
        env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                            if Path(p).resolve() != ROOT)
    return env


def run_side(side: str, test_copy: Path, env: dict[str, str], workers: int, pytest_args: list[str],
             log: Path) -> float:
    """Run pytest on one side's copy; returns its wall time. Output goes to ``log``."""
    command = [sys.executable, "-m", "pytest", str(test_copy), "-p", "trl_harness_plugin", "-p", "no:cacheprovider",
               "-o", "addopts=", "-q", "-rN", "--rootdir", str(test_copy.parent.parent)]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "load"]
    command += pytest_args
    start = time.time()
    with open(log, "w") as out:
        subprocess.run(command, cwd=test_copy.parent.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                       check=False)
    return time.time() - start


def outcome(record: dict) -> str:
    """One word per test: passed, failed, error (setup / teardown), skipped, xfailed, xpassed."""
    phases = record["phases"]
    if phases.get("setup") == "failed" or phases.get("teardown") == "failed":
        return "error"
    return phases.get("call") or phases.get("setup", "error")


def read_outcomes(path: Path) -> dict[str, dict]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["nodeid"]] = {**record, "outcome": outcome(record)}
    return records


def is_vlm(nodeid: str) -> bool:
    return "VLM" in nodeid or "vlm" in nodeid.split("::")[-1]


def summarise(results: dict[str, dict[str, dict]]) -> dict:
    """Counts over the tests TRL passes: all, the vision-language ones, the tool-calling (jmespath) ones."""
    trl, ours = results["trl"], results.get("ours", {})
    passed_by_trl = sorted(n for n, r in trl.items() if r["outcome"] == "passed")

    def subset(keep) -> dict:
        names = [n for n in passed_by_trl if keep(n)]
        ok = [n for n in names if ours.get(n, {}).get("outcome") == "passed"]
        return {"trl_passes": len(names), "ours_passes": len(ok),
                "failing": [n for n in names if n not in ok]}

    return {
        "collected": len(trl),
        "trl_outcomes": count_outcomes(trl), "ours_outcomes": count_outcomes(ours),
        "all": subset(lambda n: True),
        "vlm": subset(is_vlm),
        "tools": subset(lambda n: trl[n].get("jmespath")),
        "other": subset(lambda n: not is_vlm(n) and not trl[n].get("jmespath")),
        "ours_only": sorted(n for n, r in ours.items()
                            if r["outcome"] == "passed" and trl.get(n, {}).get("outcome") != "passed"),
    }


def count_outcomes(records: dict[str, dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records.values():
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    return dict(sorted(counts.items()))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def trl_commit(test_file: Path, given: str | None) -> str | None:
    if given:
        return given
    done = subprocess.run(["git", "-C", str(test_file.parent), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or None


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("trl", "transformers", "torch", "peft", "datasets", "accelerate")}


def markdown(report: dict) -> str:
    meta, summary, results = report["meta"], report["summary"], report["results"]
    lines = [f"# TRL's GRPO tests against grpo-ascend ({meta['date']})", "",
             f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
             f"- test file: `{meta['test_file']}` (sha256 {meta['test_file_sha256'][:12]}, TRL commit "
             f"{meta['trl_commit']})", "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             "- wall time: " + ", ".join(f"{side} {s:.0f} s" for side, s in meta["seconds"].items()), "",
             "| subset | TRL passes | ours passes (of those) |", "|---|---|---|"]
    for key in ("all", "other", "vlm", "tools"):
        lines.append(f"| {key} | {summary[key]['trl_passes']} | {summary[key]['ours_passes']} |")
    lines += ["", f"TRL's outcomes: {summary['trl_outcomes']}; ours: {summary['ours_outcomes']}.", "",
              "| test | TRL | ours | ours' failure |", "|---|---|---|---|"]
    for nodeid in sorted(results["trl"]):
        trl, ours = results["trl"][nodeid], results.get("ours", {}).get(nodeid, {})
        message = ours.get("message", "") if ours.get("outcome") not in ("passed", None) else ""
        lines.append(f"| `{nodeid.split('::', 1)[-1]}` | {trl['outcome']} | {ours.get('outcome', '-')} | "
                     f"{message.replace('|', '/')[:160]} |")
    if report.get("standin_failures"):
        lines += ["", "Stand-ins that could not be built (their tests fail on both sides):", ""]
        lines += [f"- `{k}`: {v}" for k, v in report["standin_failures"].items()]
    return "\n".join(lines) + "\n"


def print_table(results: dict[str, dict[str, dict]], summary: dict) -> None:
    width = max((len(n.split("::", 1)[-1]) for n in results["trl"]), default=10)
    for nodeid in sorted(results["trl"]):
        ours = results.get("ours", {}).get(nodeid, {})
        print(f"{nodeid.split('::', 1)[-1]:<{width}}  trl={results['trl'][nodeid]['outcome']:<8} "
              f"ours={ours.get('outcome', '-'):<8} {ours.get('message', '')[:100] if ours.get('outcome') != 'passed' else ''}")
    print()
    for key in ("all", "other", "vlm", "tools"):
        print(f"{key:>6}: TRL passes {summary[key]['trl_passes']}, ours passes {summary[key]['ours_passes']} of those")
    print("failing with ours among TRL's passes:")
    for nodeid in summary["all"]["failing"]:
        print("  ", nodeid.split("::", 1)[-1], "--", results.get("ours", {}).get(nodeid, {}).get("message", "")[:140])


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path, help="a TRL checkout's tests/test_grpo_trainer.py")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per side (default 1)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--sides", default="trl,ours", help="which runs: trl, ours or both (default trl,ours)")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "grpo_ascend" / "trl-harness", help="where stand-ins are built (kept between runs)")
    parser.add_argument("--test-timeout", type=int, default=600, help="seconds before one test is failed")
    parser.add_argument("--trl-commit", help="the TRL commit of the test file (default: git rev-parse in its folder)")
    parser.add_argument("--out", type=Path, default=BENCH / "results",
                        help="folder of the JSON / markdown results (default bench/results)")
    parser.add_argument("--name", help="results file name without suffix (default trl_tests_<date>)")
    parser.add_argument("--ours-defaults", type=json.loads, default={}, metavar="JSON",
                        help="our GRPOConfig's defaults changed in our run, e.g. '{\"train_vision_parts\": null}' "
                             "(TRL's choice where ours differs on purpose); the results record it")
    args, rest = parser.parse_known_args(argv)
    if not args.test_file.is_file():
        parser.error(f"test file {args.test_file} not found: pass the path of TRL's tests/test_grpo_trainer.py, "
                     "e.g. extracted with `git --git-dir=<trl mirror> show HEAD:tests/test_grpo_trainer.py > /tmp/t.py`"
                     " next to its tests/testing_utils.py and conftest.py")
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides) or "trl" not in sides:
        parser.error(f"--sides {args.sides!r}: expected 'trl' or 'trl,ours' (the counts are over TRL's passes)")
    args.sides = sides
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, pytest_args = parse_args(argv)
    sys.path.insert(0, str(BENCH))
    from trl_standin_models import build_datasets, build_models

    test_file = args.test_file.resolve()
    source = test_file.read_text()
    models, dataset_ids = hub_ids(source)
    print(f"building stand-ins: {len(models)} models, {len(dataset_ids)} datasets (cached in {args.cache})")
    failures = build_models(args.cache / "hub", models)
    datasets = {k: v for k, v in build_datasets(args.cache / "datasets").items() if k in dataset_ids}
    if args.keyword:
        pytest_args = ["-k", args.keyword, *pytest_args]
    workdir = Path(tempfile.mkdtemp(prefix="trl-harness-"))
    results, seconds = {}, {}
    for side in args.sides:
        copy = prepare(test_file, workdir, side, args.ours_defaults)
        outcomes, log = workdir / f"{side}.jsonl", workdir / f"{side}.log"
        env = environment(args.cache, datasets, outcomes, side, args.workers, args.test_timeout)
        print(f"running {side} ({'-n ' + str(args.workers) if args.workers > 1 else '1 process'}), log {log}")
        seconds[side] = run_side(side, copy, env, args.workers, pytest_args, log)
        results[side] = read_outcomes(outcomes)
        if not results[side]:
            tail = log.read_text().splitlines()[-25:]
            raise SystemExit(f"the {side} run recorded no test; the end of its log ({log}):\n" + "\n".join(tail))
        print(f"  {side}: {count_outcomes(results[side])} in {seconds[side]:.0f} s")
    summary = summarise(results)
    print_table(results, summary)
    date = datetime.date.today().isoformat()
    report = {"meta": {"date": date, "machine": machine(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                       "test_file": str(test_file), "trl_commit": trl_commit(test_file, args.trl_commit),
                       "test_file_sha256": hashlib.sha256(source.encode()).hexdigest(), "versions": versions(),
                       "seconds": seconds, "workdir": str(workdir), "ours_defaults": args.ours_defaults},
              "summary": summary, "results": results, "standin_failures": failures}
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"trl_tests_{date}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (args.out / f"{name}.md").write_text(markdown(report))
    print(f"wrote {args.out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
