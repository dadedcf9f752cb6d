"""The README's demo really trains: both adapters' losses fall in shared packed batches."""

from ember.cli import main
from ember.engine.demo import run_demo


def test_demo_adapters_learn(tmp_path):
    history = run_demo(steps=60, out=tmp_path)
    for name, losses in history.items():
        assert losses[-1] < 0.7 * losses[0], (name, losses[0], losses[-1])
    assert (tmp_path / "plus1-checkpoint" / "adapter.safetensors").is_file()
    assert (tmp_path / "plus2-peft" / "adapter_config.json").is_file()


def test_cli_help_lists_demo(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    assert "demo" in capsys.readouterr().out
