"""backend="auto": TRT-LLM on SM100/103/107 with flashinfer, Triton on every other SM80+ GPU with triton, torch
otherwise (docs/moe-backends.md)."""

import logging

import pytest
import torch

import runtime.moe as moe


class _Anywhere:
    @classmethod
    def check_supported(cls, device):
        return None


@pytest.mark.parametrize(
    "cap,installed,want",
    [
        ((10, 0), {"flashinfer", "triton"}, "flashinfer-trtllm"),
        ((10, 3), {"flashinfer"}, "flashinfer-trtllm"),
        ((10, 7), {"flashinfer"}, "flashinfer-trtllm"),
        (
            (10, 0),
            {"triton"},
            "triton",
        ),  # Blackwell without flashinfer: porter's kernel, and the log says why
        ((9, 0), {"triton", "flashinfer"}, "triton"),
        ((9, 0), set(), "torch"),  # no triton: the reference
        ((8, 0), {"triton"}, "triton"),  # Ampere
        ((8, 9), {"triton"}, "triton"),  # Ada
        ((12, 0), {"triton", "flashinfer"}, "triton"),  # SM120: TRT-LLM cubins do not run there
        ((7, 5), {"triton", "flashinfer"}, "torch"),  # below SM80
    ],
)
def test_auto_choice_by_capability(monkeypatch, caplog, cap, installed, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(moe, "_importable", lambda name: name in installed)
    monkeypatch.setattr(moe, "_backend_class", lambda name: _Anywhere)
    with caplog.at_level(logging.INFO, logger="porter.runtime"):
        assert moe.resolve_backend("auto", torch.device("cuda")) == want
    assert f"MoE backend: {want} (auto: SM{cap[0]}{cap[1]}" in caplog.text


def test_auto_on_cpu_and_unquantized():
    assert moe.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert moe.resolve_backend("auto", torch.device("cpu"), quantized=False) == "torch"


def test_unknown_backend_is_one_clear_error():
    with pytest.raises(moe.BackendUnavailable, match="unknown MoE backend 'cutlass'"):
        moe.resolve_backend("cutlass", torch.device("cpu"))
