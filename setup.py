"""The one compiled part of nmt-serve: the decoder step's fused attention, query, middle and output layer, and
the encoder's GRU and rest, and a text's shortlist words (service/decoding/attention.c, middle.c,
output_layer.c, shortlist_layer.c, encoder.c, encoder_rest.c, shortlist_words.c, query.c, kernels.h).

Optional: where no C compiler is found the package installs without it and the service serves the
step and the encoder on ONNX Runtime's operators alone (service/decoding/fused.py and
fused_encoder.py say so in one log line each).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("service.decoding._attention",
                             ["service/decoding/attention.c", "service/decoding/output_layer.c",
                              "service/decoding/encoder.c", "service/decoding/shortlist_layer.c",
                              "service/decoding/middle.c", "service/decoding/shortlist_words.c",
                              "service/decoding/encoder_rest.c", "service/decoding/query.c"],
                             depends=["service/decoding/kernels.h"],
                             extra_compile_args=["-O3", "-std=gnu11", "-Wno-psabi"], optional=True)])
