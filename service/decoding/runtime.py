"""ONNX Runtime sessions for the two graphs of a model repository (CPU or CUDA).

On CPU, arrays go in and out as numpy. On CUDA the decoder runs with I/O binding: the per-row
context (annotations, keys, mask) is uploaded once per batch layout and stays on the device, and
``next_state`` is left on the device and fed back as the next ``state`` whenever the rows keep their
order (greedy without arrivals or departures). A beam reorder gathers the state on the host (rows x
state_size floats: small next to the context), since the graphs have no gather input. Only the small
outputs (top-k, attention) come back.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort

from service.decoding import fused, int8_form, packed, shortlist_rows
from service.decoding.arrays import SLOTS, Context, EncoderOutput, StepOutput  # noqa: F401 (their home before)
from service.decoding.fused_encoder import load as fused_encoder_load
from service.decoding.int8_form import FormChoice, Int8Form
from service.decoding.shortlist import INPUTS as SHORTLIST_TYPES
from service.decoding.shortlist import Candidates, Shortlist, shortlist_graph
from service.decoding.sessions import (CUDA_DEVICE_ID, CUDA_OPTIONS, PROVIDERS, _check_provider,  # noqa: F401
                                      _load_session, _session_options, provider_list, run_bound,
                                      session_shapes)
from service.errors import ModelRepositoryError, ProviderUnavailableError
from service.models.manifest import DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS, Manifest

STEP_OUTPUTS = ["topk_log_probs", "topk_ids", "next_state", "attention"]  # log_probs stays inside
SHORTLIST_INPUTS = {name: axes for name, (_, axes) in SHORTLIST_TYPES.items()}
KNOWN_ANSWER_ROWS, KNOWN_ANSWER_SRC_LEN = 24, 12  # the fixed batch both int8 forms must agree on
KNOWN_ANSWER_EOS = 3


class Runtime:
    """The encoder and decoder-step sessions of one precision on one provider."""

    def __init__(self, manifest: Manifest, *, precision: str, provider: str,
                 intra_op_threads: int | None, decoder_spinning: bool = True,
                 int8_form: FormChoice = FormChoice.AUTO, shortlist: Shortlist | None = None,
                 packed_attention: bool = True, shared_pool: bool = False,
                 fused_attention: bool = True, fused_encoder: bool = True, step_threads: int | None = None) -> None:
        """``step_threads``: the step sessions' intra-op threads where they differ from the encoder's
        (``intra_op_threads``; the engine process's server side: ``service.process.step_threads``). ``fused_attention``:
        the int8 step's attention (and middle: ``fused_middle``) by compiled kernels where they load and pass their
        check; packed attention is the form without. ``fused_encoder``: the int8 encoder's GRU likewise."""
        if precision not in manifest.graphs:
            raise ModelRepositoryError(f"{manifest.root}: no {precision!r} graphs "
                                       f"(the manifest has {sorted(manifest.graphs)})")
        providers = _check_provider(provider)
        graphs = manifest.graphs[precision]
        self.provider = provider
        paths = self._paths = (str(manifest.path(graphs.encoder)), str(manifest.path(graphs.decoder_step)))

        # shared_pool: both sessions run on ONNX Runtime's global pool (one thread per core, spinning)
        # instead of a pool each, where the encoder's could not spin without competing with the decoder's
        encoder_options = _session_options(intra_op_threads, shared=shared_pool)
        step_options = _session_options(step_threads or intra_op_threads, spinning=decoder_spinning,
                                        shared=shared_pool)

        def load(models: tuple[bytes | None, bytes | None]) -> tuple[ort.InferenceSession, ort.InferenceSession]:
            return (_load_session(paths[0], encoder_options, providers, ENCODER_INPUTS, ENCODER_OUTPUTS,
                                  model=models[0]),
                    _load_session(paths[1], step_options, providers, DECODER_INPUTS, DECODER_OUTPUTS,
                                  model=models[1]))

        self.encoder, self.decoder = load((None, None))
        # the int8 products' form (service.decoding.int8_form); CUDA and fp32 run the graphs as shipped
        self.int8_form: Int8Form | None = None
        self.int8_form_reason = "fp32 graphs" if precision != "int8" else f"provider {provider}"
        self._step_model: onnx.ModelProto | None = None  # the chosen form's step graph, once loaded
        self._encoder_model: onnx.ModelProto | None = None  # and its encoder graph (``_encoder_graph``)
        if precision == "int8" and provider == "cpu":
            self.int8_form, self.int8_form_reason = self._choose_form(paths, load, int8_form)
        int8_cpu, threads = precision == "int8" and provider == "cpu", fused.kernel_threads(
            intra_op_threads, shared_pool, decoder_spinning)  # the compiled kernels' threads
        self._fused_encoder = fused_encoder_load(self._encoder_graph(), lambda model: ort.InferenceSession(
            model, sess_options=encoder_options, providers=providers), _runner(self.encoder), self._encoder_feed(),
            threads=threads) if fused_encoder and int8_cpu else None
        self._padded: ort.InferenceSession | None = None  # with packed attention: the padded step beside it
        self._fused: fused.FusedStep | None = None
        if int8_cpu and fused_attention:
            query_options = _session_options(intra_op_threads, shared=shared_pool)
            self._fused = fused.load(self._step_graph(paths[1]), lambda model, quiet=False: ort.InferenceSession(
                model, sess_options=query_options if quiet else step_options, providers=providers),
                lambda feed: self.decoder.run(list(DECODER_OUTPUTS), dict(feed)), self._step_feed(),
                list(DECODER_OUTPUTS), threads=threads)
        if int8_cpu and packed_attention and self._fused is None:
            self._pack(paths[1], step_options, providers)
        self.shortlist: Shortlist | None = shortlist  # the texts' candidates, and its sessions
        if shortlist is not None:
            self._use_shortlist(paths[1], shortlist, options=step_options, providers=providers)
        if provider == "cuda" and PROVIDERS["cuda"] not in self.encoder.get_providers():
            raise ProviderUnavailableError(
                "provider 'cuda' requested but ONNX Runtime could not start it "
                "(no GPU visible, or CUDA/cuDNN libraries missing)")

    def _choose_form(self, paths: tuple[str, str], load: Callable, choice: FormChoice
                     ) -> tuple[Int8Form, str]:
        """The form for this CPU (``int8_form.decide``); u8 x s8 only if a known-answer batch gives
        the shipped form's bits in both graphs, else the shipped sessions stay (one log line)."""
        form, why = int8_form.decide(choice, int8_form.cpu_flags())
        if form is Int8Form.U8U8:
            return form, why
        try:
            converted = [int8_form.to_s8(g)[0].SerializeToString() for g in (self._encoder_graph(), onnx.load(paths[1]))]
            encoder, decoder = load((converted[0], converted[1]))
            problem = int8_form.known_answer(_runner(self.encoder), _runner(encoder), self._encoder_feed())
            if problem is None:
                problem = int8_form.known_answer(_runner(self.decoder), _runner(decoder), self._step_feed())
        except (ValueError, ModelRepositoryError) as e:  # a graph the conversion does not know
            problem = f"conversion failed: {e}"
        if problem is not None:
            int8_form.log.warning("int8 form u8s8 (%s) refused: it does not reproduce u8u8 on the "
                                  "known-answer batch (%s); serving u8u8", why, problem)
            return Int8Form.U8U8, f"u8s8 failed the known-answer check ({problem})"
        self.encoder, self.decoder = encoder, decoder
        self._step_model = onnx.ModelProto.FromString(converted[1])
        self._encoder_model = onnx.ModelProto.FromString(converted[0])
        return form, why

    def _pack(self, path: str, options: ort.SessionOptions, providers: list[Any]) -> None:
        """The step with packed attention where it reproduces the padded step (``packed.load``)."""
        inputs = packed.step_inputs(DECODER_INPUTS)
        found = packed.load(self._step_graph(path), lambda model: (
            _load_session(path, options, providers, inputs, DECODER_OUTPUTS, model=model)),
            _runner(self.decoder), self._step_feed())
        if found is not None:
            self._padded = self.decoder
            self.decoder, self._step_model = found

    @property
    def attention_form(self) -> str:
        """How the step computes its attention: fused (the kernel), packed, or padded (the graph's)."""
        return "fused" if self._fused is not None else "packed" if self.packed else "padded"

    @property
    def encoder_form(self) -> str:
        """How the encoder runs: fused (its GRU by the kernel, int8 recurrence) or graph."""
        return "fused" if self._fused_encoder is not None else "graph"

    @property
    def shortlist_rows(self) -> bool:
        """Whether the shortlist's steps score each row over its own candidates (else over the union)."""
        return self.shortlist is not None and "rows" in self._step_sessions

    @property
    def middle_form(self) -> str:
        """How the per-row shortlist's step runs its middle: compiled (``fused_middle``), or graph."""
        return shortlist_rows.middle_form(self._step_sessions["rows"]) if self.shortlist_rows else "graph"

    @property
    def packed(self) -> bool:
        """Packed attention (``service.decoding.packed``): ``decoder`` is the packed step."""
        return self._padded is not None

    def _step_graph(self, path: str) -> onnx.ModelProto:
        """The step graph as served so far: converted in memory, or as shipped."""
        return self._step_model if self._step_model is not None else onnx.load(path)

    def _use_shortlist(self, path: str, shortlist: Shortlist, *, options: ort.SessionOptions,
                       providers: list[Any]) -> None:
        """The step's two shortlist sessions (gathered, masked; ``service.decoding.shortlist``)
        from the chosen form's graph; ModelRepositoryError when the graph has no such output layer."""
        step = self._step_graph(path)
        try:
            gathered, self.output_layer = shortlist_graph(step)
            masked = shortlist_graph(step, gather=False, layer=False)[0]
        except ValueError as e:
            raise ModelRepositoryError(f"{path}: no shortlist for this graph ({e})") from None
        if self._fused is not None:  # the same cut as the checked step's (ValueError: a bug, not a model's fault)
            masked_step = self._fused.like(masked)  # the per-row step's reference, and the union's fallback
            rows = shortlist_rows.load(step, self._fused, masked_step, self.output_layer, shortlist.always,
                                       self._step_feed())
            self._step_sessions = ({"rows": rows} if rows is not None else
                                   {True: self._fused.like(gathered), False: masked_step})
            return
        inputs = packed.step_inputs(DECODER_INPUTS) if self.packed else DECODER_INPUTS
        self._step_sessions = {
            kind: _load_session(path, options, providers, {**inputs, **extra}, DECODER_OUTPUTS,
                                model=graph.SerializeToString())
            for kind, graph, extra in ((True, gathered, SHORTLIST_INPUTS),
                                       (False, masked, {"row_bias": ["rows", "vocab_size"]}))}

    def _encoder_graph(self) -> onnx.ModelProto:
        """The encoder graph as served so far: converted in memory, or as shipped (loaded once)."""
        self._encoder_model = self._encoder_model if self._encoder_model is not None else onnx.load(self._paths[0])
        return self._encoder_model

    def _encoder_feed(self) -> dict[str, np.ndarray]:
        return int8_form.encoder_feed(batch=KNOWN_ANSWER_ROWS, src_len=KNOWN_ANSWER_SRC_LEN, eos=KNOWN_ANSWER_EOS,
                                      vocab_size=int8_form.source_vocabulary(self._encoder_graph()))

    def _step_feed(self) -> dict[str, np.ndarray]:
        shapes = session_shapes(self.decoder)
        return int8_form.step_feed(rows=KNOWN_ANSWER_ROWS, src_len=KNOWN_ANSWER_SRC_LEN,
                                   state_size=shapes["state"][1], ctx_size=shapes["annotations"][2],
                                   key_size=shapes["keys"][2], vocab_size=shapes["log_probs"][1])

    def graph_shapes(self) -> dict[str, dict[str, list[int | str | None]]]:
        """Each graph's inputs and outputs, name -> shape (sizes and axis names), as its session has them."""
        return {"encoder": session_shapes(self.encoder), "decoder_step": session_shapes(self.decoder)}

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> EncoderOutput:
        """src_ids (batch, src_len) int64, src_lengths (batch,) int64."""
        annotations, keys, init_state = (self._fused_encoder or self.encoder).run(
            list(ENCODER_OUTPUTS), {"src_ids": src_ids, "src_lengths": src_lengths})
        return EncoderOutput(annotations=annotations, keys=keys, init_state=init_state)

    def context(self, annotations: np.ndarray, keys: np.ndarray, src_mask: np.ndarray) -> Context:
        """The step's context for a new row layout (uploaded once on CUDA)."""
        if self.provider == "cpu":
            lengths, columns = packed.feed_lengths(src_mask), src_mask.shape[1]
            # little padding: the padded step (same bits) without the gathers; the shortlist's
            # sessions take packed indices only
            use = self.packed and (self.shortlist is not None or packed.pays(lengths, columns))
            indices = packed.indices(lengths, columns) if use else None
            return Context(annotations=annotations, keys=keys, src_mask=src_mask, packed=indices)
        return Context(*(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), "cuda", CUDA_DEVICE_ID)
                         for a in (annotations, keys, src_mask)))

    def state(self, state: np.ndarray) -> Any:
        """A host state array (rows, state_size) in the form ``step`` takes."""
        if self.provider == "cpu":
            return state
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(state), "cuda", CUDA_DEVICE_ID)

    def join_states(self, state: Any, new: np.ndarray) -> Any:
        """The running rows' ``state`` (None: none) with ``new`` host rows after them; a fused step's
        carried product grows by the new rows' alone."""
        joined = self.state(new if state is None else np.concatenate([self.host_state(state), new]))
        if self._fused is not None:
            self._fused.join(state, joined, new)
        return joined

    def host_state(self, state: Any) -> np.ndarray:
        """The state as a host array (rows, state_size)."""
        return state if isinstance(state, np.ndarray) else state.numpy()

    def gather_state(self, state: Any, index: np.ndarray) -> Any:
        """Rows ``index`` (new_rows,) of the state: a no-op when the order is unchanged."""
        if len(index) == _rows(state) and np.array_equal(index, np.arange(len(index))):
            return state
        rows = self.state(self.host_state(state)[index])
        if self._fused is not None:  # the product carried to the next step follows
            self._fused.follow(state, rows, index)
        return rows

    def step(self, prev_tokens: np.ndarray, state: Any, context: Context, k: int,
             candidates: Candidates | None = None) -> StepOutput:
        """One decoder step on all rows; k = how many top candidates per row; ``candidates``: the
        batch's shortlist (None: the whole vocabulary)."""
        session = self.step_session(context.packed is not None, candidates)
        extra = {} if candidates is None else candidates.feed
        if self.provider == "cpu":
            topk_lp, topk_ids, next_state, attention = session.run(
                STEP_OUTPUTS, {**_step_feed(prev_tokens, state, context, k), **extra})
            return StepOutput(topk_log_probs=topk_lp, topk_ids=topk_ids, attention=attention,
                              next_state=next_state)
        return self._step_bound(session, prev_tokens, state, context, k, extra)

    def step_outputs(self, prev_tokens: np.ndarray, state: np.ndarray, context: Context, k: int
                     ) -> dict[str, np.ndarray]:
        """Every output of the step graph, ``log_probs`` included (CPU): for verification."""
        session = self.step_session(context.packed is not None)
        outputs = session.run(list(DECODER_OUTPUTS), _step_feed(prev_tokens, state, context, k))
        return dict(zip(DECODER_OUTPUTS, outputs))

    def step_session(self, packed_feed: bool, candidates: Candidates | None = None) -> Any:
        """The step session for a context with (``packed_feed``) or without packed indices."""
        if candidates is not None:
            return self._step_sessions["rows" if candidates.per_row else candidates.gathered]
        if self._fused is not None:
            return self._fused
        return self._padded if self._padded is not None and not packed_feed else self.decoder

    def _step_bound(self, session: ort.InferenceSession, prev_tokens: np.ndarray, state: Any,
                    context: Context, k: int, extra: dict[str, np.ndarray]) -> StepOutput:
        topk_lp, topk_ids, next_state, attention = run_bound(
            session, {"prev_tokens": prev_tokens, **extra, "k": np.array(k, dtype=np.int64)},
            {"state": state, "annotations": context.annotations, "keys": context.keys, "src_mask": context.src_mask},
            STEP_OUTPUTS, on_device={"next_state"})
        return StepOutput(topk_log_probs=topk_lp.numpy(), topk_ids=topk_ids.numpy(),
                          attention=attention.numpy(), next_state=next_state)


def _runner(session: ort.InferenceSession) -> Callable[[dict], list[np.ndarray]]:
    return lambda feed: session.run(None, dict(feed))


def _step_feed(prev_tokens: np.ndarray, state: Any, context: Context, k: int) -> dict[str, Any]:
    feed = {"prev_tokens": prev_tokens, "state": state, "annotations": context.annotations, "keys": context.keys,
            "k": np.array(k, dtype=np.int64), **({} if context.slots is None else {SLOTS: context.slots})}
    return {**feed, "src_mask": context.src_mask} if context.packed is None else {**feed, **context.packed}


def _rows(state: Any) -> int:
    return state.shape[0] if isinstance(state, np.ndarray) else state.shape()[0]
