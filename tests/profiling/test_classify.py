"""Kernel classification on real kernel names seen in H3 block profiles (torch 2.x, cuDNN 9, CUTLASS)."""
import pytest

from dit_accel.profiling.classify import ATTENTION_RANGE, CATEGORIES, classify, classify_name, fused_kinds, is_fp8

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


def test_every_kernel_of_our_prep_is_classified_as_quantization():
    """The jitted kernels' names as the profiler sees them, read from the source (Triton is absent here)."""
    import ast
    from pathlib import Path

    import dit_accel.kernels.fp8_attention as fp8

    tree = ast.parse((Path(fp8.__file__).parent / "prep_triton_kernels.py").read_text())
    launched = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")
                and any(ast.unparse(d) == "triton.jit" for d in f.decorator_list)]
    assert sorted(launched) == ["_fp8_prep_amax_kernel", "_fp8_prep_pack_kernel", "_fp8_prep_single_kernel"]
    for name in launched:
        assert classify(name, "attention core") == "quantize", name
        assert classify(name, None) == "quantize", name


def test_generic_kernels_take_the_kind_of_their_range():
    mul = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<MulFunctor<float>>>"
    assert classify(mul, "rope") == "rope"
    assert classify(mul, "qk-norm") == "norm"
    assert classify(mul, "modulation + residual (block body)") == "modulation-elementwise"
    # A GEMM in the FFN stays a GEMM; only generic kernels are re-labelled by their range.
    assert classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "norms") == "gemm"


def test_unknown_kernels_are_other():
    assert classify_name("my_mystery_kernel") == "other"


# --- Compiled blocks (torch.compile / inductor): no module ranges, so the name alone decides. -----------------
# Inductor names its kernels triton_{poi|red|per|tem}_fused_{sorted original aten ops}_{n} on the GPU and
# cpp_fused_{ops}_{n} on the CPU (torch/_inductor/codegen/triton.py, cpp.py define_kernel; utils.py
# get_fused_kernel_name, descriptive_names="original_aten"). The cpp_ names below were generated on this
# machine (torch 2.13 CPU, run_and_get_code on tiny functions); the triton_ names carry the same op lists with
# the GPU prefix (the op list does not depend on the backend) and an illustrative kernel index.

def _gpu(kind, ops, n):
    return f"triton_{kind}_fused_{ops}_{n}"


INDUCTOR_NORM = [  # RMSNorm (hand-written and F.rms_norm give the same ops), LayerNorm, LN + adaLN modulation
    ("cpp_fused__to_copy_add_mean_mul_pow_rsqrt_0", ("norm",)),
    (_gpu("red", "_to_copy_add_mean_mul_pow_rsqrt", 3), ("norm",)),
    (_gpu("per", "_to_copy_add_mean_mul_pow_rsqrt", 7), ("norm",)),
    ("cpp_fused_native_layer_norm_0", ("norm",)),
    (_gpu("per", "native_layer_norm", 0), ("norm",)),
    ("cpp_fused_add_mul_native_layer_norm_0", ("norm", "modulation-elementwise")),  # LN(x) * (1 + scale) + shift
    (_gpu("red", "add_mul_native_layer_norm", 2), ("norm", "modulation-elementwise")),
]
INDUCTOR_ROPE = [
    ("cpp_fused_add_cat_mul_neg_split_0", ("rope",)),  # x*cos + cat(-x2, x1)*sin, halves by chunk
    ("cpp_fused__to_copy_add_cat_mul_neg_split_0", ("rope",)),  # same in fp32
    (_gpu("poi", "_to_copy_add_cat_mul_neg_slice", 4), ("rope",)),  # halves by slicing
    ("cpp_fused__to_copy_add_mul_slice_stack_sub_view_0", ("rope",)),  # interleaved: stack(x1*c - x2*s, x1*s + x2*c)
    ("cpp_fused__to_copy_view_view_as_complex_0", ("rope",)),  # complex RoPE: the repacking before the complex mul
    (_gpu("poi", "cat_cos_sin", 1), ("rope",)),  # RoPE tables computed in the block
    ("_rope_kernel", ("rope",)),  # our Triton RoPE (user kernel: its own name)
]
INDUCTOR_QUANTIZE = [  # torchao _choose_scale_float8 + _quantize_affine_float8, per row (PerRow)
    ("cpp_fused__to_copy_abs_amax_clamp_div_0", ("quantize",)),
    ("cpp_fused__to_copy_abs_amax_clamp_div_view_0", ("quantize",)),  # 3-D activation flattened to rows
    (_gpu("red", "_to_copy_abs_amax_clamp_div_view", 5), ("quantize",)),
    (_gpu("per", "_to_copy_abs_amax_clamp_div", 6), ("quantize",)),
    ("cpp_fused__to_copy_abs_amax_clamp_mul_reciprocal_0", ("quantize",)),  # x * (1/scale) variant
    (_gpu("red", "_to_copy_abs_amax_clamp_mul_reciprocal", 2), ("quantize",)),
    (_gpu("poi", "_to_copy_clamp_div", 8), ("quantize",)),  # scale-and-cast pass split from the amax reduction
    (_gpu("red", "abs_amax", 9), ("quantize",)),  # the amax reduction alone
    ("_fp8_prep_amax_kernel", ("quantize",)),
]
INDUCTOR_ELEMENTWISE = [
    ("cpp_fused_mul_silu_0", ("modulation-elementwise",)),  # SwiGLU
    (_gpu("poi", "mul_silu", 1), ("modulation-elementwise",)),
    ("cpp_fused_gelu_0", ("modulation-elementwise",)),  # GELU(tanh)
    ("cpp_fused_add_mul_0", ("modulation-elementwise",)),  # x*(1+scale)+shift, and r + gate*x
    (_gpu("poi", "add_mul_silu", 3), ("modulation-elementwise",)),
    ("cpp_fused_add_split_0", ("modulation-elementwise",)),  # adaLN chunk(6) + 1
    ("cpp_fused_gelu_view_0", ("modulation-elementwise",)),  # GELU after the extern addmm
    (_gpu("poi", "addmm_gelu", 0), ("modulation-elementwise",)),  # the bias add split off an addmm, + GELU
    (_gpu("poi", "add_1_convert_element_type_3_mul_2", 0), ("modulation-elementwise",)),  # "inductor_node" names
    ("triton_poi__1", ("modulation-elementwise",)),  # descriptive names off: still pointwise
]
INDUCTOR_COPY = [
    ("cpp_fused_clone_transpose_0", ("copy",)),  # x.transpose(1, 2).contiguous()
    ("cpp_fused__to_copy_0", ("copy",)),  # .float()
    ("cpp_fused__to_copy_view_1", ("copy",)),  # complex RoPE: repacking after view_as_real
    (_gpu("poi", "_to_copy_clone_transpose", 3), ("copy",)),
    (_gpu("poi", "cat", 2), ("copy",)),
]
INDUCTOR_OTHER_FAMILIES = [
    ("cpp_fused__softmax__to_copy_0", ("attention",)),  # softmax(x.float())
    (_gpu("red", "_softmax", 0), ("attention",)),
    ("cpp_fused_index_select_mul_0", ("modulation-elementwise", "gather-index")),
    (_gpu("poi", "index", 4), ("gather-index",)),
    (_gpu("red", "mean", 0), ("other",)),  # a bare reduction: no norm / softmax / quantization signature
    ("triton_red__0", ("other",)),  # descriptive names off: no ops to read
]


@pytest.mark.parametrize("name, kinds", INDUCTOR_NORM + INDUCTOR_ROPE + INDUCTOR_QUANTIZE + INDUCTOR_ELEMENTWISE
                         + INDUCTOR_COPY + INDUCTOR_OTHER_FAMILIES)
def test_inductor_kernel_kinds(name, kinds):
    assert fused_kinds(name) == kinds
    assert classify(name) in kinds


@pytest.mark.parametrize("family, category", [(INDUCTOR_NORM, "norm"), (INDUCTOR_ROPE, "rope"),
                                              (INDUCTOR_QUANTIZE, "quantize"),
                                              (INDUCTOR_ELEMENTWISE, "modulation-elementwise"),
                                              (INDUCTOR_COPY, "copy")])
def test_inductor_families(family, category):
    assert {classify(name) for name, _ in family} == {category}


def test_inductor_cross_module_fusions_name_every_kind_and_classify_as_the_most_specific():
    # Generated here from torchao's quantize primitives fed by the op before the FP8 linear: the LN + adaLN
    # modulation of the next module, SwiGLU, GELU all fuse into the quantization kernel.
    ln_mod_q = "cpp_fused__to_copy_abs_add_amax_clamp_div_mul_native_layer_norm_view_0"
    assert fused_kinds(ln_mod_q) == ("norm", "modulation-elementwise", "quantize")
    assert classify(ln_mod_q) == "quantize"
    swiglu_q = _gpu("red", "_to_copy_abs_amax_clamp_div_mul_silu_view", 11)
    assert fused_kinds(swiglu_q) == ("modulation-elementwise", "quantize") and classify(swiglu_q) == "quantize"
    assert fused_kinds("cpp_fused__to_copy_abs_amax_clamp_div_gelu_view_0") == ("modulation-elementwise", "quantize")
    # qk-norm (RMSNorm) then RoPE, one kernel: a norm first (the reduction shapes the kernel).
    qk = "cpp_fused__to_copy_add_cat_mean_mul_neg_pow_rsqrt_split_0"
    assert fused_kinds(qk) == ("norm", "rope") and classify(qk) == "norm"
    # A head transpose fused with the residual add: elementwise, with a copy.
    assert fused_kinds(_gpu("poi", "add_clone_mul", 6)) == ("modulation-elementwise", "copy")
    assert classify(_gpu("poi", "add_clone_mul", 6)) == "modulation-elementwise"
    # Known limit: a residual add + gate fused into an RMSNorm has the RMSNorm's own op list.
    assert fused_kinds(_gpu("red", "_to_copy_add_mean_mul_pow_rsqrt", 3)) == ("norm",)


def test_inductor_templates_are_gemms_even_with_fused_epilogues():
    # max-autotune Triton GEMM templates (select_algorithm: @triton_heuristics.template -> "tem").
    assert classify("triton_tem_fused_addmm_0") == "gemm"
    assert classify("triton_tem_fused_mm_2") == "gemm"
    assert classify("triton_tem_fused_0") == "gemm"  # template with no origins
    assert classify("triton_tem_fused_addmm_gelu_1") == "gemm"
    assert fused_kinds("triton_tem_fused_addmm_gelu_1") == ("gemm", "modulation-elementwise")
    assert classify("triton_tem_fused__scaled_mm_3") == "gemm"  # FP8 scaled_mm template
    assert classify("triton_tem_fused__scaled_mm__to_copy_abs_amax_clamp_div_4") == "gemm"  # quant prologue
    assert classify("triton_tem_fused_flex_attention_0") == "attention"  # flex attention is a template too
    # A matmul inductor decomposed into a reduction is GEMM work.
    assert classify("triton_red_fused_mm_0") == "gemm"


FP8_GEMMS = [
    # cuBLAS(Lt) FP8 kernels on sm_90 behind torch._scaled_mm (e4m3 operands, bf16 output, f32 accumulation)
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize2x1x1_execute_segment_k_off_"
    "kernel__5x_cublas",
    "nvjet_qqtst_128x256_64x4_2x1_v_bz_coopA_TNT",
    "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_bias_TNT",  # with a fused bias epilogue
    # CUTLASS 3.x sm90 FP8 GEMMs (named and as device_kernel, e.g. aten's rowwise-scaled _scaled_mm)
    "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_2x1x1_0_tnn_align16_warpspecialized_"
    "cooperative_fp8_fastaccum_epi_tma",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
    "cute::tuple<int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::float_e4m3_t, ...> > > >(...)",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_amax_kernel__5x_cublas",  # amax output: still gemm
    "aten::_scaled_mm",
]


@pytest.mark.parametrize("name", FP8_GEMMS)
def test_fp8_gemms_are_gemms_not_quantization(name):
    assert classify_name(name) == "gemm"
    assert classify(name) == "gemm"
    assert fused_kinds(name) == ("gemm",)


@pytest.mark.parametrize("name", FP8_GEMMS + [
    "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT",  # torchao's per-row FP8 linears on the H200
    "triton_tem_fused__scaled_mm_3",  # a max-autotune FP8 GEMM
    "kernel_cutlass_kernel_dit_accelkernelsfp8_attentionkernel_sm90Fp8AttentionSm90_object_at_",
    # v1: the sm90 kernel's name with v1's module and class (CuTe DSL names a kernel after both)
    "kernel_cutlass_kernel_dit_accelkernelsfp8_attentionkernel_mma_syncFp8AttentionMmaSync_object_at_",
])
def test_fp8_kernels_are_told_from_the_block_dtypes(name):
    assert is_fp8(name)


@pytest.mark.parametrize("name", [name for name, _ in REAL_KERNELS if "Fp8Attention" not in name])
def test_kernels_in_the_block_dtype_are_not_fp8(name):
    assert not is_fp8(name)


def test_quantize_kernels_with_gemm_library_namespaces_stay_quantize():
    assert classify_name("void fbgemm_gpu::quantize_fp8_row_kernel<c10::BFloat16>(...)") == "quantize"


def test_compiled_kernels_have_no_range_and_eager_ranges_still_apply():
    assert classify("triton_poi_fused_add_mul_0", None) == "modulation-elementwise"
    assert classify("triton_poi_fused_add_mul_0", "rope") == "rope"  # an eager-style range still re-labels
    assert classify(_gpu("red", "_to_copy_abs_amax_clamp_div", 5), ATTENTION_RANGE) == "quantize"
