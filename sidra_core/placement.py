"""Where device ops run: the placement table the three frontends share.

A frontend recognises the ops it sees (aten ops for eager PyTorch and torch.compile, jaxpr
primitives for sidra_jax) and looks up here which unit runs them; only the translation of its own
op vocabulary into device ops stays in the frontend.
"""

from __future__ import annotations

UNITS = ("crossbar", "engine", "memory", "host")

# The floating-point formats the chip computes in; other floats (float64, complex) run on the host.
CHIP_FLOATS = ("float32", "float16", "bfloat16")


def matmul(a_is_weight: bool, b_is_weight: bool) -> str:
    """The unit of a matrix product a @ b: "crossbar" when exactly one operand is a weight (its
    conductances are programmed into tiles and the other streams through them), "engine" when
    neither or both are (the engine's INT8 MACs on digital operands: attention's activations, or
    two weights read from device memory). Where a frontend cannot present the weight to the
    crossbar in the layout the product gives it (a batched or left-hand weight in some aten ops),
    the product falls back as that frontend's other ops do."""
    return "crossbar" if a_is_weight != b_is_weight else "engine"



def _classes(**units: str) -> dict[str, str]:
    return {name: unit for unit, names in units.items() for name in names.split()}


# The unit class of each PyTorch op, by `OpOverload.name()` without the "aten::" namespace (eager
# dispatch and torch.compile's lowering both read it). Views are free by their schema; an op not
# listed falls back to the host.
#   crossbar     a product with a weight operand on the crossbars (`matmul` decides by the operands)
#   engine       one of the engine's own kernels (activation matmuls, non-linearities, norms,
#                softmax, attention, recurrent cells)
#   elementwise  the engine's vector unit: arithmetic, comparisons, reductions, one op each
#   memory       data movement in device memory (DRAM for stored tensors, SRAM for activations)
#   free         metadata and single-value queries
#   refused      results the device cannot hold (a clear error)
ATEN = _classes(
    crossbar="mm addmm linear matmul convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d.input "
             "conv_transpose3d.input quantized::linear_dynamic",
    engine="bmm baddbmm relu gelu tanh sigmoid silu _softmax _log_softmax _safe_softmax softmax.int log_softmax.int "
           "layer_norm batch_norm dropout native_layer_norm _native_batch_norm_legit_no_training native_batch_norm "
           "rms_norm group_norm native_group_norm instance_norm scaled_dot_product_attention _thnn_fused_lstm_cell "
           "_thnn_fused_gru_cell _native_multi_head_attention _transformer_encoder_layer_fwd",
    elementwise="add.Tensor add.Scalar sub.Tensor sub.Scalar mul.Tensor mul.Scalar div.Tensor div.Scalar "
                "div.Tensor_mode neg abs exp log sqrt rsqrt pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar reciprocal "
                "where.self where.ScalarOther where.ScalarSelf where.Scalar masked_fill.Scalar masked_fill.Tensor "
                "clamp clamp.Tensor clamp_min clamp_max maximum minimum min.other max.other sum.dim_IntList sum "
                "mean.dim mean amax amin max.dim min.dim var.correction erf exp2 eq.Tensor eq.Scalar ne.Tensor "
                "ne.Scalar lt.Tensor lt.Scalar le.Tensor le.Scalar gt.Tensor gt.Scalar ge.Tensor ge.Scalar "
                "logical_not logical_and logical_or bitwise_not bitwise_and.Tensor bitwise_or.Tensor "
                "bitwise_xor.Tensor bitwise_and.Scalar bitwise_or.Scalar __and__.Tensor __or__.Tensor __xor__.Tensor "
                "all all.dim any any.dim rsub.Scalar rsub.Tensor tril triu cumsum argmax argmin sign floor ceil "
                "round trunc hardtanh leaky_relu elu softplus mish hardswish hardsigmoid sin cos lerp.Scalar addcmul "
                "addcdiv threshold_backward gelu_backward tanh_backward sigmoid_backward "
                "add_.Tensor add_.Scalar sub_.Tensor sub_.Scalar mul_.Tensor mul_.Scalar div_.Tensor div_.Scalar "
                "neg_ clamp_ clamp_min_ masked_fill_.Scalar masked_fill_.Tensor lerp_.Scalar lerp_.Tensor addcmul_ "
                "addcdiv_ sqrt_ exp_ relu_ tanh_ sigmoid_ pow_.Scalar",
    memory="embedding index_select cat stack clone gather index.Tensor fill_.Scalar fill_.Tensor zero_ zeros_like "
           "ones_like full_like empty_like new_zeros new_ones new_full new_empty new_empty_strided empty.memory_format "
           "empty_strided contiguous repeat flip roll constant_pad_nd scatter.src scatter.value index_put_ index_put "
           "_index_put_impl_ slice_scatter select_scatter masked_select nonzero arange.start_step arange arange.start "
           "expand_copy _to_copy lift_fresh lift_fresh_copy alias detach split_with_sizes_copy "
           "embedding_dense_backward tril_indices triu_indices scalar_tensor full zeros ones",
    free="_unsafe_view _local_scalar_dense is_same_size equal is_nonzero sym_size.int sym_stride.int sym_numel "
         "sym_storage_offset _has_compatible_shallow_copy_type set_.source_Storage_storage_offset",
    refused="_nested_tensor_from_mask _nested_tensor_from_tensor_list _nested_from_padded "
            "_nested_from_padded_and_nested_example",
)


def aten_unit(name: str) -> str:
    """The unit class of a PyTorch op by its `OpOverload.name()` ("aten::add.Tensor"); "host"
    for an op the device has no kernel for."""
    return ATEN.get(name.removeprefix("aten::"), "host")


# The unit class of each JAX primitive, by name (so the table survives JAX renaming its modules),
# for sidra_jax's planner: free (views, conversions), memory, elementwise, engine (the engine's own
# kernels: JAX_ENGINE says which). Products (dot_general, conv_general_dilated) go by `matmul`.
JAX = _classes(
    free="reshape squeeze expand_dims broadcast_in_dim transpose convert_element_type copy copy_p slice stop_gradient "
         "reduce_precision sharding_constraint optimization_barrier device_put split real imag mesh_cast reshard "
         "pvary name",
    memory="concatenate pad gather scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter-max "
           "scatter_min scatter_max dynamic_slice dynamic_update_slice iota rev select_and_gather_add clamp_index",
    elementwise="add add_any sub mul div rem neg sign floor ceil round is_finite exp exp2 log log1p expm1 pow "
                "integer_pow sqrt rsqrt cbrt abs max min erf erfc erf_inv lgamma digamma sin cos tan asin acos atan "
                "atan2 sinh cosh asinh acosh atanh eq ne lt le gt ge and or not xor select_n clamp reduce_sum "
                "reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin cumsum cumprod "
                "cummax cummin cumlogsumexp square nextafter shift_left shift_right_logical shift_right_arithmetic "
                "population_count conj",
    engine="tanh logistic",
)
# The engine kernel (sidra_core.engine.ELEMENTWISE) of each engine primitive, and of the jax.nn
# functions that reach a jaxpr whole (a custom_jvp or a jit named after them).
JAX_ENGINE = {"tanh": "tanh", "logistic": "sigmoid"}
JAX_ENGINE_CALLS = {"relu": "relu", "silu": "silu"}
# Free primitives after which a weight is still a weight (the crossbar holds the viewed matrix).
JAX_WEIGHT_VIEWS = frozenset("transpose convert_element_type copy copy_p reshape squeeze expand_dims device_put "
                             "sharding_constraint optimization_barrier reduce_precision".split())


def jax_unit(name: str) -> str:
    """The unit class of a JAX primitive by name; "host" for one the device has no kernel for."""
    return JAX.get(name, "host")
