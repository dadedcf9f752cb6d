"""A command whose optional dependencies are missing says which extra to install (exit 2), instead
of a ModuleNotFoundError traceback: ``ember serve`` without ``[serve]``, ``ember rl``/``sft``
without ``[rl]``. Each runs in a fresh interpreter where the extra's packages cannot be imported."""

import subprocess
import sys

import pytest

BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # import of it raises ModuleNotFoundError, as when it is not installed
from ember.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("argv,blocked,extra", [
    (["serve", "--home", "HOME"], ["fastapi", "sqlalchemy"], "serve"),
    (["keys", "list", "--home", "HOME"], ["sqlalchemy"], "serve"),
    (["rl", "--set", "base_model=x"], ["tinker"], "rl"),
    (["sft", "--set", "base_model=x"], ["tinker"], "rl"),
])
def test_a_missing_extra_is_named(argv, blocked, extra, tmp_path):
    argv = [str(tmp_path) if a == "HOME" else a for a in argv]
    out = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=blocked, argv=argv)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, check=False)
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    assert f"pip install 'ember[{extra}]'" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
