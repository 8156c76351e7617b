"""The int8 encoder, built node by node from the model's weights (``nmt export --quantize int8``).

The generic rewrite (``export.quantize``) leaves the encoder's ONNX ``GRU`` op in
fp32, and that op is most of the encoder's time (measured ~85% at batch 32,
src_len 20). Here the bidirectional GRU is spelled out:

- the input projections of every time step and both directions are one int8
  product, (batch, src_len, E) x (E, 6H), on the embedding stored as uint8 with
  one scale per token: the lookup is the row-quantized input, its scale a
  second lookup (one table scale, as the decoder step has, measured 0.116 max
  |diff| on the encoder's outputs, over its 0.1 tolerance);
- the recurrences run as one ``Scan`` over time whose body is both directions'
  GRU cells (PyTorch's gate order r, z, n), each an int8 product of the state
  (in [-1, 1]: constant scale 1/127) with W_hh, bias inside, then the gates;
- the backward direction reads its projections through ``ReverseSequence``
  with the source lengths, so padding comes after each row's tokens and never
  reaches the backward state (what ``pack_padded_sequence`` does); its outputs
  are reversed back the same way;
- the annotations are zero at padding (as ``pad_packed_sequence`` leaves them);
  the keys and the initial decoder state are int8 products of annotations (in
  [-1, 1], constant scale), biases inside.

Every product is u8 x u8 (exact, see ``export.quantize``) with constant or
per-row-independent scales, so a row's outputs do not depend on the other rows
of its batch, nor on the batch's padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from export.int8_step import UNIT, _Graph, _np, contract_model
from export.model import RNNSearch
from export.quantize import ZERO_POINT, symmetric_int8, unsigned
from service.models.manifest import SIZES, ENCODER_INPUTS, ENCODER_OUTPUTS


def _gru_cell(g: _Graph, name: str, h: str, x: str, w_hh: np.ndarray, b_hh: np.ndarray, H: int) -> str:
    """PyTorch's GRU cell on the state h (batch, H) given the input projection x (batch, 3H)."""
    gh = g.product(f"{name}/hidden_product", g.one("QuantizeLinear", [h, "unit", "zero_point"]), w_hh,
                   a_scale=UNIT, bias=b_hh)
    split = g.const(f"{name}/split", [2 * H, H], np.int64)
    gh_rz, gh_n = g.op("Split", [gh, split], 2, axis=1)
    x_rz, x_n = g.op("Split", [x, split], 2, axis=1)
    r, z = g.op("Split", [g.one("Sigmoid", [g.one("Add", [x_rz, gh_rz])]), g.const(f"{name}/split_rz", [H, H],
                                                                                   np.int64)], 2, axis=1)
    n = g.one("Tanh", [g.one("Add", [x_n, g.one("Mul", [r, gh_n])])])
    return g.one("Add", [n, g.one("Mul", [z, g.one("Sub", [h, n])])])


def _scan_body(rnn: torch.nn.GRU, H: int) -> onnx.GraphProto:
    """The Scan body: both directions' GRU cells, one time step."""
    body = _Graph(prefix="step/")
    for c in ("one", "unit"):
        body.const(f"step/{c}", 1.0 if c == "one" else UNIT)
    body.const("step/zero_point", ZERO_POINT, np.uint8)
    body_names = {"one": "step/one", "unit": "step/unit", "zero_point": "step/zero_point"}
    h_f = _gru_cell(body, "step/forward", "step/h_forward", "step/x_forward", _np(rnn.weight_hh_l0).T,
                    _np(rnn.bias_hh_l0), H)
    h_b = _gru_cell(body, "step/backward", "step/h_backward", "step/x_backward", _np(rnn.weight_hh_l0_reverse).T,
                    _np(rnn.bias_hh_l0_reverse), H)
    for node in body.nodes:  # the cells' constants are the body's own
        node.input[:] = [body_names.get(i, i) for i in node.input]
    body.nodes += [helper.make_node("Identity", [h_f], ["step/out_forward"]),
                   helper.make_node("Identity", [h_b], ["step/out_backward"]),
                   helper.make_node("Identity", [h_f], ["step/state_forward"]),
                   helper.make_node("Identity", [h_b], ["step/state_backward"])]

    def vi(name: str, shape: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    body_graph = helper.make_graph(
        body.nodes, "gru_step",
        [vi("step/h_forward", ["batch", H]), vi("step/h_backward", ["batch", H]),
         vi("step/x_forward", ["batch", 3 * H]), vi("step/x_backward", ["batch", 3 * H])],
        [vi("step/state_forward", ["batch", H]), vi("step/state_backward", ["batch", H]),
         vi("step/out_forward", ["batch", H]), vi("step/out_backward", ["batch", H])], body.inits)
    return body_graph


def build_int8_encoder(model: RNNSearch) -> onnx.ModelProto:
    cfg = model.config
    enc = model.encoder
    H = cfg.enc_hidden_size
    rnn = enc.rnn
    g = _Graph()
    g.const("one", 1.0)
    g.const("zero_point", ZERO_POINT, np.uint8)
    g.const("unit", UNIT)

    # the embedding as uint8 with one scale per token: the lookup is the row-quantized input
    table_q, token_scale = symmetric_int8(_np(enc.embed.weight), axis=1)  # (vocab, E), (vocab, 1)
    x_q = g.one("Gather", [g.const("embedding", unsigned(table_q), np.uint8), "src_ids"], axis=0)  # (b, L, E)
    row_scale = g.one("Gather", [g.const("embedding_scale", token_scale), "src_ids"], axis=0)  # (b, L, 1)
    w_in = np.concatenate([_np(rnn.weight_ih_l0).T, _np(rnn.weight_ih_l0_reverse).T], axis=1)  # (E, 6H)
    b_in = np.concatenate([_np(rnn.bias_ih_l0), _np(rnn.bias_ih_l0_reverse)])
    projected = g.product("input_product", x_q, w_in, a_scale=1.0, bias=None)  # (batch, src_len, 6H)
    projected = g.one("Add", [g.one("Mul", [projected, row_scale]), g.const("input_bias", b_in)])
    projected = g.one("Transpose", [projected], perm=[1, 0, 2])  # (src_len, batch, 6H)
    forward_x, backward_x = g.op("Split", [projected, g.const("split_directions", [3 * H, 3 * H], np.int64)], 2,
                                 axis=2)
    backward_x = g.one("ReverseSequence", [backward_x, "src_lengths"], batch_axis=1, time_axis=0)

    body_graph = _scan_body(rnn, H)
    zeros = g.one("ConstantOfShape", [g.one("Concat", [g.one("Shape", ["src_lengths"]),
                                                         g.const("hidden_dim", [H], np.int64)], axis=0)],
                  value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))  # (batch, H)
    _, _, out_f, out_b = g.op("Scan", [zeros, zeros, forward_x, backward_x], 4, body=body_graph,
                              num_scan_inputs=2)  # (src_len, batch, H) each
    out_b = g.one("ReverseSequence", [out_b, "src_lengths"], batch_axis=1, time_axis=0)
    annotations = g.one("Transpose", [g.one("Concat", [out_f, out_b], axis=2)], perm=[1, 0, 2])  # (b, L, 2H)
    positions = g.one("Range", [g.const("zero_i", 0, np.int64), g.one("Gather", [g.one("Shape", ["src_ids"]),
                                                                                 g.const("one_i", 1, np.int64)]),
                                g.const("step_i", 1, np.int64)])  # (src_len,)
    mask = g.one("Less", [g.one("Unsqueeze", [positions, g.const("axis0", [0], np.int64)]),
                          g.one("Unsqueeze", ["src_lengths", g.const("axis1", [1], np.int64)])])  # (batch, src_len)
    mask = g.one("Unsqueeze", [g.one("Cast", [mask], to=TensorProto.FLOAT), g.const("axis2", [2], np.int64)])
    annotations = g.one("Mul", [annotations, mask], "annotations")  # zero at padding

    ann_q = g.one("QuantizeLinear", [annotations, "unit", "zero_point"])  # in [-1, 1]
    g.product("keys_product", ann_q, _np(enc.keys.weight).T, a_scale=UNIT, bias=_np(enc.keys.bias), output="keys")
    first = g.one("Gather", [ann_q, g.const("first", 0, np.int64)], axis=1)  # (batch, 2H) uint8, position 0
    backward_first = g.one("Slice", [first, g.const("backward_from", [H], np.int64),
                                     g.const("backward_to", [2 * H], np.int64), g.const("last_axis", [1], np.int64)])
    init = g.product("init_product", backward_first, _np(enc.init_state.weight).T, a_scale=UNIT,
                     bias=_np(enc.init_state.bias))  # s_0 from backward h_1
    g.one("Tanh", [init], "init_state")

    dims = {symbol: size(cfg.to_dict()) for symbol, size in SIZES.items()}
    types = {"src_ids": TensorProto.INT64, "src_lengths": TensorProto.INT64}

    def value(name: str, axes: list[str]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT),
                                             [a if a in ("batch", "src_len") else dims[a] for a in axes])

    return contract_model(g, "encoder_int8", ENCODER_INPUTS, ENCODER_OUTPUTS, value,
                          producer="nmt-serve export.int8_encoder")


def write_int8_encoder(model: RNNSearch, target: Path) -> None:
    onnx.save(build_int8_encoder(model), str(target))
