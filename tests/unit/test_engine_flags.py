"""The engine options' checks shared by ``ember serve`` and the engine process: each bad value is
refused with a message naming its flag, by both, before anything starts."""

import subprocess
import sys

import pytest

from ember.engine_flags import engine_flag_errors

BAD = [
    (dict(nproc=3, ep=2), "--ep 2 must divide --nproc 3"),
    (dict(nproc=4, tp=3), "--tp 3 must divide --nproc 4"),
    (dict(nproc=6, ep=3, tp=2), "--ep 3 must be a multiple of --tp 2"),
    (dict(nproc=2, ep=2, expert_fsdp=True), "--expert-fsdp needs --nproc (2) > --ep (2)"),
    (dict(nproc=2, full_finetune=True), "--full-finetune runs each engine on one process"),
    (dict(full_finetune=True, ray="auto"), "--full-finetune runs each engine on one process"),
    (dict(optimizer_offload="disk:"), "--optimizer-offload must be none, host or disk:DIR, got 'disk:'"),
    (dict(optimizer_offload="gpu"), "--optimizer-offload must be none, host or disk:DIR, got 'gpu'"),
    (dict(optimizer_device_gib=-1.0), "--optimizer-device-gib must be >= 0, got -1.0"),
    (dict(max_prefill_tokens=0), "--max-prefill-tokens must be at least 1, got 0"),
]


def test_good_options_pass():
    assert engine_flag_errors() == []
    assert engine_flag_errors(nproc=8, ep=8, tp=2, expert_fsdp=False, optimizer_offload="disk:/tmp/x",
                              optimizer_device_gib=4.0, max_prefill_tokens=2048) == []
    assert engine_flag_errors(nproc=4, ep=2, expert_fsdp=True, full_finetune=False) == []


@pytest.mark.parametrize("options, says", BAD)
def test_each_bad_option_is_named(options, says):
    errors = engine_flag_errors(**options)
    assert len(errors) == 1 and errors[0].startswith(says), errors


def test_the_module_needs_no_torch():
    code = "import sys, ember.engine_flags; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("flags, says", [
    (["--nproc", "3", "--ep", "2"], "--ep 2 must divide --nproc 3"),
    (["--optimizer-offload", "disk:"], "--optimizer-offload must be none, host or disk:DIR"),
    (["--optimizer-device-gib", "-2"], "--optimizer-device-gib must be >= 0"),
])
def test_the_engine_process_refuses_them_too(tmp_path, capsys, flags, says):
    from ember.engine.service import main

    with pytest.raises(SystemExit) as e:
        main(["--base-model", "m", "--model-path", str(tmp_path), "--database-url", f"sqlite:///{tmp_path}/db.sqlite",
              "--storage", str(tmp_path / "s"), *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err
