"""op_profile: torch.profiler self times as shares of the wall time, matmuls apart."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.engine.op_profile import format_profile, is_weight_matmul, profile_ops
from pdserve.models.linear_kernels import ONEDNN, gemm, pack


def test_matmuls_and_other_ops_are_told_apart():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> None:
        for _ in range(3):
            torch.mm(a, b).relu_()

    profile = profile_ops(step)
    by_name = {op.name: op for op in profile.ops}
    assert by_name["aten::mm"].calls == 3 and by_name["aten::relu_"].calls == 3
    assert profile.matmul_seconds == by_name["aten::mm"].seconds
    assert 0 < profile.non_matmul_share < 1
    table = format_profile(profile, steps=3, top=2)
    assert table.splitlines()[0].split() == ["op", "calls/step", "ms/step", "of", "step"]
    assert "aten::mm" in table and table.splitlines()[-1].startswith("step ")


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
def test_the_models_onednn_linear_counts_as_a_weight_matmul():
    weight, x = torch.randn(128, 128), torch.randn(32, 128)
    packed = pack(weight)
    profile = profile_ops(lambda: gemm("packed", x, weight, None, packed))
    by_name = {op.name: op for op in profile.ops}
    assert profile.matmul_seconds == by_name["mkldnn::_linear_pointwise"].seconds > 0


def test_gpu_kernels_of_weight_matmuls_are_told_from_attention_and_the_rest():
    for kernel in (
        "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>",
        "aten::mm",
    ):
        assert is_weight_matmul(kernel), kernel
    for kernel in (
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80 (gemm-based attention)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
    ):
        assert not is_weight_matmul(kernel), kernel
