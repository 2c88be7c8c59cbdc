"""`make install`, the set-up `make test` and `make demo` begin with on a fresh clone: uv, installed
by pip, installs the project with the find-links pip is configured with (where a CPU machine keeps
its build of torch: without them uv would fetch PyPI's CUDA build) and compiles every module to
bytecode, as pip does (where PYTHONDONTWRITEBYTECODE is set, each process would compile its imports
again); where uv cannot install, pip does, as before. Run against a stand-in python that records its calls, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO

# `python -m venv DIR` copies the stand-in to DIR/bin/python; `pip config list` answers as this
# machine's pip does (one entry from the environment, one from a file, with two folders)
STAND_IN = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in
  "-m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip config list") printf '%s\\n' ":env:.find-links='/opt/wheels'" "global.find-links='/opt/wheels /srv/more'" \\
                                       "global.cert='/etc/ssl/certs/ca.pem'" ;;
  "-m uv pip install"*) exit "$UV_EXIT" ;;
esac
"""


def make_install(tmp_path, uv_exit: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    venv, calls = tmp_path / ".venv", tmp_path / "calls"
    env = {**os.environ, "CALLS": str(calls), "UV_EXIT": str(uv_exit)}
    out = subprocess.run(["make", "-C", str(REPO), "--no-print-directory", "install", f"PYTHON={python}",
                          f"VENV={venv}"], env=env, capture_output=True, text=True, timeout=60)
    assert (venv / ".installed").exists() == (out.returncode == 0), out.stderr
    return out, calls.read_text().splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_uv_installs_with_pips_find_links(tmp_path):
    out, calls = make_install(tmp_path, uv_exit=0)
    assert out.returncode == 0, out.stderr
    assert calls[0] == f"-m venv {tmp_path / '.venv'}"
    assert calls[1:] == ["-m pip config list", "-m pip install -q uv",
                         f"-m uv pip install -q --compile-bytecode --python {tmp_path / '.venv' / 'bin' / 'python'} "
                         "--find-links /opt/wheels --find-links /srv/more -e .[test]"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_pip_installs_where_uv_cannot(tmp_path):
    out, calls = make_install(tmp_path, uv_exit=1)
    assert out.returncode == 0, out.stderr
    assert calls[-3].startswith("-m uv pip install")
    assert calls[-2:] == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[test]"]
    assert "uv could not install; pip installs instead" in out.stdout
