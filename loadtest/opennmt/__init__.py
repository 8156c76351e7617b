"""OpenNMT-py beside our trainer: the stages of ``loadtest/opennmt_compare.py``.

``common`` (paths, the options that make OpenNMT-py's RNN ours in size and recipe,
helpers), ``prepare`` (``setup``, ``prepare``), ``train`` (``train`` and the clocked
worker that runs inside OpenNMT-py's virtualenv), ``speed`` (both trainers alternating),
``evaluate`` (both systems scored alike), ``report`` (the Markdown result files).

Only the standard library is imported at module level: the worker imports ``train``
inside OpenNMT-py's virtualenv, which has neither ``export`` nor ``service``.
"""
