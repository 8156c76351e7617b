from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_KIND_UNSPECIFIED: _ClassVar[ResultKind]
    RESULT_KIND_PARTIAL: _ClassVar[ResultKind]
    RESULT_KIND_FINAL: _ClassVar[ResultKind]
RESULT_KIND_UNSPECIFIED: ResultKind
RESULT_KIND_PARTIAL: ResultKind
RESULT_KIND_FINAL: ResultKind

class TranslateRequest(_message.Message):
    __slots__ = ("texts", "model", "options", "source_language", "target_language")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model: str
    options: DecodingOptions
    source_language: str
    target_language: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ...) -> None: ...

class DecodingOptions(_message.Message):
    __slots__ = ("beam_size", "num_hypotheses", "length_penalty", "max_decoding_length", "max_length_ratio", "return_scores", "return_attention")
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_RATIO_FIELD_NUMBER: _ClassVar[int]
    RETURN_SCORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    beam_size: int
    num_hypotheses: int
    length_penalty: float
    max_decoding_length: int
    max_length_ratio: float
    return_scores: bool
    return_attention: bool
    def __init__(self, beam_size: _Optional[int] = ..., num_hypotheses: _Optional[int] = ..., length_penalty: _Optional[float] = ..., max_decoding_length: _Optional[int] = ..., max_length_ratio: _Optional[float] = ..., return_scores: _Optional[bool] = ..., return_attention: _Optional[bool] = ...) -> None: ...

class TranslateResponse(_message.Message):
    __slots__ = ("translations", "kind", "model", "model_version")
    TRANSLATIONS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    translations: _containers.RepeatedCompositeFieldContainer[Translation]
    kind: ResultKind
    model: str
    model_version: str
    def __init__(self, translations: _Optional[_Iterable[_Union[Translation, _Mapping]]] = ..., kind: _Optional[_Union[ResultKind, str]] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class Translation(_message.Message):
    __slots__ = ("hypotheses", "source_tokens")
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hypotheses: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    source_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hypotheses: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ..., source_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class Hypothesis(_message.Message):
    __slots__ = ("text", "score", "tokens", "alignments")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    score: float
    tokens: _containers.RepeatedScalarFieldContainer[str]
    alignments: _containers.RepeatedCompositeFieldContainer[Alignment]
    def __init__(self, text: _Optional[str] = ..., score: _Optional[float] = ..., tokens: _Optional[_Iterable[str]] = ..., alignments: _Optional[_Iterable[_Union[Alignment, _Mapping]]] = ...) -> None: ...

class Alignment(_message.Message):
    __slots__ = ("target_index", "source_index", "source_token", "weights")
    TARGET_INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    target_index: int
    source_index: int
    source_token: str
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, target_index: _Optional[int] = ..., source_index: _Optional[int] = ..., source_token: _Optional[str] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "sha256", "precision", "provider", "languages", "quality", "is_default", "attention", "int8_form", "shortlist", "source_language", "target_language")
    class QualityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    INT8_FORM_FIELD_NUMBER: _ClassVar[int]
    SHORTLIST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    sha256: str
    precision: str
    provider: str
    languages: _containers.RepeatedScalarFieldContainer[str]
    quality: _containers.ScalarMap[str, float]
    is_default: bool
    attention: str
    int8_form: str
    shortlist: bool
    source_language: str
    target_language: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., precision: _Optional[str] = ..., provider: _Optional[str] = ..., languages: _Optional[_Iterable[str]] = ..., quality: _Optional[_Mapping[str, float]] = ..., is_default: _Optional[bool] = ..., attention: _Optional[str] = ..., int8_form: _Optional[str] = ..., shortlist: _Optional[bool] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ...) -> None: ...
