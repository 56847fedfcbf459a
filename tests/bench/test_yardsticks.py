"""The benchmarks' yardsticks: the read-only bandwidth kernel (bench_kernels/read_bandwidth.py) sums
what it reads, program by program; the datasheet table names and rates the GPUs we are lent; a rate
becomes a % of each yardstick, and a missing yardstick stays missing rather than becoming a number."""

import sys

import pytest
import torch
from conftest import HAS_TRITON, ROOT, assert_precision, device_backends

sys.path.insert(0, str(ROOT / "bench_kernels"))
import environment
import timing

TRITON_DEVICES = [d for b, d in device_backends() if b == "triton"]


def reference_partial_sums(x, programs, block):
    """out[p] = sum of the blocks p, p + P, ... of x, by slicing (x's dtype, or float64 for the truth)."""
    blocks = torch.split(x, block)
    return torch.stack([torch.cat([x[:0], *blocks[p::programs]]).sum() for p in range(programs)])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("n,programs,block", [(1, 1, 64), (5003, 3, 256), (4096, 7, 512), (997, 16, 64)])
def test_partial_sums_read_every_element_once(device, n, programs, block):
    import read_bandwidth

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    out = torch.full((programs,), float("nan"), device=device)  # poisoned: an unwritten sum fails
    read_bandwidth.partial_sums(x.to(device), out, block=block)
    same = reference_partial_sums(x, programs, block)
    truth = reference_partial_sums(x.double(), programs, block)
    assert_precision(out.cpu(), same, truth, f"partial sums n={n} P={programs} block={block}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_partial_sums_refuse_what_they_cannot_read():
    import read_bandwidth

    out = torch.empty(2)
    with pytest.raises(ValueError, match="^x: a contiguous float32 vector"):
        read_bandwidth.partial_sums(torch.ones(8, dtype=torch.float64), out)
    with pytest.raises(ValueError, match="^x: a contiguous float32 vector"):
        read_bandwidth.partial_sums(torch.ones(8, 2)[:, 0], out)
    with pytest.raises(ValueError, match="^out: a contiguous float32 vector"):
        read_bandwidth.partial_sums(torch.ones(8), torch.empty(2, dtype=torch.int32))


@pytest.mark.parametrize(
    "name,slug,tbs,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 3.35, 989.0),  # how nvidia-smi names the SXM part
        ("NVIDIA H100 PCIe", "h100-pcie", 2.0, 756.0),
        ("NVIDIA H200", "h200", 4.8, 989.0),
        ("NVIDIA B200", "b200", 8.0, None),
        ("NVIDIA GH200 480GB", "gh200-480gb", None, None),  # not an H200: its memory differs by model
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb", None, None),
        ("Tesla T4", "tesla-t4", None, None),
    ],
)
def test_datasheet_and_file_name_of_a_gpu(name, slug, tbs, tflops):
    assert environment.gpu_slug(name) == slug
    assert environment.datasheet_hbm_tbs(name) == tbs
    assert environment.datasheet_bf16_tflops(name) == tflops


def test_no_gpu_is_the_host():
    assert environment.gpu_slug(None) == environment.gpu_slug("") == "cpu"
    assert environment.datasheet_hbm_tbs(None) is None and environment.datasheet_bf16_tflops(None) is None


def test_percents_of_each_yardstick_and_none_where_one_is_missing():
    yard = {
        "copy": {"GBps": 2000.0},
        "read": {"GBps": 4000.0},
        "gpu": "NVIDIA H200",
        "datasheet_GBps": 4800.0,
    }
    assert timing.bandwidth_percents(3000.0, yard) == {"pct_copy": 150.0, "pct_read": 75.0, "pct_spec": 62.5}
    host = {**yard, "read": None, "gpu": None, "datasheet_GBps": None}
    assert timing.bandwidth_percents(1000.0, host) == {"pct_copy": 50.0, "pct_read": None, "pct_spec": None}
    assert timing.bandwidth_text(yard) == "copy 2000 GB/s, read 4000 GB/s, HBM spec 4800 GB/s"
    assert timing.bandwidth_text(host) == "copy 2000 GB/s, read: not measured"
    assert timing.matmul_percents(400.0, {"TFLOPs": 800.0, "datasheet_TFLOPs": 1000.0}) == {
        "pct_mm": 50.0,
        "pct_mm_spec": 40.0,
    }
    assert timing.matmul_percents(400.0, {"TFLOPs": 800.0, "datasheet_TFLOPs": None})["pct_mm_spec"] is None


def test_host_yardsticks_measure_and_know_no_datasheet():
    yard = timing.bandwidth_yardsticks("cpu", quick=True)
    assert yard["gpu"] is None and yard["datasheet_GBps"] is None
    for name in ("copy", "read"):
        assert yard[name]["GBps"] > 0 and yard[name]["median_s"] > 0
    assert yard["read"]["method"] == "torch sum" and yard["read"]["bytes"] == 256 << 20
