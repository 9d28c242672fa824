"""scripts/install.sh: a good run prints its ``[install] ...`` step lines only; a failing step
stops the script with that step's status and prints the output it held back.

The apt/pip commands are stand-ins (``PYTHON``, ``apt-get`` and ``sudo`` on ``PATH``) that print
the noise the real ones print (pip's root-user warning, setuptools' editable-install banner), so
the test is quick and installs nothing.
"""
import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = os.path.join(ROOT, "scripts", "install.sh")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 stand-in: "-m pip ..." prints pip/setuptools noise and fails when FAKE_FAIL is part of
# its arguments; "-c CODE" answers the script's import probes.
if [ "$1" = "-m" ]; then
  echo "WARNING: Running pip as the 'root' user can result in broken permissions" >&2
  echo "  BuildBackendWarning: Editable installation." >&2
  echo "Successfully installed something"
  case "$*" in
    *"${FAKE_FAIL:-@none@}"*) echo "ERROR: no matching distribution (${FAKE_FAIL})" >&2; exit 3;;
  esac
  exit 0
fi
case "$2" in
  *torch.__version__*) echo "2.13.0+cpu";;
  *available_transports*) echo "transports usable here: torch";;
esac
exit 0
"""
FAKE_APT = """#!/usr/bin/env bash
echo "W: apt noise" >&2
exit 0
"""
FAKE_SUDO = """#!/usr/bin/env bash
exec "$@"
"""


def _run(tmp_path, fail=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("apt-get", FAKE_APT), ("sudo", FAKE_SUDO)):
        p = bin_dir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PYTHON": str(bin_dir / "python"), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "TMPDIR": str(tmp_path)}
    env.pop("FAKE_FAIL", None)
    if fail:
        env["FAKE_FAIL"] = fail
    return subprocess.run(["bash", INSTALL], capture_output=True, text=True, env=env, timeout=120)


def test_a_good_run_prints_its_step_lines_only(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    assert lines and all(ln.startswith("[install] ") for ln in lines), lines
    assert lines[-1] == "[install] done: transports usable here: torch"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("efa-ep-install.")]  # logs removed


def test_a_failing_step_exits_non_zero_with_its_output(tmp_path):
    out = _run(tmp_path, fail="triton")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "[install] FAILED (exit 3):" in out.stderr and "triton" in out.stderr
    # what the step printed, held back while it ran, is shown now
    assert "ERROR: no matching distribution (triton)" in out.stderr
    assert "BuildBackendWarning" in out.stderr
    # nothing after the failed step ran
    assert "[install] pip: efa-ep in editable mode" not in out.stdout
    assert "done:" not in out.stdout
