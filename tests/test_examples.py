"""Every example runs (so none can rot) and prints what it promises; the outputs that
``docs/recipes.md`` shows are what the examples print."""

from __future__ import annotations

import atexit
import csv
import importlib.util
import os
import re
import runpy
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import distributed_pool
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RECIPES_PAGE = ROOT / "docs" / "recipes.md"
# Extra arguments that keep a test run short, and a string the output must contain.
# Examples run with the test's tmp_path as working directory: relative paths land there.
RUNS: dict[str, tuple[list[str], str]] = {
    "quickstart.py": ([], "recall@10:"),
    "embedding_recall.py": ([], "random projection (16-d)"),
    "lightning_digits.py": (
        ["--epochs", "1", "--plot", "curve.png"],
        "saved the Recall@K curve to curve.png",
    ),
    "cross_modal.py": ([], "with ids, the result equals each image added once by hand: True"),
    "reid_protocol.py": ([], "4. Market-1501: + skip queries w/o a match"),
    "torchmetrics_collection.py": ([], "recall@K equals torchmetrics' hit rate@K: True"),
    "compare_models.py": (
        ["--plot", "compare.png"],
        "the Wilson intervals of A and B overlap at every K: True\n"
        "yet the paired test tells them apart at K = 1: True\n"
        "saved both CMC curves to compare.png",
    ),
    # One process here; two under torch.distributed.run in their own tests below.
    "torchrun_evaluation.py": (
        [],
        "one process on the whole dataset gives the same values, bit for bit: True",
    ),
    "huggingface_trainer.py": (
        [],
        "streamed through compute_metrics, batch by batch, equals one call on all 360"
        " evaluation embeddings: True",
    ),
    "lightning_tensorboard.py": ([], "view them with: tensorboard --logdir"),
}
# What an example needs beyond the package's dependencies (all in the ``test`` extra).
NEEDS = {
    "huggingface_trainer.py": ("transformers", "accelerate"),  # transformers[torch]
    "lightning_tensorboard.py": ("tensorboard",),
}
TABLE_HEADER = "epoch  train loss     val R@1     val R@5    val R@10"

# docs/recipes.md shows what a command prints in a ```text block after the line
# ``<!-- recipe-output: COMMAND -->``. COMMAND is ``python examples/NAME.py`` (checked by
# test_example_runs, which runs it so) or TWO_PROCESSES (checked by its own test). The
# page's text must be what the command prints, except that a line ``...`` stands for any
# lines and ``...`` in a line for any text; and that a decimal number may be off by the
# example's TOLERANCE: the recipes that fit or train a model round a little differently
# on another machine or thread count (the page says so). Other numbers are exact.
OUTPUT_MARKER = re.compile(r"^<!-- recipe-output: (.+) -->$")
TWO_PROCESSES = "torchrun --standalone --nproc_per_node 2 examples/torchrun_evaluation.py"
TOLERANCE = {
    "cross_modal.py": 0.01,
    "huggingface_trainer.py": 0.05,
    "lightning_tensorboard.py": 0.05,
}
PAGE_TORCH = "2.15.0"
"""The torch of the page's numbers: CI's first leg, the newest torch on PyPI when the page
was last checked (the README's tested versions name it). With another torch (and the
transformers and Lightning beside it) a model initialises and draws its random numbers
differently: the recipes that fit or train one are checked there for their text alone
(torch 2.4.1 and transformers 4.41 trained the Hugging Face recipe to 0.5278 where the
page shows 0.4778)."""
DECIMAL = r"\d+\.\d+"


# One thread a process: the examples are small, and on a busy or shared CI machine more
# threads only contend (this made some runs several times slower). Nothing is downloaded.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


TIMEOUT_S = 300
"""Seconds an example may run before it is killed and its test fails."""
OWN_PROCESS = {"huggingface_trainer.py"}
"""Examples run as a new process: transformers and huggingface_hub read ``HF_HUB_OFFLINE``
when imported, which in a forked process (:func:`_run`) they were before it was set."""


def _run(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python examples/NAME ARGS`` in ``cwd``: for most examples in a process forked from
    the server that imported torch and the package once (``tests/distributed_pool.py``),
    which runs the file as ``__main__`` with the script's ``sys.argv``, ``sys.path[0]``,
    environment and exit handlers: a new interpreter spends seconds importing them."""
    command = [sys.executable, str(EXAMPLES / name), *args]
    if name in OWN_PROCESS:
        return _subprocess(command, cwd)
    out, err = cwd / f".{name}.stdout", cwd / f".{name}.stderr"
    process = distributed_pool.forked(_run_as_main, (command[1:], str(cwd), str(out), str(err)))
    process.join(TIMEOUT_S)
    if process.is_alive():  # kill it with every process it started, as _subprocess does
        os.killpg(process.pid, signal.SIGKILL)
        process.join()
        pytest.fail(f"{command} did not end within {TIMEOUT_S} s:\n{err.read_text()[-3000:]}")
    assert process.exitcode is not None
    stdout, stderr = out.read_text(encoding="utf-8"), err.read_text(encoding="utf-8")
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)


def _run_as_main(argv: list[str], cwd: str, out: str, err: str) -> None:
    """In the forked process: what ``python ARGV`` does with its script, its output to
    ``out`` and ``err``, in a session of its own (which a timeout kills whole)."""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(ENV)
    os.chdir(cwd)
    torch.set_num_threads(1)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).parent))
    code: int | str | None = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _launch(name: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The example on two processes, as ``torchrun --standalone --nproc_per_node 2`` runs
    it (the module form: the ``torchrun`` script may not be on a virtual env's PATH)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return _subprocess([*command, "--nproc_per_node", "2", str(EXAMPLES / name)], cwd)


def _subprocess(
    command: list[str], cwd: Path, timeout: int = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; on a timeout, kill it with every process it started (torchrun's
    workers too), so that a hang fails the test instead of outliving it."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=ENV,
        start_new_session=True,  # its own process group, which a timeout kills whole
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(
                f"{command} did not end within {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}"
            )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _skip_unless_installed(name: str) -> None:
    missing = [module for module in NEEDS.get(name, ()) if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(
            f"{name} needs {' and '.join(missing)}: not installed here"
            " (the test extra has them: pip install -e '.[test]')"
        )


def test_every_example_is_run_by_a_test() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str, tmp_path: Path) -> None:
    _skip_unless_installed(name)
    args, expected = RUNS[name]
    done = _run(name, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
    command = " ".join(["python", f"examples/{name}", *args])
    if command in page_outputs():
        check_page_output(command, done.stdout)
    if name == "lightning_tensorboard.py":
        _check_tensorboard_run(tmp_path / "lightning_logs", epochs=3)
    if name == "lightning_digits.py":
        _check_digits_run(done.stdout, epochs=1)
        assert (tmp_path / "curve.png").stat().st_size > 0
    if name == "compare_models.py":
        assert (tmp_path / "compare.png").stat().st_size > 0
        for key in ("recall@1", "recall@5", "recall@10"):
            assert key in done.stdout


def _table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if TABLE_HEADER in line) + 1
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != 5 or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


def _check_digits_run(stdout: str, epochs: int) -> None:
    """One table, printed by one process, one row per epoch, recalls that make sense."""
    assert stdout.count(TABLE_HEADER) == 1, stdout
    rows = _table_rows(stdout)
    assert [row[0] for row in rows] == [str(e) for e in range(1, epochs + 1)], stdout
    for row in rows:
        recalls = [float(cell) for cell in row[2:]]
        assert 0.5 < recalls[0] <= recalls[1] <= recalls[2] <= 1.0, stdout


@pytest.mark.ddp
def test_lightning_digits_runs_with_ddp_on_cpu(tmp_path: Path) -> None:
    """``--devices 2``: two CPU processes (gloo); the first prints the table and the plot."""
    done = _run(
        "lightning_digits.py", ["--devices", "2", "--epochs", "1", "--plot", "ddp.png"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check_digits_run(done.stdout, epochs=1)
    assert "saved the Recall@K curve to ddp.png" in done.stdout
    assert (tmp_path / "ddp.png").stat().st_size > 0


# ------------------------------------------------------------------ the recipes page


def page_outputs() -> dict[str, str]:
    """The outputs docs/recipes.md shows, by the command that prints them."""
    lines = RECIPES_PAGE.read_text(encoding="utf-8").splitlines()
    outputs = {}
    for number, line in enumerate(lines):
        marker = OUTPUT_MARKER.match(line)
        if marker is None:
            continue
        assert lines[number + 1] == "```text", (
            f"recipes.md:{number + 1}: a ```text block must follow"
        )
        end = lines.index("```", number + 2)
        outputs[marker.group(1)] = "".join(f"{text}\n" for text in lines[number + 2 : end])
    return outputs


def output_matches(shown: str, printed: str, tolerance: float) -> str | None:
    """Why ``printed`` is not the output the page ``shown``, or None when it is."""
    pattern, numbers = "", []
    for line in shown.splitlines():
        if line == "...":
            pattern += r"(?:[^\n]*\n)*?"
            continue
        for piece in re.split(rf"(\.\.\.|{DECIMAL})", line):
            if piece == "...":
                pattern += r"[^\n]*?"
            elif re.fullmatch(DECIMAL, piece):
                pattern += f"({DECIMAL})"
                numbers.append(float(piece))
            else:
                pattern += re.escape(piece)
        pattern += r"\n"
    match = re.fullmatch(pattern, printed)
    if match is None:
        return "the text differs"
    for got, want in zip(match.groups(), numbers, strict=True):
        if abs(float(got) - want) > tolerance:
            return f"printed {got} where the page shows {want} (tolerance {tolerance})"
    return None


def check_page_output(command: str, stdout: str) -> None:
    name = Path(command.split()[-1]).name
    tolerance = TOLERANCE.get(name, 0.0)
    if tolerance and torch.__version__.split("+")[0] != PAGE_TORCH:
        tolerance = 1.0  # any recall: the text and the exact numbers are still checked
    problem = output_matches(page_outputs()[command], stdout, tolerance)
    assert problem is None, f"docs/recipes.md, {command!r}: {problem}. It printed:\n{stdout}"


def test_the_page_numbers_come_from_the_torch_of_ci_first_leg() -> None:
    """CI's first leg installs the newest torch; the page and the README name the one it
    was when the page's numbers were last checked, PAGE_TORCH."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    newest = 'uv pip install --quiet --compile-bytecode --upgrade torch "${torch_index[@]}"\n'
    assert newest in ci
    assert ci.index(newest) < ci.index("leg \"tests: the README's test command")
    page = " ".join(RECIPES_PAGE.read_text(encoding="utf-8").split())
    assert f"with the newest torch on PyPI ({PAGE_TORCH} when this was written)" in page
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"the newest torch, torchmetrics and Lightning on PyPI (torch {PAGE_TORCH}," in readme


def test_every_output_on_the_recipes_page_is_checked() -> None:
    outputs = page_outputs()
    assert TWO_PROCESSES in outputs
    for command in outputs:
        if command != TWO_PROCESSES:
            python, path = command.split()  # "python examples/NAME.py": no arguments
            assert python == "python" and path.startswith("examples/"), command
            assert RUNS[Path(path).name][0] == [], f"{command}: its test runs it with arguments"


@pytest.mark.parametrize(
    ("shown", "printed", "tolerance", "ok"),
    [
        ("a 0.50\n", "a 0.50\n", 0.0, True),
        ("a 0.50\n", "a 0.51\n", 0.0, False),
        ("a 0.50\n", "a 0.51\n", 0.05, True),
        ("a 0.50\n", "b 0.50\n", 0.05, False),
        ("1,797 x\n", "1,798 x\n", 0.05, False),  # only decimals get a tolerance
        ("a\n...\nd\n", "a\nb\nc\nd\n", 0.0, True),
        ("a\n...\nd\n", "a\nd\n", 0.0, True),
        ("a\n...\nd\n", "a\nb\n", 0.0, False),
        ("a ... d\n", "a b c d\n", 0.0, True),
        ("a\n", "a\nb\n", 0.0, False),  # the page shows all of it, or says ...
    ],
)
def test_output_matching(shown: str, printed: str, tolerance: float, ok: bool) -> None:
    assert (output_matches(shown, printed, tolerance) is None) == ok


# -------------------------------------------------------------- recipes on two processes


def test_torchrun_evaluation_on_two_processes(tmp_path: Path) -> None:
    """Two processes with a DistributedSampler: the first prints the values of the whole
    dataset, equal (bit for bit) to one process; both end cleanly."""
    done = _launch("torchrun_evaluation.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("recall@1 = ") == 1, done.stdout  # printed by one process
    check_page_output(TWO_PROCESSES, done.stdout)


@pytest.mark.slow
def test_huggingface_trainer_on_two_processes(tmp_path: Path) -> None:
    """The Trainer on two processes hands every batch, gathered from both and without the
    sampler's repeats, to compute_metrics: with ``sync_on_compute=False`` the streamed
    value equals one call on the 360 gathered embeddings (the example asserts both)."""
    _skip_unless_installed("huggingface_trainer.py")
    done = _launch("huggingface_trainer.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert RUNS["huggingface_trainer.py"][1] in done.stdout, done.stdout
    tables = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(tables) == 1, done.stdout  # printed by one process


# ------------------------------------------------------------------ TensorBoard files


def _check_tensorboard_run(logdir: Path, epochs: int) -> None:
    """TensorBoard holds every K per epoch, equal to the CSV file, and the curve per epoch."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (csv_file,) = logdir.glob("csv/version_*/metrics.csv")
    with csv_file.open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["val/recall@1"]]
    (run,) = logdir.glob("tensorboard/version_*")
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    for k in (1, 5, 10):
        tag = f"val/recall@{k}"
        logged = [event.value for event in events.Scalars(tag)]
        assert len(logged) == epochs, (tag, logged)
        assert logged == pytest.approx([float(row[tag]) for row in rows], rel=1e-6), tag
        assert all(0.5 < value <= 1.0 for value in logged), (tag, logged)
    curves = events.Images("val/recall@K_curve")
    assert len(curves) == epochs
    for curve in curves:
        assert curve.encoded_image_string.startswith(b"\x89PNG"), curve.encoded_image_string[:8]
        assert curve.width > 0 and curve.height > 0
