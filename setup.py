"""The one compiled part of nmt-serve: the decoder step's fused attention and output layer
(service/decoding/attention.c, output_layer.c, kernels.h).

Optional: where no C compiler is found the package installs without it and the service serves the
step as ONNX Runtime's operators alone (service/decoding/fused.py says so in one log line).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("service.decoding._attention",
                             ["service/decoding/attention.c", "service/decoding/output_layer.c"],
                             depends=["service/decoding/kernels.h"],
                             extra_compile_args=["-O3", "-std=gnu11", "-Wno-psabi"], optional=True)])
