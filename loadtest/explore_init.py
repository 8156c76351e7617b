"""Exploratory (issue 14, OpenNMT-py's per-update lead): PyTorch's default initialisation against
OpenNMT's uniform(-0.1, 0.1), RNNsearch, the same batches, 350 updates, one validation at the end.

    .venv/bin/python loadtest/explore_init.py default   # -> build/ab-init-default/
    .venv/bin/python loadtest/explore_init.py uniform   # -> build/ab-init-uniform/
"""
import sys
from pathlib import Path

import torch

import export.train as T

variant = sys.argv[1]
if variant == "uniform":
    Orig = T.RNNSearch
    class Uniform(Orig):
        def __init__(self, config):
            super().__init__(config)
            for p in self.parameters():
                torch.nn.init.uniform_(p, -0.1, 0.1)
    T.RNNSearch = Uniform
cfg = T.TrainConfig(max_steps=350, validate_steps=350, minutes=1000, threads=2)
T.train(Path("build/corpus-v2"), Path("build/tokenizers-v2"), Path(f"build/ab-init-{variant}"),
        model_config={"attention": "bahdanau"}, config=cfg)
