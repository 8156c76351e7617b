"""The one compiled part of nmt-serve: the decoder step's fused attention (service/decoding/attention.c).

Optional: where no C compiler is found the package installs without it and the service serves the
step as ONNX Runtime's operators alone (service/decoding/fused.py says so in one log line).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("service.decoding._attention", ["service/decoding/attention.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wno-psabi"], optional=True)])
