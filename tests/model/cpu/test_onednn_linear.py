import platform

import pytest
import torch
import torch.nn as nn
from gptserve.model.cpu.onednn_linear import OneDnnLinear, keep_rows_alike

# x86-64 builds of PyTorch ship oneDNN: there the fast path must be found, never skipped quietly
X86_WITH_ONEDNN = platform.machine() in ("x86_64", "AMD64") and torch.backends.mkldnn.is_available()
needs_onednn = pytest.mark.skipif(
    not X86_WITH_ONEDNN, reason="oneDNN's linear is only required of x86-64 builds with oneDNN"
)


@needs_onednn
def test_the_probe_finds_onednn_for_fp32_on_x86():
    assert OneDnnLinear.supports(torch.float32)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("planned_rows", [1, 32])
def test_onednn_linear_computes_what_the_linear_computes(bias, planned_rows):
    torch.manual_seed(0)
    linear = nn.Linear(24, 37, bias=bias)
    fast = OneDnnLinear(linear, planned_rows)
    with torch.no_grad():
        for shape in [(1, 24), (5, 24), (40, 24), (2, 3, 24)]:  # fewer and more than planned
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-6)
    assert fast.weight.is_mkldnn and not fast.weight.requires_grad
    assert fast.weight.numel() == linear.weight.numel()


@needs_onednn
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_the_activation_runs_inside_the_product(activation):
    import torch.nn.functional as F

    torch.manual_seed(0)
    linear = nn.Linear(16, 40)
    act = F.relu if activation == "relu" else lambda t: F.gelu(t, approximate="tanh")
    x = torch.randn(7, 16)
    with torch.no_grad():
        got = OneDnnLinear(linear, activation=activation)(x)
        torch.testing.assert_close(got, act(linear(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not OneDnnLinear.supports(torch.bfloat16), reason="no oneDNN bf16 here")
def test_onednn_linear_in_bfloat16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(OneDnnLinear(linear)(x).float(), linear(x).float(),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_comes_out_the_same_whatever_the_number_of_rows(dtype):
    if not OneDnnLinear.supports(dtype):
        pytest.skip(f"oneDNN has no {dtype} product here")
    torch.manual_seed(0)
    # a wide input, where oneDNN's kernel for one row sums in another order than for several;
    # rows spread over binades, where that order shows through bfloat16's rounding
    layer = OneDnnLinear(nn.Linear(3072, 512).to(dtype))
    x = (torch.randn(80, 3072) * 2.0 ** torch.randint(0, 12, (80, 3072))).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(80)])  # (80, 512), a row at a time
        for rows in (2, 3, 7, 16, 32):  # up to a decode batch: always
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        assert torch.equal(layer(x[5].view(1, 1, -1)), alone[5].view(1, 1, -1))  # (1, 1, in)
        keep_rows_alike(layer)  # past it (a prefill's rows): where oneDNN would differ, chunked
        for rows in (33, 48, 80):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        alike, layer.alike_rows = layer.alike_rows, None  # without chunks: the same where the
        if alike is None:  # probe found no other kernel
            assert torch.equal(layer(x), alone)


def test_supports_answers_without_raising_for_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert OneDnnLinear.supports(dtype) in (True, False)
    assert not OneDnnLinear.supports(torch.int32)  # not a float: the probe says no
