"""The bench's GPU clock and power monitor (``bench.common``): the summary of nvidia-smi's samples,
and no summary where there is no GPU to watch."""

import pytest

from bench.common import GpuMonitor, parse_gpu_samples


def test_power_capped_samples_are_counted():
    lines = [
        "1980, 598.10, 0x0000000000000000",
        "1800, 691.46, 0x0000000000000004",  # the software power cap
        "1605, 695.80, 0x0000000000000084",  # the cap and the hardware power brake
        "345, 72.70, 0x0000000000000001",  # idle: not power
        "[N/A], [N/A], [N/A]",  # a field the driver could not read: skipped
        "",
    ]
    s = parse_gpu_samples(lines)
    assert s["samples"] == 4
    assert s["power_capped_share"] == pytest.approx(0.5)
    assert s["sm_mhz_min"] == 345
    assert s["sm_mhz_mean"] == pytest.approx((1980 + 1800 + 1605 + 345) / 4)
    assert s["power_w_max"] == pytest.approx(695.80)
    assert s["power_w_mean"] == pytest.approx((598.10 + 691.46 + 695.80 + 72.70) / 4)
    assert "power-capped 50 % of 4 samples" in GpuMonitor.line(s)
    assert parse_gpu_samples(["garbage", ""]) is None
    assert GpuMonitor.line(None) == ""


def test_no_gpu_no_summary(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with GpuMonitor() as gpu:
        pass
    assert gpu.summary is None


def test_the_process_gpu_is_watched(monkeypatch):
    """torch's device 1 under ``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b`` is nvidia-smi's ``GPU-b``; the
    samples it prints become the summary."""
    import torch

    from bench import common

    calls = []

    class FakeSmi:
        def __init__(self, argv, **kwargs):
            calls.append(argv)

        def terminate(self):
            pass

        def communicate(self, timeout=None):
            return "1800, 690.0, 0x4\n1980, 600.0, 0x0\n", ""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b")
    monkeypatch.setattr(common.subprocess, "Popen", FakeSmi)
    with GpuMonitor() as gpu:
        pass
    assert "--id=GPU-b" in calls[0]
    assert gpu.summary["samples"] == 2 and gpu.summary["power_capped_share"] == 0.5
