"""CUDA's autocast op lists, op -> cast policy, as torch 2.13.0 registers them on the AutocastCUDA key.

Where they come from (torch's C++ sources are not installed):

- Which ops have an AutocastCUDA kernel: the installed dispatcher
  (`private_torch.ops_with_cuda_autocast()`): 119 ops in torch 2.13.0+cpu
  (git cf30153c4c131c8164ee7798e5022d810682e2cb), every one registered (`private_torch.registered_at`) at
  `aten/src/ATen/autocast_mode.cpp:181`; the file's other blocks at :225 (MPS), :335 (CPU), :476
  (MTIA), :514 (MAIA), :552 (XPU).
- The policy of each op: CUDA's block of `aten/src/ATen/autocast_mode.cpp` and the lists of
  `aten/src/ATen/autocast_mode.h` it expands (`AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`,
  `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE`; in the
  .cpp the cudnn convolutions, lower precision, and binary_cross_entropy, refused). No stored copy has
  the installed torch's six line numbers: pytorch/pytorch's own stored versions (commits cfed411f,
  008ec6b1) are older (one `Autocast` block, no MTIA/MAIA/XPU blocks); the closest copy found (a
  line-numbered reading of both files) registers CUDA at line 181 and MPS at 225 as torch 2.13 does,
  but CPU at 341 and MTIA at 484, not 335 and 476 (the MPS and CPU lists between them differ; everything
  up to CUDA's block sits at the same lines).
  Its header also lists named-tensor overloads (`softmax.Dimname`, `sum.dim_DimnameList`,
  `norm.names_ScalarOpt_dim`, ...) that torch 2.13 no longer has as operators: they are left out, and
  the table holds exactly the 119 ops the installed dispatcher names.
- Proved on the installed torch by `tests/test_cuda_autocast.py`, since the line numbers cannot: every op
  with an AutocastCUDA kernel is here and registered at the line above, and for every one of the 119 ops,
  called on tensors that report a CUDA device (so torch's own C++ kernel casts them), in float32 and in
  bfloat16, torch's kernel and ours make the same casts and the same call (dtype argument included), or
  raise the same error.
"""

from __future__ import annotations

LOWER_PRECISION_FP = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
BANNED = "banned"

REGISTERED_AT = "aten/src/ATen/autocast_mode.cpp:181"

_LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)

_FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

_FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)

_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

APPEND_DTYPE_TARGETS: dict[str, str] = {
    "aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
    "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype",
}
"""fp32_append_dtype: the overload each op is sent to, with the dtype appended."""


def _named(names: tuple[str, ...], policy: str) -> dict[str, str]:
    return {f"aten::{name}": policy for name in names}


CUDA_AUTOCAST_POLICIES: dict[str, str] = {
    **_named(_LOWER_PRECISION_FP, LOWER_PRECISION_FP),
    **_named(_FP32, FP32),
    **_named(_FP32_SET_OPT_DTYPE, FP32_SET_OPT_DTYPE),
    **dict.fromkeys(APPEND_DTYPE_TARGETS, FP32_APPEND_DTYPE),
    **_named(_PROMOTE, PROMOTE),
    "aten::binary_cross_entropy": BANNED,
}
"""Each op (dispatcher name, `aten::name.overload`) with CUDA's autocast kernel, and its cast policy."""

BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
"""What CUDA's autocast raises for binary_cross_entropy (the same words, so that a test expecting them passes)."""
