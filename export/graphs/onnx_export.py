"""The two ONNX graphs of a model: the encoder and one decoder step, fp32 and int8.

Names and axes are the contract's (``service/models/manifest.py``); the int8
variants are batch-invariant (``export.graphs.quantize``). ``nmt export``
(``export.graphs.repository``) writes them into a model repository.

Both graphs use the TorchScript exporter (``dynamo=False``): it turns
``pack_padded_sequence`` into an ONNX GRU with ``sequence_lens``, so padding
never reaches the backward direction; the dynamo exporter drops it. The
example batch has several rows of different lengths, since a batch of one
can freeze the batch axis; the verifier proves the axes stay dynamic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch
from torch import nn

from export.graphs.int8_step import write_int8_step
from export.graphs.quantize import quantize_graph
from export.graphs.parity import DYNAMIC_AXES
from export.train.model import RNNSearch
from service.models.config import ModelConfig
from service.models.manifest import DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS, SIZES
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

OPSET = 17
GRAPHS = {"fp32": {"encoder": "encoder.onnx", "decoder_step": "decoder_step.onnx"},
          "int8": {"encoder": "encoder.int8.onnx", "decoder_step": "decoder_step.int8.onnx"}}
EXAMPLE_LENGTHS = (4, 6, 2)  # batch >= 2, lengths differ: no axis specializes on the example
EXAMPLE_K = 3


class EncoderGraph(nn.Module):
    """(src_ids, src_lengths) -> (annotations, keys, init_state)."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, src_ids: torch.Tensor, src_lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.encoder(src_ids, src_lengths)


class DecoderStepGraph(nn.Module):
    """One decoder step plus the top-k of its log-probabilities (k is an input)."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.model = model

    def forward(self, prev_tokens: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor,
                keys: torch.Tensor, src_mask: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        log_probs, next_state, attention = self.model.step_log_probs(
            prev_tokens, state, annotations, keys, src_mask)  # (rows, vocab_size)
        # a tensor k is traced as a graph input, not baked in as a constant
        topk_log_probs, topk_ids = torch.topk(log_probs, k, dim=1)  # (rows, k)
        return log_probs, topk_log_probs, topk_ids, next_state, attention


def dynamic_axes(*contracts: dict[str, list[str]]) -> dict[str, dict[int, str]]:
    """The contract's symbolic axes, in the exporter's ``dynamic_axes`` form."""
    return {name: {i: axis for i, axis in enumerate(axes) if axis in DYNAMIC_AXES}
            for contract in contracts for name, axes in contract.items()
            if any(axis in DYNAMIC_AXES for axis in axes)}


def example_inputs(model: RNNSearch) -> tuple[tuple, tuple]:
    """Example arguments for tracing both graphs."""
    cfg = model.config
    lengths = torch.tensor(EXAMPLE_LENGTHS)  # (batch,)
    src = torch.full((len(lengths), max(EXAMPLE_LENGTHS)), PAD_ID, dtype=torch.long)  # (batch, src_len)
    for row, n in enumerate(EXAMPLE_LENGTHS):
        src[row, : n - 1] = EOS_ID + 1 + torch.arange(n - 1) % max(cfg.src_vocab_size - EOS_ID - 1, 1)
        src[row, n - 1] = EOS_ID
    with torch.inference_mode():
        annotations, keys, state = model.encoder(src, lengths)
    prev = torch.full((len(lengths),), BOS_ID, dtype=torch.long)  # (rows,)
    k = torch.tensor(min(EXAMPLE_K, cfg.tgt_vocab_size))
    return (src, lengths), (prev, state.clone(), annotations.clone(), keys.clone(), src != PAD_ID, k)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exporter and quantizer chatter: Python warnings, root-logger advice
    and C++ shape-inference warnings on fd 2 (replayed if the export fails)."""
    root, level = logging.getLogger(), logging.getLogger().level
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            root.setLevel(level)


def export_graphs(model: RNNSearch, root: Path, *, quantize: bool) -> None:
    """Write the fp32 graphs (and their int8 variants) into ``root``."""
    encoder_args, decoder_args = example_inputs(model)
    jobs = ((EncoderGraph(model), encoder_args, GRAPHS["fp32"]["encoder"], ENCODER_INPUTS, ENCODER_OUTPUTS),
            (DecoderStepGraph(model), decoder_args, GRAPHS["fp32"]["decoder_step"], DECODER_INPUTS,
             DECODER_OUTPUTS))
    with quiet(), torch.inference_mode():
        for module, args, file, inputs, outputs in jobs:
            torch.onnx.export(module.eval(), args, str(root / file), input_names=list(inputs),
                              output_names=list(outputs), dynamic_axes=dynamic_axes(inputs, outputs),
                              opset_version=OPSET, dynamo=False)
            declare_inputs(root / file, inputs, model.config)
        if quantize:
            # the encoder is the fp32 graph with its products in int8 and its GRU op left fp32 (an
            # all-int8 encoder, the GRU as int8 cell steps in a Scan, was slower at 2 threads for
            # every join size the server sees: ``loadtest/results/notes.md``; git history keeps
            # it); RNNsearch's step is built from the weights, with few passes around its products
            # (``export.graphs.int8_step``), the other kinds' step is the generic rewrite of its
            # fp32 graph, batch-invariant the same way
            quantize_graph(root / GRAPHS["fp32"]["encoder"], root / GRAPHS["int8"]["encoder"])
            if model.config.attention == "bahdanau":
                write_int8_step(model, root / GRAPHS["int8"]["decoder_step"])
            else:
                quantize_graph(root / GRAPHS["fp32"]["decoder_step"], root / GRAPHS["int8"]["decoder_step"])


ONNX_TYPES = {"prev_tokens": onnx.TensorProto.INT64, "src_ids": onnx.TensorProto.INT64,
              "src_lengths": onnx.TensorProto.INT64, "k": onnx.TensorProto.INT64,
              "src_mask": onnx.TensorProto.BOOL}  # the others are float32


def declare_inputs(path: Path, contract: dict[str, list[str]], config: ModelConfig) -> None:
    """Give the graph back the contract's inputs the exporter pruned because this kind does not
    read them (``none``: annotations, keys; ``luong-dot``: keys): every kind's graph takes the
    same feed. ONNX Runtime accepts an input that no node consumes."""
    graph = onnx.load(str(path))
    have = {i.name for i in graph.graph.input}
    missing = [name for name in contract if name not in have]
    if not missing:
        return
    for name in missing:
        dims = [SIZES[a](config) if a in SIZES else a for a in contract[name]]
        graph.graph.input.append(onnx.helper.make_tensor_value_info(
            name, ONNX_TYPES.get(name, onnx.TensorProto.FLOAT), dims))
    order = list(contract)  # the contract's order, as the exporter writes the others
    inputs = sorted(graph.graph.input, key=lambda i: order.index(i.name))
    del graph.graph.input[:]
    graph.graph.input.extend(inputs)
    onnx.checker.check_model(graph)
    onnx.save(graph, str(path))
