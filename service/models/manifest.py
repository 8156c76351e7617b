"""The model repository contract: ``models/<name>/<version>/manifest.json``.

Written by ``nmt export`` (offline), read by the server (online). Torch-free.

The two graphs (names of inputs and outputs are part of the contract; the
same for every attention kind, whose widths ``ctx_size``, ``state_size`` and
``key_size`` are ``service.models.config.ModelConfig``'s):

``encoder.onnx``
    inputs   src_ids      int64   (batch, src_len)      source piece ids, EOS last, PAD after
             src_lengths  int64   (batch,)              real length of each row (EOS included)
    outputs  annotations  float32 (batch, src_len, ctx_size)   h_j, both directions
             keys         float32 (batch, src_len, key_size)   what the attention scores
                                                        (U h_j + b; W_a h_j; width 0: none)
             init_state   float32 (batch, state_size)   the decoder's first carried state

``decoder_step.onnx``
    inputs   prev_tokens  int64   (rows,)               y_{i-1} (BOS at the first step)
             state        float32 (rows, state_size)    the carried state (s_{i-1}; [h; h~]; [s; c])
             annotations  float32 (rows, src_len, ctx_size)
             keys         float32 (rows, src_len, key_size)
             src_mask     bool    (rows, src_len)       True on real source tokens
             k            int64   ()                    how many top entries to return
    outputs  log_probs    float32 (rows, vocab_size)    log p(y_i | ...)
             topk_log_probs float32 (rows, k)           the k largest, descending
             topk_ids     int64   (rows, k)
             next_state   float32 (rows, state_size)
             attention    float32 (rows, src_len)       alpha_i (zeros for ``none``)

A step graph declares every input even where its kind reads none of it
(``none``: annotations, keys). ``model_config`` is ``ModelConfig.to_dict``'s form;
its ``attention`` names the kind (absent: ``bahdanau``, the repositories written
before the kinds).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from service.errors import ModelRepositoryError
from service.interface import SpecialIds
from service.languages import pair
from service.models import fields
from service.models.config import ModelConfig

FORMAT = "nmt-serve/model-repository/v1"
INT8_MAX_BLEU_LOSS = 0.3  # ``--precision auto`` serves int8 when it costs at most this
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # an exported manifest is a few KB; a bigger one is refused unread

ENCODER_INPUTS = {"src_ids": ["batch", "src_len"], "src_lengths": ["batch"]}
ENCODER_OUTPUTS = {"annotations": ["batch", "src_len", "ctx_size"],
                   "keys": ["batch", "src_len", "key_size"],
                   "init_state": ["batch", "state_size"]}
DECODER_INPUTS = {"prev_tokens": ["rows"], "state": ["rows", "state_size"],
                  "annotations": ["rows", "src_len", "ctx_size"],
                  "keys": ["rows", "src_len", "key_size"], "src_mask": ["rows", "src_len"],
                  "k": []}
DECODER_OUTPUTS = {"log_probs": ["rows", "vocab_size"], "topk_log_probs": ["rows", "k"],
                   "topk_ids": ["rows", "k"], "next_state": ["rows", "state_size"],
                   "attention": ["rows", "src_len"]}


@dataclass(frozen=True)
class GraphFiles:
    """One precision's pair of graphs, relative to the repository."""

    encoder: str
    decoder_step: str


@dataclass(frozen=True)
class Manifest:
    """A loaded, checksum-verified model repository."""

    root: Path  # the repository directory
    name: str  # e.g. "en-fr"
    version: str  # e.g. "1"
    model_config: ModelConfig  # sizes and kind, as export wrote them (checked when loaded)
    special: SpecialIds  # pad, unk, bos, eos: parsed once, handed to the tokenizer and the batch
    source_tokenizer: str  # SentencePiece model file
    target_tokenizer: str
    graphs: dict[str, GraphFiles]  # precision ("fp32", "int8") -> graph files
    files: dict[str, str]  # file -> sha256
    raw: dict[str, Any]  # the whole manifest (quality, parity, versions, ...)

    def path(self, file: str) -> Path:
        return self.root / file

    @property
    def attention(self) -> str:
        """The attention kind (``service.models.attention.KINDS``), checked when loaded."""
        return self.model_config.attention

    @property
    def languages(self) -> tuple[str, str]:
        """(source, target) language codes ("" where the manifest names none)."""
        return pair(self.raw)

    @property
    def max_source_tokens(self) -> int:
        return fields.check_limits(self.raw)  # checked when loaded

    def default_precision(self) -> tuple[str, str]:
        """The precision ``--precision auto`` serves, and why: int8 when the repository has int8
        graphs and its measured BLEU (``quality.engine``, by ``loadtest/quality_engine.py``) is
        within ``INT8_MAX_BLEU_LOSS`` of fp32's for greedy and beam search; else fp32. A repository
        shipped with one precision's graphs (``nmt prune``) serves that one."""
        if len(self.graphs) == 1:
            only = next(iter(self.graphs))
            return only, f"the repository has only {only} graphs"
        engine = (self.raw.get("quality") or {}).get("engine") or {}
        fp32, int8 = engine.get("fp32") or {}, engine.get("int8") or {}
        searches = [s for s in ("greedy", "beam5") if "bleu" in fp32.get(s, {}) and "bleu" in int8.get(s, {})]
        if len(searches) < 2:
            return "fp32", "no measured int8 BLEU for greedy and beam5 in quality.engine"
        losses = {s: fp32[s]["bleu"] - int8[s]["bleu"] for s in searches}
        if max(losses.values()) > INT8_MAX_BLEU_LOSS:
            return "fp32", f"int8 loses {max(losses.values()):.2f} BLEU (> {INT8_MAX_BLEU_LOSS})"
        return "int8", ", ".join(f"{s} BLEU {fp32[s]['bleu']} fp32 / {int8[s]['bleu']} int8" for s in searches)

    @property
    def sha256(self) -> str:
        """Checksum of the manifest file itself: identifies this exact repository."""
        return sha256_file(self.root / MANIFEST)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checksums(root: Path, files: list[str]) -> dict[str, str]:
    """file -> sha256 for the manifest's ``files`` field."""
    return {f: sha256_file(root / f) for f in sorted(files)}


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` (keys sorted, stable across runs) atomically: a server polling
    the repository, or an interrupted rewrite, never sees half a manifest."""
    out = root / MANIFEST
    tmp = out.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out


def parse_special_ids(mpath: Path, field: Any) -> SpecialIds:
    """The manifest's ``special_ids`` ({"pad": 0, "unk": 1, "bos": 2, "eos": 3})."""
    names = ("pad", "unk", "bos", "eos")
    if not isinstance(field, dict) or not all(isinstance(field.get(n), int) for n in names):
        raise ModelRepositoryError(f"{mpath}: special_ids must be an object with integer "
                                   f"{', '.join(names)}, got {str(field)[:80]!r}")
    return SpecialIds(**{n: field[n] for n in names})


SIZES: dict[str, Callable[[ModelConfig], int]] = {
    "ctx_size": lambda c: c.ctx_size, "key_size": lambda c: c.key_size,
    "state_size": lambda c: c.state_size, "vocab_size": lambda c: c.tgt_vocab_size}
"""The contract's fixed dimensions, from ``model_config`` (annotations: both directions)."""


def _field(mpath: Path, raw: dict[str, Any], name: str, expected: str, ok: Any) -> Any:
    """``raw[name]`` if ``ok(value)``, else ModelRepositoryError naming the field and the
    expected shape (a malformed field must not surface as a Python KeyError or TypeError)."""
    value = raw.get(name)
    try:
        good = ok(value)
    except (TypeError, AttributeError, KeyError):
        good = False
    if not good:
        raise ModelRepositoryError(f"{mpath}: {name} must be {expected}, got {str(value)[:80]!r}")
    return value


def _is_str_map(value: Any, keys: tuple[str, ...] = ()) -> bool:
    return (isinstance(value, dict) and all(isinstance(k, str) for k in value)
            and all(isinstance(value.get(k), str) for k in keys))


def _inside(root: Path, mpath: Path, file: str) -> None:
    """A file the manifest names must lie in the repository: a relative path without ``..``
    that resolves (symlinks followed) below ``root``; else the server would read and hash
    whatever path a hostile manifest names."""
    path = Path(file)
    if (not file or path.is_absolute() or ".." in path.parts
            or not (root / path).resolve().is_relative_to(root.resolve())):
        raise ModelRepositoryError(f"{mpath}: file {file[:80]!r} must be a relative path inside "
                                   "the repository")


def _parse(root: Path, mpath: Path, raw: dict[str, Any]) -> Manifest:
    """The typed manifest; each malformed field named with what was expected."""
    try:  # each field named: its type, its range, the kind's widths
        config = ModelConfig.from_dict(raw.get("model_config"), where="model_config")
    except ValueError as e:
        raise ModelRepositoryError(f"{mpath}: {e}") from None
    tokenizers = _field(mpath, raw, "tokenizers", 'an object {"source": file, "target": file}',
                        lambda v: _is_str_map(v, ("source", "target")))
    graphs = _field(mpath, raw, "graphs", 'an object precision -> {"encoder": file, '
                    '"decoder_step": file}', lambda v: isinstance(v, dict) and v and all(
                        _is_str_map(g, ("encoder", "decoder_step")) for g in v.values()))
    files = _field(mpath, raw, "files", "an object file -> sha256 (64 hex digits)",
                   lambda v: _is_str_map(v) and all(isinstance(h, str) and len(h) == 64
                                                    for h in v.values()))
    try:  # limits, languages, quality, shortlist: read later, so checked now
        fields.check(raw)
    except ValueError as e:
        raise ModelRepositoryError(f"{mpath}: {e}") from None
    name = _field(mpath, raw, "name", "a non-empty string", lambda v: isinstance(v, str) and v)
    version = _field(mpath, raw, "version", "a non-empty string or integer",
                     lambda v: isinstance(v, (str, int)) and str(v))
    return Manifest(root=root, name=name, version=str(version), model_config=config,
                    special=parse_special_ids(mpath, raw.get("special_ids")),
                    source_tokenizer=tokenizers["source"], target_tokenizer=tokenizers["target"],
                    graphs={p: GraphFiles(encoder=g["encoder"], decoder_step=g["decoder_step"])
                            for p, g in graphs.items()},
                    files=dict(files), raw=raw)


def load_manifest(root: Path, *, verify: bool = True) -> Manifest:
    """Read a repository's manifest; with ``verify``, check every file's sha256.

    Raises ModelRepositoryError naming the file for a missing directory, a
    missing or unreadable manifest, a malformed field, a file outside the
    repository, a missing file or a checksum mismatch.
    """
    root = Path(root)
    if not root.is_dir():
        raise ModelRepositoryError(f"{root}: model repository directory does not exist")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ModelRepositoryError(f"{mpath}: manifest missing")
    size = mpath.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ModelRepositoryError(f"{mpath}: a manifest must be at most {MAX_MANIFEST_BYTES} bytes, "
                                   f"got {size}")
    try:
        with mpath.open("rb") as f:  # bounded: it may grow after the stat
            raw = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of 4,300+ digits
        raise ModelRepositoryError(f"{mpath}: not valid JSON ({e})") from None
    except RecursionError:
        raise ModelRepositoryError(f"{mpath}: not valid JSON (nested too deep)") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ModelRepositoryError(f"{mpath}: format must be {FORMAT!r}, got {found!r}")
    manifest = _parse(root, mpath, raw)
    referenced = {manifest.source_tokenizer, manifest.target_tokenizer}
    shortlist = fields.check_shortlist(raw)
    if shortlist is not None:
        referenced.add(shortlist)
    for g in manifest.graphs.values():
        referenced |= {g.encoder, g.decoder_step}
    for file in sorted(referenced | set(manifest.files)):
        _inside(root, mpath, file)
    unlisted = sorted(referenced - set(manifest.files))
    if unlisted:
        raise ModelRepositoryError(f"{mpath}: files {unlisted} have no checksum in the manifest")
    if verify:
        for file, expected in sorted(manifest.files.items()):
            path = root / file
            if not path.is_file():
                raise ModelRepositoryError(f"{path}: file listed in the manifest is missing")
            actual = sha256_file(path)
            if actual != expected:
                raise ModelRepositoryError(
                    f"{path}: sha256 mismatch (manifest {expected[:12]}…, file {actual[:12]}…)")
    return manifest
