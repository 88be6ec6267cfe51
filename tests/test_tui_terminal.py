"""osft-tui in a real terminal: tmux runs the dashboard in a pseudo-terminal of its own, keys are
typed with ``send-keys``, the screen is read with ``capture-pane``, and tmux reports the terminal
modes the dashboard leaves behind.

The run is the torch-free fake trainer (``tests/fake_trainer.py``), launched from the dashboard
(``--launcher``) or started here. Each terminal runs a small shell script that saves ``stty -a``,
runs ``osft-tui`` (``exec``, so its pid is known), then saves its exit status and ``stty -a`` again
and stays open, so the terminal state after the dashboard exits can be checked.

Checked: a launch from the new-run form, ``c`` (one SIGUSR1 to the launcher, a complete checkpoint),
quit → detach (exit 0, run left running); SIGTERM and SIGHUP (exit 128 + N, run left running);
SIGKILL (run goes on, can be re-attached and stopped with ``s``); quit → kill and quit →
checkpoint and stop (no recorded pid left); and after every normal end the terminal is back to
normal: main screen, mouse reporting off, cursor shown, line wrap on, same ``stty -a``. Closing
the terminal itself (tmux kills the session: hangup) must end the dashboard and leave the run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from osft.tui.components.new_run import FIELDS
from tui_support import kill_run, processes_of

TMUX = shutil.which("tmux")
pytestmark = [pytest.mark.slow, pytest.mark.tui_process, pytest.mark.skipif(TMUX is None, reason="tmux is not installed"),
              pytest.mark.skipif(sys.platform != "linux", reason="pseudo-terminals, signals and /proc: Linux only")]

FAKE = Path(__file__).resolve().with_name("fake_trainer.py")
PYTHON = Path(sys.executable)
OSFT_TUI = shutil.which("osft-tui", path=str(PYTHON.parent)) or "osft-tui"
LAUNCHER = shlex.join([str(PYTHON), str(FAKE)])
SIZE = (140, 42)
STEP_S = "0.2"
#: Fake-trainer flags of every run here (the form adds --max-steps and --on-demand-checkpointing).
FAKE_FLAGS = ["--fake-step-seconds", STEP_S, "--checkpoint-grace-seconds", "20"]
WAIT_S = 30.0

#: tmux format variables of the modes a Textual app changes, with their values while it runs.
#: (tmux prints an unknown variable as an empty string, so comparing with "0"/"1" cannot pass by accident.)
APP_MODES = {"alternate_on": "1", "mouse_any_flag": "1", "mouse_all_flag": "1", "mouse_sgr_flag": "1",
             "cursor_flag": "0", "wrap_flag": "0"}
#: The same modes in a normal shell: main screen, no mouse reporting of any kind, cursor shown, wrap on.
SHELL_MODES = {"alternate_on": "0", "mouse_any_flag": "0", "mouse_all_flag": "0", "mouse_sgr_flag": "0",
               "mouse_button_flag": "0", "mouse_standard_flag": "0", "cursor_flag": "1", "wrap_flag": "1"}

#: The new-run form: field → the start of its label (each Input sits on its label's row).
FORM_LABELS = {"model": "model (HF dir", "data": "data (messages", "output_dir": "output dir",
               "max_steps": "max steps", "extra_args": "extra osft-train flags"}
HEADER = re.compile(r"\brun (\S+)\s+(\w+)(?: \(no process left on this host\))?\s+step (\d+|-)/(\d+|\?)")
QUIT_TITLE = "The run is still running. Quit how?"
EXITED = "OSFT-TUI-EXITED"
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def wait_for(predicate, what: str, timeout: float = WAIT_S, interval: float = 0.1, context=None):
    """Poll ``predicate()`` until it is truthy and return its value; fail after ``timeout`` s,
    with ``context()`` (e.g. the screen) in the message."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{context()}" if context else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def records(out: Path, event: str) -> list[dict]:
    """``event`` records of every metrics file of the run."""
    found = []
    for path in sorted((out / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line being written
                continue
            if rec.get("event") == event:
                found.append(rec)
    return found


def last_step(out: Path) -> int:
    steps = records(out, "step")
    return steps[-1]["step"] if steps else 0


def run_pids(out: Path, nranks: int = 2) -> tuple[int, list[int]]:
    """The launcher's pid (run.json) and the ranks' (``run_started`` records), once all are written."""
    run = wait_for(lambda: (r := read_json(out / "run.json")) and r.get("launcher_pid") and r, "run.json")
    started = wait_for(lambda: len(s := records(out, "run_started")) >= nranks and s, f"{nranks} run_started records")
    return run["launcher_pid"], [r["pid"] for r in started]


def signal_lines(out: Path) -> list[str]:
    path = out / "fake_signals.node0.log"
    return path.read_text().splitlines() if path.is_file() else []


def complete_checkpoints(out: Path) -> list[Path]:
    """Checkpoint directories with a manifest (written last, then the directory is renamed)."""
    return sorted((out / "full_state_checkpoints").glob("step_*[0-9]/manifest.json"))


def assert_still_training(out: Path, pids: list[int]) -> None:
    """Every pid is alive and the run makes steps."""
    assert all(alive(p) for p in pids), {p: alive(p) for p in pids}
    before = last_step(out)
    wait_for(lambda: last_step(out) >= before + 2, f"steps after step {before}")
    assert all(alive(p) for p in pids), {p: alive(p) for p in pids}


def assert_no_process_left(out: Path, pids: list[int]) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), f"pids {pids} to end")
    wait_for(lambda: not processes_of(out, readers=True), f"no process mentioning {out}",
             context=lambda: [p.info["cmdline"] for p in processes_of(out, readers=True)])


class Tmux:
    """A private tmux server (a socket of its own, no configuration file); one session per terminal."""

    def __init__(self, root: Path) -> None:
        self.socket = f"osft-tui-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        # COLUMNS/LINES would override the pane's size in Rich and Textual (pytest-xdist's workers set
        # 80 x 24); the pane's own size is what these tests read.
        self.env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE", "COLUMNS", "LINES")}
        self.env.setdefault("TERM", "xterm-256color")
        self.terminals: list[Terminal] = []
        self.socket_path: str | None = None

    def __call__(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([TMUX, "-L", self.socket, "-f", "/dev/null", *args], check=False,
                              capture_output=True, text=True, timeout=20, env=self.env)
        if check and done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {done.returncode} {done.stderr.strip()}")
        return done.stdout

    def open(self, name: str, argv: list[str], cwd: Path, size: tuple[int, int] = SIZE) -> Terminal:
        """A new terminal (session ``name``, ``size`` columns x rows) running ``argv`` (osft-tui) as
        described above."""
        term = Terminal(self, name)
        q = shlex.quote
        script = "\n".join([
            f"cd {q(str(cwd))}",
            f"stty -a > {q(str(term.stty_before))}",
            f"sh -c 'echo $$ > \"$0\"; exec \"$@\"' {q(str(term.pid_file))} {shlex.join(argv)}",
            "code=$?",
            f"stty -a > {q(str(term.stty_after))}",
            f"echo $code > {q(str(term.exit_file))}.tmp && mv {q(str(term.exit_file))}.tmp {q(str(term.exit_file))}",
            f"echo {EXITED} $code",
            "exec sleep 600",
            "",
        ])
        path = self.root / f"{name}.sh"
        path.write_text(script)
        self("new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]), f"sh {q(str(path))}")
        self.terminals.append(term)
        self.socket_path = self.socket_path or self("display-message", "-p", "#{socket_path}").strip()
        return term

    def close(self) -> None:
        """Kill the server and remove its socket; then SIGKILL any dashboard still running (one stuck
        after its terminal closed)."""
        self("kill-server", check=False)
        if self.socket_path:
            Path(self.socket_path).unlink(missing_ok=True)
        for term in self.terminals:
            pid = term.read_pid()
            if pid is not None and alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Terminal:
    """One tmux session (one pane) running osft-tui."""

    def __init__(self, tmux: Tmux, name: str) -> None:
        self.tmux, self.name = tmux, name
        self.pid_file = tmux.root / f"{name}.pid"
        self.exit_file = tmux.root / f"{name}.exit"
        self.stty_before = tmux.root / f"{name}.stty-before"
        self.stty_after = tmux.root / f"{name}.stty-after"

    # ------------------------------------------------------------------ reading
    def screen(self, escapes: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []), "-t", self.name)

    def lines(self) -> list[str]:
        return self.screen().splitlines()

    def fmt(self, fmt: str) -> str:
        return self.tmux("display-message", "-p", "-t", self.name, fmt).strip()

    def modes(self) -> dict[str, str]:
        names = sorted(set(APP_MODES) | set(SHELL_MODES))
        values = self.fmt(" ".join(f"#{{{n}}}." for n in names)).split(" ")
        return {n: v.removesuffix(".") for n, v in zip(names, values, strict=True)}

    def cursor_y(self) -> int:
        return int(self.fmt("#{cursor_y}"))

    def read_pid(self) -> int | None:
        try:
            text = self.pid_file.read_text()
        except OSError:
            return None
        return int(text) if text.endswith("\n") else None

    def app_pid(self) -> int:
        """The pid of osft-tui (the script writes it, then execs osft-tui in that process)."""
        pid = wait_for(self.read_pid, "the osft-tui pid file")

        def execd() -> bool:
            try:
                return "osft-tui" in " ".join(psutil.Process(pid).cmdline())
            except psutil.Error:
                return False

        wait_for(execd, "osft-tui to be exec'd")
        return pid

    def exit_code(self) -> int:
        text = wait_for(lambda: self.exit_file.is_file() and self.exit_file.read_text().strip(), "osft-tui to exit",
                        context=self.screen)
        return int(text)

    def wait_screen(self, pattern: str | re.Pattern, what: str, timeout: float = WAIT_S) -> re.Match:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        return wait_for(lambda: regex.search(self.screen()), what, timeout, context=self.screen)

    def header(self) -> re.Match | None:
        lines = self.lines()
        return HEADER.search(lines[0]) if lines else None

    def wait_header(self, state: str, min_step: int = 0, what: str = "") -> re.Match:
        """Wait until the dashboard's run line shows ``state`` and a step of at least ``min_step``."""
        def ok():
            m = self.header()
            return m if m and m.group(2) == state and m.group(3) != "-" and int(m.group(3)) >= min_step else None
        return wait_for(ok, what or f"the run line to show {state} at step {min_step}+", context=self.screen)

    # ------------------------------------------------------------------ typing
    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", "--", text)

    def focused_button(self) -> str | None:
        """The label of the focused button of the quit dialog (Textual draws it bold + reverse)."""
        for line in self.screen(escapes=True).splitlines():
            if " detach " not in line:
                continue
            for label in ("detach", "checkpoint and stop", "kill", "cancel"):
                m = re.search(r"((?:\x1b\[[0-9;]*m)+) " + re.escape(label) + " ", line)
                if m and any(_reverse(params) for params in SGR.findall(m.group(1))):
                    return label
        return None

    def fill_form(self, values: dict[str, str]) -> None:
        """Type ``values`` into the new-run form, bottom field first (shift+tab from the launch button).

        Keys that reach Textual in one burst are not handled in order: printable keys go to the
        widget focused when they are read, and may be handled before bindings sent earlier (tab,
        ctrl+a, ctrl+k). So each step waits until its effect shows (the cursor on the field's row,
        the field's text) before the next key is sent."""
        rows = self._input_rows()
        for field in sorted(values, key=lambda f: -self._row(FORM_LABELS[f])):
            row = self._row(FORM_LABELS[field])
            for _ in range(len(rows) + 1):
                at = self._cursor_row()
                if at == row:
                    break
                # shift+tab: from a button to the last input, from an input to the one above it
                target = rows[rows.index(at) - 1] if at in rows[1:] else rows[-1]
                self.keys("BTab")
                wait_for(lambda t=target: self._cursor_row() == t, f"the focus on row {target}", 10, 0.03, self.screen)
            assert self._cursor_row() == row, f"could not focus {field}\n{self.screen()}"
            if self._value(row) != "":
                self.keys("C-a", "C-k")
                wait_for(lambda r=row: self._value(r) == "", f"{field} to be cleared", 10, 0.03, self.screen)
            self.type(values[field])
            wait_for(lambda r=row, v=values[field]: self._value(r) == v, f"{field} = {values[field]!r}", 10, 0.03,
                     self.screen)

    def fill_form_walking(self, values: dict[str, str]) -> None:
        """Type ``values`` into the new-run form on a terminal too small to show every field: walk up
        from the launch button with shift+tab, one field at a time (the form scrolls to the focused
        one), and know the focused field by its border's colour. An input narrower than
        its value shows the value's end."""
        labels = [label for _, label, _ in reversed(FIELDS)]
        for name, label, _ in reversed(FIELDS):
            self.keys("BTab")
            wait_for(lambda lb=label: self._focused_label(labels) == lb, f"the focus on {name}", 10, 0.03,
                     self.screen)
            if name not in values:
                continue
            if self._labelled_value(label) != "":  # read again each time: the form may scroll
                self.keys("C-a", "C-k")
                wait_for(lambda lb=label: self._labelled_value(lb) == "", f"{name} to be cleared", 10, 0.03,
                         self.screen)
            self.type(values[name])
            wait_for(lambda lb=label, v=values[name]: (shown := self._labelled_value(lb)) and v.endswith(shown)
                     and len(shown) >= min(len(v), 20), f"{name} = {values[name]!r}", 10, 0.03, self.screen)

    def _labelled_value(self, label: str) -> str | None:
        """The text inside the input beside ``label``: its text row is the label's row, or the row below
        it while Textual's scroll fast path has redrawn the focused input one row lower than its label
        (seen under load: the blinking cursor keeps redrawing the input, the label is not redrawn)."""
        lines = self.lines()  # one capture: the screen may change between two
        rows = [i for i, line in enumerate(lines) if line.strip().startswith(label)]
        assert rows, f"no {label!r} on the screen\n" + "\n".join(lines)
        for line in lines[rows[0]:rows[0] + 2]:
            value = _input_text(line)
            if value == "" or value and value.strip("▔▁"):  # not one of the input's border rows
                return value
        return None

    def _focused_label(self, labels: list[str]) -> str | None:
        """The form label of the focused input: the one whose input border has a colour no other
        input on the screen has (the hardware cursor's position is not reliable at this size)."""
        borders: dict[str, str] = {}
        for line in self.screen(escapes=True).splitlines():
            text = SGR.sub("", line).strip()
            label = next((lb for lb in labels if text.startswith(lb)), None)
            if label is not None and "▊" in line:
                borders[label] = SGR.findall(line.split("▊")[0])[-1]
        colours = list(borders.values())
        unique = [lb for lb, c in borders.items() if colours.count(c) == 1]
        return unique[0] if len(unique) == 1 and len(borders) > 1 else None

    def _cursor_row(self) -> int:
        """The cursor's row once it stays put (tmux may report it in the middle of a frame being drawn)."""
        previous = self.cursor_y()
        for _ in range(100):
            time.sleep(0.03)
            now = self.cursor_y()
            if now == previous:
                break
            previous = now
        return previous

    def _input_rows(self) -> list[int]:
        """Rows of the form's inputs (the row of each label), top to bottom."""
        return [i for i, line in enumerate(self.lines()) if "▊" in line and line.split("▊")[0].strip()]

    def _row(self, label: str) -> int:
        rows = [i for i, line in enumerate(self.lines()) if line.strip().startswith(label)]
        assert rows, f"no {label!r} on the screen\n{self.screen()}"
        return rows[0]

    def _value(self, row: int) -> str | None:
        return _input_text(self.lines()[row])


def _input_text(line: str) -> str | None:
    """The text between an input's left and right border on a screen line (None: no input there)."""
    parts = line.split("▊")
    return parts[1].strip().rstrip("▎").strip() if len(parts) > 1 else None


def _reverse(params: str) -> bool:
    """Whether an SGR parameter list turns on reverse video (7), skipping colour arguments."""
    items, i = params.split(";"), 0
    while i < len(items):
        if items[i] in ("38", "48", "58"):
            i += 3 if i + 1 < len(items) and items[i + 1] == "5" else 5
            continue
        if items[i] == "7":
            return True
        i += 1
    return False


def assert_terminal_restored(term: Terminal, modes_while_running: dict[str, str]) -> None:
    """The dashboard had changed the terminal's modes, and they are back to a shell's."""
    assert {k: modes_while_running[k] for k in APP_MODES} == APP_MODES, modes_while_running
    assert term.modes() == SHELL_MODES
    before, after = term.stty_before.read_text(), term.stty_after.read_text()
    flags = set(after.split())
    assert {"echo", "icanon", "isig", "icrnl", "opost"} <= flags and not {"-echo", "-icanon"} & flags, after
    assert after == before
    screen = term.screen()
    assert EXITED in screen and QUIT_TITLE not in screen and "osft-tui" not in screen, screen


def new_run_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return model, data, tmp_path / "rundir"


def launch_from_form(term: Terminal, tmp_path: Path, max_steps: int) -> tuple[Path, int, list[int], dict[str, str]]:
    """Fill the new-run form (model, data, output dir, max steps, fake flags), ctrl+l, and wait until
    the dashboard shows a few steps. Returns the run directory, the launcher and rank pids, and the
    terminal modes while the dashboard runs."""
    model, data, out = new_run_files(tmp_path)
    term.wait_screen("New OSFT run", "the new-run form")
    wait_for(lambda: len(term._input_rows()) == 9 and "^l launch" in term.screen(), "the form's 9 fields",
             context=term.screen)
    term.fill_form({"model": str(model), "data": str(data), "output_dir": str(out), "max_steps": str(max_steps),
                    "extra_args": shlex.join(FAKE_FLAGS)})
    term.keys("C-l")
    term.wait_header("running", 2, "the dashboard to show the launched run's steps")
    assert term.header().group(1) == str(out) and term.header().group(4) == str(max_steps)
    launcher, ranks = run_pids(out)
    screen = term.screen()
    assert re.search(r"^ node\s+host\s+step\s+tokens/s\s+step time\s+loss\s+lr\s+grad norm", screen, re.MULTILINE), screen
    # node 0 (no straggler: one node) at a step, with its tokens/s and step time, runs ranks 0-1
    assert re.search(r"^ 0\s+\S+\s+\d+\s+[\d.,]+[kMG]?\s+\d+\.\d\d s\s.*\s0-1\s", screen, re.MULTILINE), screen
    run = read_json(out / "run.json")
    assert run["argv"][0] == str(FAKE) and "--on-demand-checkpointing" in run["argv"]
    return out, launcher, ranks, term.modes()


def start_fake_run(out: Path) -> subprocess.Popen:
    """The fake launcher (2 ranks, 300 steps) in a session of its own, as the dashboard starts it."""
    out.mkdir(parents=True)
    with open(out.parent / "launcher.log", "wb") as log:
        return subprocess.Popen([str(PYTHON), str(FAKE), "--output-dir", str(out), "--nproc-per-node", "2",
                                 "--max-steps", "300", "--on-demand-checkpointing", *FAKE_FLAGS],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_fake_run(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=WAIT_S)


@pytest.fixture
def tmux(tmp_path):
    server = Tmux(tmp_path / "terminals")
    try:
        yield server
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- the terminal


def test_dashboard_in_tmux_launch_checkpoint_detach(tmux, tmp_path):
    term = tmux.open("launch", [OSFT_TUI, "--launcher", LAUNCHER], tmp_path)
    out = tmp_path / "rundir"
    try:
        out, launcher, ranks, running_modes = launch_from_form(term, tmp_path, max_steps=200)

        term.keys("c")
        wait_for(lambda: complete_checkpoints(out), "a complete checkpoint", context=term.screen)
        term.wait_screen(r"checkpoint requested at step \d+: SIGUSR1 sent to launcher", "the request in the events")
        lines = signal_lines(out)
        assert len(lines) == 1 and lines[0].startswith("SIGUSR1 "), lines
        assert_still_training(out, [launcher, *ranks])  # c checkpoints and goes on

        term.keys("q")
        term.wait_screen(re.escape(QUIT_TITLE), "the quit question")
        wait_for(lambda: term.focused_button() == "detach", "detach to have the focus", context=term.screen)
        term.keys("Enter")
        assert term.exit_code() == 0
        assert_terminal_restored(term, running_modes)

        # detach: the run goes on without the dashboard, and still obeys its signals
        assert_still_training(out, [launcher, *ranks])
        assert len(signal_lines(out)) == 1
        os.kill(launcher, signal.SIGUSR2)
        run = wait_for(lambda: (r := read_json(out / "run.json")) and r["state"] == "stopped" and r,
                       "run.json state stopped")
        assert run["exit_code"] == 75
        assert_no_process_left(out, [launcher, *ranks])
        assert [line.split()[0] for line in signal_lines(out)] == ["SIGUSR1", "SIGUSR2"]
    finally:
        kill_run(out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_restore_the_terminal(tmux, tmp_path, signum):
    out = tmp_path / "rundir"
    proc = start_fake_run(out)
    try:
        launcher, ranks = run_pids(out)
        assert launcher == proc.pid
        term = tmux.open("attach", [OSFT_TUI, str(out)], tmp_path)
        pid = term.app_pid()
        term.wait_header("running", 1, "the dashboard of the run")
        assert term.header().group(1) == str(out)
        running_modes = term.modes()

        os.kill(pid, signum)
        assert term.exit_code() == 128 + signum
        assert_terminal_restored(term, running_modes)
        assert not alive(pid)

        # documented policy: the run is left running, and no signal is passed on to it
        assert proc.poll() is None and signal_lines(out) == []
        assert_still_training(out, [launcher, *ranks])
        os.kill(launcher, signal.SIGUSR2)
        assert proc.wait(timeout=WAIT_S) == 75
        assert read_json(out / "run.json")["state"] == "stopped"
        assert_no_process_left(out, [launcher, *ranks])
    finally:
        kill_run(out)
        stop_fake_run(proc)


def test_closing_the_terminal_ends_the_dashboard_and_leaves_the_run_running(tmux, tmp_path):
    """The terminal closed for real: tmux closes the pseudo-terminals (a hangup: SIGHUP and
    SIGCONT) of three dashboards attached to one run (three tries at a timing-dependent hang)."""
    out = tmp_path / "rundir"
    proc = start_fake_run(out)
    try:
        launcher, ranks = run_pids(out)
        terms = [tmux.open(f"closing{i}", [OSFT_TUI, str(out)], tmp_path) for i in range(3)]
        pids = [term.app_pid() for term in terms]
        for term in terms:
            term.wait_header("running", 1, "the dashboard of the run")

        tmux("kill-server")
        wait_for(lambda: not any(alive(p) for p in pids), "every osft-tui to end after its terminal was closed",
                 timeout=15, context=lambda: {p: alive(p) for p in pids})

        assert proc.poll() is None
        assert_still_training(out, [launcher, *ranks])
        os.kill(launcher, signal.SIGUSR2)
        assert proc.wait(timeout=WAIT_S) == 75
        assert_no_process_left(out, [launcher, *ranks])
    finally:
        kill_run(out)
        stop_fake_run(proc)

def test_sigkill_of_the_dashboard_leaves_the_run_running_and_it_can_be_reattached(tmux, tmp_path):
    first = tmux.open("first", [OSFT_TUI, "--launcher", LAUNCHER], tmp_path)
    out = tmp_path / "rundir"
    try:
        out, launcher, ranks, _ = launch_from_form(first, tmp_path, max_steps=300)
        pids = [launcher, *ranks]
        os.kill(first.app_pid(), signal.SIGKILL)
        assert first.exit_code() == 128 + signal.SIGKILL
        # nothing can restore a terminal after SIGKILL: the checks of assert_terminal_restored see it
        assert first.modes() == {**SHELL_MODES, **APP_MODES}
        assert "-echo" in first.stty_after.read_text().split()
        assert_still_training(out, pids)  # the run is in sessions of its own

        again = tmux.open("again", [OSFT_TUI, "--launcher", LAUNCHER, str(out)], tmp_path)
        again.wait_header("running", last_step(out), "the re-attached dashboard")
        running_modes = again.modes()
        again.keys("s")
        again.wait_screen(r"checkpoint and stop requested at step \d+: SIGUSR2 sent to launcher", "the stop request")
        run = wait_for(lambda: (r := read_json(out / "run.json")) and r["state"] == "stopped" and r, "state stopped",
                       context=again.screen)
        assert run["exit_code"] == 75 and complete_checkpoints(out)
        assert [line.split()[0] for line in signal_lines(out)] == ["SIGUSR2"]
        wait_for(lambda: not any(alive(p) for p in pids), f"pids {pids} to end")
        again.wait_header("stopped", what="the dashboard to show the run stopped")

        again.keys("q")  # no live run: quits without asking
        assert again.exit_code() == 0
        assert_terminal_restored(again, running_modes)
        assert_no_process_left(out, pids)
    finally:
        kill_run(out)


@pytest.mark.parametrize("choice", ["kill", "checkpoint and stop"])
def test_quit_choices_leave_no_process_of_the_run(tmux, tmp_path, choice):
    term = tmux.open("quit", [OSFT_TUI, "--launcher", LAUNCHER], tmp_path)
    out = tmp_path / "rundir"
    try:
        out, launcher, ranks, running_modes = launch_from_form(term, tmp_path, max_steps=300)
        pids = [launcher, *ranks]
        term.keys("q")
        term.wait_screen(re.escape(QUIT_TITLE), "the quit question")
        # the buttons: detach (focused), checkpoint and stop, kill, cancel
        for _ in range(3):
            focused = wait_for(term.focused_button, "a focused button", context=term.screen)
            if focused == choice:
                break
            term.keys("Tab")
            wait_for(lambda f=focused: term.focused_button() not in (None, f), "the focus to move",
                     context=term.screen)
        assert term.focused_button() == choice
        term.keys("Enter")
        assert term.exit_code() == 0
        assert_terminal_restored(term, running_modes)
        assert not any(alive(p) for p in pids), {p: alive(p) for p in pids}
        assert_no_process_left(out, pids)
        run = read_json(out / "run.json")
        if choice == "kill":
            assert not complete_checkpoints(out) and signal_lines(out) == []
        else:
            assert run["state"] == "stopped" and run["exit_code"] == 75 and complete_checkpoints(out)
            assert [line.split()[0] for line in signal_lines(out)] == ["SIGUSR2"]
    finally:
        kill_run(out)



# ---------------------------------------------------------------------------------------------- 80x24


def test_at_80x24_launch_watch_checkpoint_resume_and_read_the_logs_without_leaving_the_dashboard(tmux, tmp_path):
    """The whole job cycle in a small terminal: on an 80 x 24 terminal, a run is launched from the
    form, watched, checkpointed with ``c``, resumed from that checkpoint with ``r`` (the live run is
    stopped first) and its rank logs read with ``l``, all inside one dashboard."""
    term = tmux.open("small", [OSFT_TUI, "--launcher", LAUNCHER], tmp_path, size=(80, 24))
    out = tmp_path / "rundir"
    try:
        new_run_files(tmp_path)  # relative paths: an 80-column input shows only about 35 characters
        term.wait_screen("New OSFT run", "the new-run form")
        term.wait_screen(r"\^l launch", "the form's footer")
        term.fill_form_walking({"model": "model", "data": "train.jsonl", "output_dir": "rundir", "max_steps": "400",
                                "extra_args": shlex.join(FAKE_FLAGS)})
        term.keys("C-l")
        term.wait_header("running", 2, "the dashboard to show the launched run's steps")
        launcher, ranks = run_pids(out)
        for line in term.lines():
            assert len(line) <= 80

        term.keys("c")  # checkpoint: the list shows it complete
        saved = wait_for(lambda: complete_checkpoints(out), "a complete checkpoint", context=term.screen)
        step = int(saved[0].parent.name.removeprefix("step_"))
        term.wait_screen(rf"(?m)^\s*{step}\s.*\bcomplete\b", "the checkpoint in the list")
        assert_still_training(out, [launcher, *ranks])

        term.keys("r")  # resume from the newest checkpoint (the cursor's row): the live run is stopped first
        term.wait_screen(r"Stop the running job and resume from step (\d+)\?", "the resume question")
        chosen = int(re.search(r"resume from step (\d+)\?", term.screen()).group(1))
        term.keys("Tab")
        wait_for(lambda: "stop and resume" in term.screen(), "the resume button", context=term.screen)
        term.keys("Enter")
        resumed = wait_for(lambda: records(out, "resumed"), "a resumed record", timeout=60, context=term.screen)
        assert resumed[0]["from_step"] == chosen
        assert [line.split()[0] for line in signal_lines(out)][-1] == "SIGUSR2"
        term.wait_header("running", chosen + 2, "the resumed run's steps")
        assert all(not alive(p) for p in [launcher, *ranks])  # the first run's processes are gone

        term.keys("l")  # rank 0's logs, then back to the dashboard
        term.wait_screen(r"rank 0 \(node 0, local rank 0\)", "the log view")
        term.wait_screen(r"resumed from .* at step \d+|step \d+ rank 0 loss", "rank 0's output in the log view")
        term.keys("Escape")
        term.wait_header("running", chosen + 3, "the dashboard again")
        assert term.read_pid() == term.app_pid()  # one dashboard all along
    finally:
        kill_run(out)
