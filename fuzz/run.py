"""Run llmgw's fuzz targets (``fuzz/README.md``).

    uv run python fuzz/run.py all --seconds 30
    uv run python fuzz/run.py all --ci
    uv run python fuzz/run.py http1 --seconds 3600 --work /var/tmp/llmgw-fuzz

Each target runs under libFuzzer (atheris) for ``--seconds``, seeded from
``fuzz/corpus/TARGET``; what it adds to the corpus and any crashing input
go to ``--work/TARGET`` (a temporary directory unless given, so a longer
run can be resumed). Prints, per target, the executions, executions per
second, coverage (edges) and features libFuzzer reached, and exits 1 when
a target found a crash, a hang or a failed check, naming the input.

``--ci`` (what ``.ci/run`` uses) makes a run nearly repeatable: seed 1, a
fixed hash seed and a fixed number of executions per target
(:data:`CI_RUNS`, about 20 s each here; ``--seconds`` still caps the time,
which only cuts the sequence shorter). Two such runs reach nearly the same
features (a few paths depend on the clock and on temporary names), so a CI
run mostly retries what was tried when the change was made and fails for a
change that breaks those inputs, rather than for a new finding on an
unchanged tree; finding new inputs is what the longer, unseeded runs are
for (``fuzz/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("http1", "requests", "answers", "sse", "protocol", "settings", "catalog", "joincode")
#: One input taking longer than this, in seconds, is a hang.
INPUT_TIMEOUT_S = 10
#: Memory one target may use, in MB.
RSS_LIMIT_MB = 2048
#: Executions per target under ``--ci`` (about 20 s each on 2 shared cores).
CI_RUNS = {
    "http1": 14_000,
    "requests": 1_800_000,
    "answers": 3_000_000,
    "sse": 140_000,
    "protocol": 1_100_000,
    "settings": 14_000,
    "catalog": 16_000,
    "joincode": 3_400_000,
}
FINAL = re.compile(
    rb"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/\S+.*?exec/s: (\d+)", re.DOTALL
)


def run_target(name: str, seconds: int, work: Path, *, ci: bool = False) -> dict[str, object]:
    corpus = work / name / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(HERE / "targets" / f"fuzz_{name}.py"),
        f"-max_total_time={seconds}",
        f"-timeout={INPUT_TIMEOUT_S}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        "-print_final_stats=1",
        f"-artifact_prefix={work / name}/",
        str(corpus),
        str(HERE / "corpus" / name),
    ]
    dictionary = HERE / "dicts" / f"{name}.dict"
    if dictionary.exists():
        command.insert(2, f"-dict={dictionary}")
    env = dict(os.environ)
    if ci:
        command[2:2] = ["-seed=1", f"-runs={CI_RUNS[name]}"]
        env["PYTHONHASHSEED"] = "0"
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, check=False, env=env)
    output = done.stdout + done.stderr
    result: dict[str, object] = {
        "target": name,
        "seconds": round(time.monotonic() - started, 1),
        "ok": done.returncode == 0,
    }
    final = FINAL.search(output)
    if final:
        runs, cov, ft, units, per_s = (int(x) for x in final.groups())
        result.update(runs=runs, exec_per_s=per_s, cov=cov, ft=ft, corpus=units)
    if done.returncode != 0:
        result["artifacts"] = sorted(
            str(p) for p in (work / name).iterdir() if p.is_file() and "-" in p.name
        )
        result["tail"] = output.decode(errors="replace")[-4000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=(*TARGETS, "all"))
    parser.add_argument("--seconds", type=int, default=30, help="per target (default 30)")
    parser.add_argument("--work", type=Path, help="keep the grown corpus and findings here")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--ci", action="store_true", help="repeatable: seed 1 and a fixed number of runs"
    )
    args = parser.parse_args()
    names = TARGETS if args.target == "all" else (args.target,)
    with tempfile.TemporaryDirectory(prefix="llmgw-fuzz-") as scratch:
        work = args.work or Path(scratch)
        results = []
        for name in names:
            result = run_target(name, args.seconds, work, ci=args.ci)
            results.append(result)
            print(
                f"{name:10} {'ok' if result['ok'] else 'FOUND':5} "
                f"{result.get('runs', '?'):>8} runs  {result.get('exec_per_s', '?'):>6} exec/s  "
                f"cov {result.get('cov', '?'):>5}  ft {result.get('ft', '?'):>5}  "
                f"corpus {result.get('corpus', '?'):>4}  {result['seconds']} s",
                flush=True,
            )
            if not result["ok"]:
                print(result["tail"], file=sys.stderr)
                print(f"{name}: inputs kept: {result['artifacts']}", file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
