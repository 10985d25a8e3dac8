"""`make gpu-check`: the GPU tests and every headline GPU figure in one call of at most 5 minutes on one H200,
each result written the moment it exists, so a call cut short still returns what finished, and a second call
(`--only` the rows not reached) fits in the same 15 minutes of GPU time (docs/gpu.md).

Sections, in order, each with its own time limit; before each part the global deadline (--deadline-s, from this
process's start) is checked, and a part it cuts is reported as not measured, with why:
  env      versions, the GPU, the packages that load, a bf16 matmul and an nvJPEG decode (benchmarks/gpu_env.py);
           always runs, about 5 s;
  data     the shapes JPEGs of the ResNet-18 loader rows and the mixed-size JPEG folder (benchmarks/photos.py),
           generated on every core in a background process while the tests run;
  tests    the GPU tests (`pytest -m gpu`): GPU_TESTS, a stated selection covering every CUDA path but the compiling
           tests (--tests all runs every one); stopped with SIGINT at the limit, so pytest still writes its JUnit XML
           (benchmarks/gpu_parts.py);
  rows     benchmarks/gpu_rows.py's check_rows: ResNet-50 at 224 px first (compiled ceiling, mixed JPEGs decoded on
           the GPU and on the CPU), then ResNet-18 at 32 px (ceiling, DataLoader with auto workers and with tune's
           choice), the CUDA-graphs ceilings and DataLoader row; each with its own limit (a row cut by it is not
           measured: a stopped run writes no summary);
  profile  the JPEG row furthest below its ceiling again, profiled (its top operators, its trace).
Files in --out (at most 8, what a remote call to the GPU box returns): gpu-check.json and gpu-check.md (the table,
rewritten after every part), gpu-check.log, pytest.log, pytest.xml, data.log, runs.tar.gz (each row's log and
metrics, the profile's table and trace).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import gpu_env  # benchmarks/gpu_env.py
import gpu_parts  # benchmarks/gpu_parts.py
import gpu_rows  # benchmarks/gpu_rows.py
import gpu_table  # benchmarks/gpu_table.py
import photos  # benchmarks/photos.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from imgtrain.host.cpus import available_cpus  # noqa: E402  (imports no torch)

ENV_LIMIT_S, TESTS_LIMIT_S, DATA_GRACE_S = 60, 90, 20
MIN_START_S = gpu_parts.MIN_START_S


class Check:
    """The check's state: where it writes, its deadline, and the report it rewrites after every part."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started = args, time.monotonic()
        self.out, self.workdir = args.out.resolve(), args.workdir.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.workdir / "runs").mkdir(parents=True, exist_ok=True)
        self.scale = gpu_rows.QUICK if args.quick else gpu_rows.FULL
        self.env = {**os.environ, "IMGTRAIN_DATA_DIR": str(self.workdir / "data"), "PYTHONUNBUFFERED": "1"}
        self.report: dict = {
            "kind": "imgtrain gpu-check",
            "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "commit": args.commit or gpu_env.commit(),
            "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
            "quick": args.quick,
            "deadline_s": args.deadline_s,
            "sections": {},
            "rows": [],
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.args.deadline_s - self.elapsed()

    def log(self, line: str) -> None:
        text = f"[{self.elapsed():6.1f} s] {line}"
        print(text, flush=True)
        with open(self.out / "gpu-check.log", "a") as f:
            f.write(text + "\n")

    def save(self) -> None:
        """The JSON and the table, each replaced whole (a cut call never leaves half a file)."""
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        for name, text in (("gpu-check.json", json.dumps(self.report, indent=2) + "\n"),
                           ("gpu-check.md", gpu_table.render(self.report))):  # fmt: skip
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def run(
        self, argv: list[str], limit: float, log: Path, stop: int = signal.SIGTERM, env: dict | None = None
    ) -> tuple[int | None, str]:
        """`argv` in a session of its own (`env` added to the check's), output to `log`; at `limit` seconds its group
        gets `stop` (pytest still writes its JUnit XML on SIGINT; train.py stops its workers on SIGTERM), then
        SIGKILL after DATA_GRACE_S. (exit status, "" or how it was cut)."""
        by = "the deadline" if limit >= self.left() else "its limit"
        with open(log, "ab") as output, stoppable_children():
            process = subprocess.Popen(argv, cwd=ROOT, env=self.env | (env or {}), stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                return process.wait(timeout=max(1.0, limit)), ""
            except subprocess.TimeoutExpired:
                stop_group(process, stop)
                return process.returncode, f"cut at {limit:.0f} s by {by}"


@contextlib.contextmanager
def stoppable_children() -> Iterator[None]:
    """Children started in the block start with SIGINT at its default. A shell starts a background job (`make
    gpu-check &`, nohup) with SIGINT ignored, which exec keeps: pytest, then, never saw the limit's SIGINT, ran
    on to the SIGKILL DATA_GRACE_S later and wrote no JUnit XML. A handler, unlike SIG_IGN, is reset by exec."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_group(process: subprocess.Popen, first: int) -> None:
    """`first` to the process's group, SIGKILL after DATA_GRACE_S if it has not ended."""
    for sig, wait in ((first, DATA_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def section_env(check: Check) -> dict:
    """Always runs (a few seconds): the versions and checks every later part reads."""
    started, log = time.monotonic(), check.workdir / "env.log"
    log.write_text("")
    status, cut = check.run([*gpu_rows.python(), str(ROOT / "benchmarks" / "gpu_env.py")], ENV_LIMIT_S, log)
    lines = log.read_text().strip().splitlines()
    result: dict = {"seconds": round(time.monotonic() - started, 1), "limit_s": ENV_LIMIT_S}
    try:
        result |= {"status": "ran", **json.loads(lines[-1])}
    except (IndexError, json.JSONDecodeError):
        result["status"] = f"failed: {cut or (lines[-1] if lines else f'exit {status}')}"
    check.log(
        f"env: {result['status']}: " + "; ".join(f"{c['check']}: {c['detail']}" for c in result.get("checks", []))
    )
    return result


def make_data(workdir: Path, quick: bool) -> dict:
    """The datasets the rows read (`--make-data`, the background process): the shapes tree r18_dataloader's
    train.py finds as its own, then the mixed-size JPEG folder."""
    from imgtrain.data.shapes import ensure_shapes

    scale, started = gpu_rows.QUICK if quick else gpu_rows.FULL, time.monotonic()
    train, val = gpu_rows.shapes_counts(scale)
    shapes = ensure_shapes(str(workdir / "data" / "shapes"), 32, train, val, 0, processes=available_cpus())
    print(f"shapes: {train} + {val} JPEGs of 32 px in {time.monotonic() - started:.1f} s: {shapes}", flush=True)
    counts, side = photos.spec(quick)
    folder = photos.ensure_folder(workdir / "data" / "photos", counts, scale=side, processes=available_cpus())
    described = photos.describe(folder)
    print(f"photos in {time.monotonic() - started:.1f} s: {photos.summary(described)}", flush=True)
    result = {"shapes": shapes, "photos": described, "seconds": round(time.monotonic() - started, 1)}
    (workdir / "data.json").write_text(json.dumps(result))
    return result


def start_data(check: Check, cuda: bool | None) -> subprocess.Popen | None:
    """The generator, in the background; not where no row would read its files."""
    (check.workdir / "data.json").unlink(missing_ok=True)
    why = "no CUDA device on this machine" if cuda is False and not check.args.quick else None
    why = why or (f"the deadline ({check.args.deadline_s:.0f} s)" if check.left() < MIN_START_S else None)
    if why:
        check.report["sections"]["data"] = {"status": f"not started: {why}"}
        return None
    argv = [*gpu_rows.python(), __file__, "--make-data", f"--workdir={check.workdir}"]
    argv += ["--quick"] if check.args.quick else []
    output = open(check.out / "data.log", "ab")  # noqa: SIM115 - open while the process runs
    process = subprocess.Popen(argv, cwd=ROOT, env=check.env, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    check.report["sections"]["data"] = {"status": "started in the background"}
    return process


def data_ready(check: Check, process: subprocess.Popen | None) -> dict:
    """The datasets, waiting for the background process until the deadline; {"error": why} if they are not there."""
    section = check.report["sections"]["data"]
    if "result" in section or "error" in section:
        return section
    if process is None:
        section["error"] = section["status"]
        return section
    started = time.monotonic()
    try:
        process.wait(timeout=max(1.0, check.left()))
    except subprocess.TimeoutExpired:
        stop_group(process, signal.SIGTERM)
        section["error"] = "not generated before the deadline"
        return section
    done = check.workdir / "data.json"
    if process.returncode == 0 and done.exists():
        section |= {"status": "ready", "result": json.loads(done.read_text())}
    else:
        lines = (check.out / "data.log").read_text().strip().splitlines()
        section["error"] = f"the generator failed: {lines[-1] if lines else process.returncode}"
    section["waited_s"] = round(time.monotonic() - started, 1)  # the rows' wait for it, after the tests
    check.log(f"data: {section.get('error') or section['status']} (waited {section['waited_s']} s)")
    return section


def measure(check: Check, row: gpu_rows.Row, cuda: bool | None, data: dict | None) -> dict:
    """One row: its train.py run's figures, or "not measured: <why>"."""
    entry = {"key": row.key, "what": row.what, "note": row.note, "limit_s": row.limit_s}
    entry |= dict(zip(("max_steps", "skip_first_steps", "log_every_n_steps"), row.steps, strict=True))
    args = [*row.args, "checkpoint.save=false", "metrics.progress_bar=false"]
    entry["command"] = "python train.py " + " ".join(args)
    if cuda is False and not check.args.quick:
        return entry | {"not_measured": gpu_rows.NOT_MEASURED}
    if check.left() < MIN_START_S:
        return entry | {"not_measured": f"not measured: the deadline ({check.args.deadline_s:.0f} s) came first"}
    if row.needs and "error" in (data or {}):
        return entry | {"not_measured": f"not measured: the {row.needs} dataset: {data['error']}"}
    run_dir = check.workdir / "runs" / row.key
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier call's metrics.json is not this run's
    run_dir.mkdir(parents=True)
    log = run_dir / "output.log"
    limit = min(row.limit_s, check.left())
    check.log(f"row {row.key}: limit {limit:.0f} s: {entry['command']}")
    started = time.monotonic()
    status, cut = check.run([*gpu_rows.python(), "train.py", *args, f"hydra.run.dir={run_dir}"], limit, log)
    entry["wall_s"] = round(time.monotonic() - started, 1)
    metrics = run_dir / "metrics.json"
    if metrics.exists() and status == 0:
        return entry | gpu_rows.figures(json.loads(metrics.read_text()))
    lines = log.read_text(errors="replace").strip().splitlines()
    why = cut or (lines[-1] if lines else f"exit status {status}")
    return entry | {"not_measured": f"not measured: {why[:300]}"}


def photos_folder(check: Check) -> Path:
    """The mixed-size JPEG folder the decoder part and the ResNet-50 rows read."""
    counts, side = photos.spec(check.args.quick)
    return photos.folder_for(check.workdir / "data" / "photos", counts, scale=side)


def section_rows(check: Check, cuda: bool | None, data_process: subprocess.Popen | None) -> list[gpu_rows.Row]:
    """The headline rows, each judged as it ends; the rows, for the profile part."""
    workers = 1 if check.args.quick else "auto"  # auto: the cores left beside the training process's threads
    # the decoder part's fastest GPU decoder, or --gpu-decoder's where it did not run (a second call, --only)
    chosen = check.report["sections"].get("decoders", {}).get("chosen") or check.args.gpu_decoder
    rows = gpu_rows.check_rows(check.scale, str(photos_folder(check)), workers, chosen)
    if check.args.only:  # row keys, and "decoders" for the decoder part
        rows = [row for row in rows if row.key in check.args.only.split(",")]
    check.report["pending"] = [row.key for row in rows]
    # Every row waits for the generator to end, whether it reads its files or not: 16 processes drawing images
    # beside a measured run would slow it
    data = data_ready(check, data_process) if check.left() >= MIN_START_S else None
    for row in rows:
        entry = measure(check, row, cuda, data if row.needs else None)
        entry |= gpu_table.judge(row.target, entry, check.report["rows"])
        check.report["rows"].append(entry)
        check.report["pending"].remove(row.key)
        check.log(f"row {row.key}: {gpu_table.brief(entry)}")
        check.save()
        archive_runs(check)
    return rows


def archive_runs(check: Check) -> None:
    """runs.tar.gz: each row's output.log, metrics.json and loader_args.json (not its TensorBoard events)."""
    tmp = check.out / ".runs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        kept = ("output.log", "metrics.json", "loader_args.json", "failed.json")
        for path in sorted((check.workdir / "runs").glob("*/*")):
            if path.is_file() and path.name in kept:
                tar.add(path, arcname=str(path.relative_to(check.workdir)))
        for path in sorted((check.workdir / "runs" / "profile" / "profile").glob("*")):  # the profiled row's
            if path.suffix in (".txt", ".gz"):
                tar.add(path, arcname=str(path.relative_to(check.workdir)))
    os.replace(tmp, check.out / "runs.tar.gz")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check", help="where the results go")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/imgtrain-gpu-check"), help="datasets and runs")
    parser.add_argument("--deadline-s", type=float, default=300, help="no part starts later (default 300 s)")
    parser.add_argument("--tests", choices=("stated", "all", "none"), default="stated", help="which GPU tests")
    parser.add_argument("--tests-limit-s", type=float, default=TESTS_LIMIT_S, help="the tests' own limit")
    parser.add_argument("--only", help="comma-separated row keys to run (default: every row)")
    parser.add_argument("--no-decoders", dest="decoders", action="store_false", help="leave out the decoder part")
    parser.add_argument(
        "--gpu-decoder", help="dataset.gpu_decoder for r50_jpeg_cuda when the decoder part does not run"
    )
    parser.add_argument("--commit", help="the commit the tree is (the GPU box has no .git)")
    parser.add_argument("--quick", action="store_true", help="rows scaled down: a smoke test, not figures")
    parser.add_argument("--make-data", action="store_true", help=argparse.SUPPRESS)  # the background process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.make_data:
        make_data(args.workdir.resolve(), args.quick)
        return 0
    check = Check(args)
    for name in ("gpu-check.log", "data.log", "pytest.log"):  # this call's, not an earlier one's
        (check.out / name).write_text("")
    check.log(f"gpu-check: deadline {args.deadline_s:.0f} s, results in {check.out}, work in {check.workdir}")
    check.save()
    check.report["sections"]["env"] = env = section_env(check)
    check.report["machine"] = env.get("machine", {})
    check.save()
    cuda = env["machine"].get("cuda_available") if "machine" in env else None  # None: unknown, the rows try
    data_process = start_data(check, cuda)
    check.report["sections"]["tests"] = tests = gpu_parts.section_tests(check, env.get("packages", {}))
    check.save()
    try:
        only = check.args.only.split(",") if check.args.only else ["decoders"]
        if check.args.decoders and "decoders" in only and (cuda is not False or check.args.quick):  # quick: the host
            data = data_ready(check, data_process) if check.left() >= MIN_START_S else {"error": "the deadline"}
            check.report["sections"]["decoders"] = gpu_parts.section_decoders(check, photos_folder(check), data)
            check.save()
        rows = section_rows(check, cuda, data_process)
        check.report["sections"]["profile"] = gpu_parts.section_profile(check, rows)
        archive_runs(check)
    finally:
        if data_process is not None and data_process.poll() is None:
            stop_group(data_process, signal.SIGTERM)
    check.report["finished"] = True
    check.save()
    check.log(f"done in {check.elapsed():.0f} s: {check.out / 'gpu-check.md'}")
    return 1 if tests.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
