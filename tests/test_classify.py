"""Kernel classification on real kernel names seen in H3 block profiles (torch 2.x, cuDNN 9, CUTLASS)."""
import pytest

from dit_accel.profiling.classify import CATEGORIES, classify, classify_name

REAL_KERNELS = [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, false, false, "
     "false, true, true, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "attention"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensorptrbf16gmem",
     "attention"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(Params)", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>"
     "(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, "
     "c10::BFloat16*)", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
     "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, "
     "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)", "modulation-elementwise"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::"
     "operator()() const::{lambda(c10::BFloat16)#1}> >(int, at::native::gpu_kernel_impl_nocast<...>)", "copy"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, ...)", "gather-index"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::"
     "OpaqueType<2u>, unsigned int, 4, 64, 64>(...)", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel"
     "(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
     "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)", "modulation-elementwise"),
    ("triton_poi_fused_add_mul_0", "modulation-elementwise"),
    ("_fp8_prep_amax_kernel", "quantize"),  # our FP8 prep (Triton)
    ("_fp8_prep_pack_kernel", "quantize"),
    ("kernel_cutlass_kernel_dit_accelkernelsfp8_attentionkernel_sm90Fp8AttentionSm90_object_at_", "attention"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
     "float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<...>)", "other"),
    ("aten::addmm", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::index_select", "gather-index"),
    ("aten::mul", "modulation-elementwise"),
    ("aten::copy_", "copy"),
    ("aten::_fused_rms_norm", "norm"),
]


@pytest.mark.parametrize("name, category", REAL_KERNELS)
def test_real_kernel_names(name, category):
    assert classify_name(name) == category


def test_every_category_is_declared():
    assert {category for _, category in REAL_KERNELS} <= set(CATEGORIES)


def test_kernels_inside_the_attention_core_are_attention_whatever_their_name():
    # The math backend runs attention as a GEMM and a softmax: both count as attention time.
    assert classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "attention core") == "attention"
    assert classify("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", "attention core") == "attention"


def test_quantization_stays_quantization_inside_the_attention_core():
    assert classify("_fp8_prep_amax_kernel", "attention core") == "quantize"


def test_generic_kernels_take_the_kind_of_their_range():
    mul = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<MulFunctor<float>>>"
    assert classify(mul, "rope") == "rope"
    assert classify(mul, "qk-norm") == "norm"
    assert classify(mul, "modulation + residual (block body)") == "modulation-elementwise"
    # A GEMM in the FFN stays a GEMM; only generic kernels are re-labelled by their range.
    assert classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "norms") == "gemm"


def test_unknown_kernels_are_other():
    assert classify_name("my_mystery_kernel") == "other"
