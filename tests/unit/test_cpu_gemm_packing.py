"""vLLM-CPU engines leave small fp32 linear layers unpacked (mrl.rollout.vllm_cpu._unpack_small_cpu_gemms):
an in-place sync then writes where their kernel reads. Larger layers, other dtypes and non-2-D weights
(e.g. a GDN conv1d's [dim, 1, 4]) keep vLLM's packing."""

import pytest
import torch

pytest.importorskip("vllm")


def _layer(shape, dtype=torch.float32) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(shape).to(dtype), requires_grad=False)
    return layer


def test_small_fp32_layers_stay_unpacked_and_compute_the_same():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    from mrl.rollout.vllm_cpu import CPU_UNPACKED_GEMM_MAX_ELEMENTS, _unpack_small_cpu_gemms

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    _unpack_small_cpu_gemms()
    _unpack_small_cpu_gemms()  # once is enough: a second call does not wrap again
    method = UnquantizedLinearMethod()
    assert method.process_weights_after_loading.__func__.mrl_small_unpacked
    side = int(CPU_UNPACKED_GEMM_MAX_ELEMENTS ** 0.5)
    small, large = _layer((side, side)), _layer((side * 2, side))
    expected = {name: layer.weight.clone() for name, layer in (("small", small), ("large", large))}
    x = torch.randn(5, side)
    for layer in (small, large):
        method.process_weights_after_loading(layer)
    assert small._cpu_skip_gemm_dispatch and small.weight.shape == (side, side)  # kept: the kernel reads it
    assert not getattr(large, "_cpu_skip_gemm_dispatch", False) and large.weight.numel() == 0  # packed away
    for name, layer in (("small", small), ("large", large)):
        out = layer.cpu_linear(x, layer.weight, None)
        torch.testing.assert_close(out, x @ expected[name].t(), rtol=1e-5, atol=1e-5)
    for shape, dtype in (((side, 1, 4), torch.float32), ((side, side), torch.bfloat16)):
        other = _layer(shape, dtype)
        try:
            method.process_weights_after_loading(other)
        except Exception:  # noqa: BLE001 - what vLLM does with it is vLLM's; only the flag is ours
            pass
        assert not getattr(other, "_cpu_skip_gemm_dispatch", False), (shape, dtype)
