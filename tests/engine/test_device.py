"""`--device auto`: the choice as a table over the probe's answer, and the probe against torch's
own answer on this machine (this machine has no GPU: the CUDA branch is the table's)."""

from __future__ import annotations

import pytest
from shoal.engine.device import CudaProbe, DeviceChoice, choose_device, probe_cuda, torch_build
from shoal.engine.entrypoints.serve_flags import build_parser

GPU = CudaProbe(True, "torch 2.13.0+cu128 sees 2 CUDA device(s)")
NO_GPU = CudaProbe(False, "torch 2.13.0+cpu is built without CUDA")


@pytest.mark.parametrize("requested, probe, device, why", [
    ("auto", GPU, "cuda", "--device auto: torch 2.13.0+cu128 sees 2 CUDA device(s)"),
    ("auto", NO_GPU, "cpu", "--device auto: torch 2.13.0+cpu is built without CUDA; "
                            "running on the CPU"),
    ("cpu", None, "cpu", "--device cpu"),
    ("cpu", GPU, "cpu", "--device cpu"),  # asked for: kept, even with a GPU
    ("cuda", NO_GPU, "cuda", "--device cuda"),  # asked for: the engine says torch sees none
    ("cuda:1", None, "cuda:1", "--device cuda:1"),
])
def test_choose_device(requested, probe, device, why):
    assert choose_device(requested, probe) == DeviceChoice(device, why)


def test_auto_without_a_probe_is_a_bug_not_a_guess():
    with pytest.raises(ValueError, match="probe"):
        choose_device("auto", None)


def test_the_log_line_says_which_and_why():
    assert choose_device("auto", NO_GPU).log_line == (
        "device: cpu (--device auto: torch 2.13.0+cpu is built without CUDA; running on the CPU)")


def test_serve_defaults_to_auto():
    assert build_parser().parse_args(["m"]).device == "auto"


def test_the_torch_free_probe_agrees_with_torch():
    import torch

    build = torch_build()
    assert build is not None
    assert (build["__version__"], build["cuda"]) == (torch.__version__, torch.version.cuda)
    probe = probe_cuda()
    assert probe.available == torch.cuda.is_available(), probe
    assert torch.__version__ in probe.detail


@pytest.mark.process
def test_an_explicit_cuda_without_one_is_a_config_error_naming_it(tiny_model, tmp_path):
    """Here torch sees no GPU: `--device cuda` fails at start-up, permanently, saying so."""
    import torch
    from shoal.contract.termination import Cause, parse_termination_message
    from support.servers import ServeProcess

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is served")
    s = ServeProcess(tiny_model, tmp_path, "--device", "cuda")
    assert s.wait_exit(120) == 1, s.log()
    log = s.log()
    s.stop()
    msg = parse_termination_message(s.termination_log.read_text())
    assert msg.cause == Cause.CONFIG_ERROR, msg
    assert "device 'cuda' requested but torch sees no CUDA device" in msg.message, log


def test_cuda_without_an_index_becomes_the_current_device(monkeypatch):
    # torch.cuda.set_device refuses torch.device("cuda") (no index): the first GPU run of
    # `LLM(device="cuda")` failed there (2026-12-04, H200, torch 2.11). A one-rank engine's
    # "cuda" (given, or chosen by auto) is torch's current device; an index given is kept.
    import torch
    from shoal.engine.worker import worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert worker.resolve_device("cuda") == torch.device("cuda", 2)
    assert worker.resolve_device("auto") == torch.device("cuda", 2)
    assert worker.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert worker.resolve_device("cpu") == torch.device("cpu")
