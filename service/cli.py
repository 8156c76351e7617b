"""``nmt``: one command, online subcommands here, offline ones from ``export/``.

Offline subcommands are registered under the ``nmt.commands`` entry-point
group and imported only when asked for, so ``nmt serve`` never imports torch
and the serving image (which has no ``export/``) answers them with how to
install them.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points

ONLINE = {
    "serve": ("service.api.main", "main", "run the gRPC translation server"),
    "translate": ("service.clients.translate", "main", "translate text with a running server"),
    "translate-po": ("service.clients.po", "main", "fill a gettext catalog with a running server"),
}
OFFLINE = {
    "corpus": "build the parallel corpus from gettext catalogs",
    "tokenizers": "train the SentencePiece models on the train split",
    "train": "train an RNNsearch model",
    "release": "strip a training checkpoint for shipping (fp16, no optimizer)",
    "evaluate": "BLEU/chrF, BLEU by length, attention heatmaps",
    "export": "export a checkpoint to an ONNX model repository",
    "verify": "verify a model repository against its checkpoint",
    "prune": "keep only some precisions' graphs in a model repository (its shipped form)",
    "compare": "the attention kinds side by side (BLEU by length, step time, heatmaps)",
}
INSTALL_HINT = "pip install 'nmt-serve[export]' (from a source checkout: pip install -e '.[export]')"


def usage() -> str:
    lines = ["usage: nmt COMMAND [options]   (nmt COMMAND --help for its options)", "", "online:"]
    lines += [f"  {name:<12} {help_}" for name, (_, _, help_) in ONLINE.items()]
    lines += ["", "offline (needs the export extra):"]
    lines += [f"  {name:<12} {help_}" for name, help_ in OFFLINE.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in ONLINE:
        module, func, _ = ONLINE[command]
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    found = [ep for ep in entry_points(group="nmt.commands") if ep.name == command]
    if not found and command not in OFFLINE:
        print(f"nmt: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        run = found[0].load() if found else None
    except ImportError as e:
        run = None
        reason = f"{e.name or e} is not installed"
    else:
        reason = "the offline tools are not installed"
    if run is None:
        print(f"nmt {command}: offline command, not available here ({reason}); {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
