"""The Markdown result files: ``loadtest/results/opennmt_speed.md`` and ``opennmt_quality.md``."""

from __future__ import annotations

from .common import OPENNMT, SMOKE_MINUTES


def speed_markdown(res: dict) -> str:
    lines = ["# Training speed: our trainer beside OpenNMT-py " + OPENNMT, ""]
    if res["smoke"]:
        lines += [(f"**SMOKE figures** ({res['minutes']:g} min per run): they show the measurement works; "
                   f"issue 14's acceptance needs runs of {SMOKE_MINUTES:g} minutes and more."), ""]
    lines += [(f"Corpus {res['corpus']}, tokenizers {res['tokenizers']}; {res['minutes']:g} min of wall clock per "
              f"run, {len(res['rounds'])} round(s), alternating; token batches of 3000, {res['threads']} torch "
              f"threads, CPU; {res['machine']}; {res['date']}. Sentences and target tokens (EOS counted) of "
              "the batches trained, over the training time (after start-up: corpus encoding for ours, the "
              "first bucket for OpenNMT); no validation inside the budget. Sents/step tells how full each "
              "system packs its 3000-token batches. A load average over the CPU count means other processes "
              "shared the CPUs: such rounds do not compare the trainers."), "",
              ("| round | order | ours sents/s | OpenNMT sents/s | ours tgt tok/s | OpenNMT tgt tok/s "
               "| ours steps (sents/step) | OpenNMT steps (sents/step) | load avg after ours / OpenNMT "
               "| ours/OpenNMT (sents/s) |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rounds"]:
        o, n = r["ours"], r["opennmt"]
        lines.append(f"| {r['round']} | {r['order']} | {o['sents_per_s']:.1f} | {n['sents_per_s']:.1f} | "
                     f"{o['tgt_tokens_per_s']:.0f} | {n['tgt_tokens_per_s']:.0f} | "
                     f"{o['steps']} ({o['sentences'] / o['steps']:.0f}) | "
                     f"{n['steps']} ({n['sentences'] / n['steps']:.0f}) "
                     f"| {o.get('loadavg_end', '?')} / {n.get('loadavg_end', '?')} "
                     f"| {o['sents_per_s'] / n['sents_per_s']:.2f} |")
    m = res["median"]
    lines.append(f"| **median** | | **{m['ours']['sents_per_s']:.1f}** | **{m['opennmt']['sents_per_s']:.1f}** | "
                 f"**{m['ours']['tgt_tokens_per_s']:.0f}** | **{m['opennmt']['tgt_tokens_per_s']:.0f}** | | | | "
                 f"**{m['ours']['sents_per_s'] / m['opennmt']['sents_per_s']:.2f}** |")
    first = res["rounds"][0]
    lines += ["", f"Parameters: ours {first['ours']['parameters']:,}, OpenNMT {first['opennmt']['parameters']:,}.",
              "", "Made by `loadtest/opennmt_compare.py speed`."]
    return "\n".join(lines) + "\n"


def quality_markdown(res: dict) -> str:
    st = res["opennmt"]["stats"]
    lines = ["# Translation quality: our model beside an OpenNMT-py " + OPENNMT + " RNN", ""]
    if res["smoke"]:
        lines += [("**SMOKE figures**: a short OpenNMT training and/or a subset of sentences; they show the "
                   "pipeline works, they are not issue 14's acceptance figures."), ""]
    train_min = st.get("train_s", 0) / 60
    lines += [(f"Corpus {res['corpus']}, beam {res['beam']}, placeholders protected for both (our tokenizer) "
               "and restored as `nmt evaluate` does; sacreBLEU and chrF against the catalog translations "
               "(tgt_raw), scored by export/evaluate/evaluate.py `scores`."), "",
              (f"OpenNMT: `{res['opennmt']['checkpoint']}`, {st.get('parameters', 0):,} parameters, "
               f"{st.get('steps', '?')} steps, {train_min:.1f} min of training "
               f"({st.get('sents_per_s', 0):.1f} sents/s).")]
    if res["ours"]:
        o = res["ours"]
        ts = o["train_state"]
        lines.append(f"Ours: `{o['checkpoint']}`, {o['parameters']:,} parameters, {ts.get('step', '?')} steps, "
                     f"{ts.get('elapsed', 0) / 60:.1f} min of training"
                     f"{'' if o['same_tokenizers'] else ' (WARNING: other SentencePiece models)'}.")
        ours_min = ts.get("elapsed", 0) / 60
        if abs(ours_min - train_min) > 0.1 * max(ours_min, train_min):
            lines.append(f"**Not the same wall time** ({train_min:.1f} against {ours_min:.1f} min): this table "
                         "does not decide the acceptance.")
    lines += ["", ("| split | sentences | system | BLEU | chrF | BLEU w/o placeholders | BLEU unseen "
                   "| BLEU normalized | placeholders kept | seconds |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for split, row in res["splits"].items():
        for who, label in (("ours", "ours"), ("opennmt", "OpenNMT-py")):
            if who in row:
                r = row[who]
                lines.append(f"| {split} | {row['sentences']} | {label} | {r['bleu']} | {r['chrf']} | "
                             f"{r['bleu_without_placeholders']} | {r['bleu_unseen']} | {r['bleu_normalized']} | "
                             f"{r['placeholders_kept']:.2%} | {r['seconds']} |")
    lines += [""] + unknown_lines(res["splits"]) + ["Made by `loadtest/opennmt_compare.py evaluate`."]
    return "\n".join(lines) + "\n"


NAMES = {"ours": "ours", "opennmt": "OpenNMT-py"}


def unknown_lines(splits: dict) -> list[str]:
    """Characters with no vocabulary piece: how many runs each split's sources hold, and the share
    of them each system's translations keep (issue 30, item 4)."""
    parts = []
    for split, row in splits.items():
        runs = row["ours"].get("unknown_runs")
        if runs:
            kept = ", ".join(f"{label} {row[w]['unknown_kept']:.0%}" for w, label in NAMES.items()
                             if w in row and row[w].get("unknown_kept") is not None)
            parts.append(f"{split} {runs} run(s), kept by {kept}")
    if not parts:
        return []
    return ["Characters with no vocabulary piece (protected as placeholders are): " + "; ".join(parts) + ".", ""]
